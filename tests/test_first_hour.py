"""A newcomer's first hour on the real CLI: one-line errors, a finished run that says so, whole paths,
tags to search by, and no warning walls."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, FAST, run_fit, runs_of

pytestmark = pytest.mark.e2e

SHORT = ("--config", str(CONFIGS / "digits.yaml"), *FAST, "--log_model", "false", "--trainer.max_epochs", "1",
         "--trainer.limit_val_batches", "2")


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_an_unknown_key_is_one_error_line_not_the_usage(tmp_path: Path) -> None:
    result = run_fit(tmp_path, *SHORT, "--trainer.max_epochz", "3")
    assert result.returncode == 2
    assert lines(result.stderr) == ["error: unrecognized arguments: --trainer.max_epochz 3",
                                    "(python -m recipes.fit --help lists every option)"]
    assert runs_of(tmp_path, "digits") == []


def test_a_bad_value_names_it_in_one_line(tmp_path: Path) -> None:
    result = run_fit(tmp_path, *SHORT, "--trainer.max_epochs", "many")
    assert result.returncode == 2
    assert lines(result.stderr) == ["error: trainer.max_epochs: expected int, got 'many'",
                                    "(python -m recipes.fit --help lists every option)"]


@pytest.fixture
def finished(tmp_path: Path) -> tuple[Path, subprocess.CompletedProcess]:
    return tmp_path, run_fit(tmp_path, *SHORT, "--run_name", "done", check=True)


def test_relaunching_a_finished_run_says_it_is_complete(finished: tuple[Path, subprocess.CompletedProcess]) -> None:
    workdir, _ = finished
    again = run_fit(workdir, *SHORT, "--run_name", "done")
    assert again.returncode == 0
    (run,) = runs_of(workdir, "digits")
    assert lines(again.stdout) == [
        f"run digits/done is already complete (finished at step 45, val/acc {run.data.metrics['val/acc']:.4f}; "
        f"MLflow run {run.info.run_id}). To train longer, relaunch with a larger --trainer.max_epochs (or "
        "--trainer.max_steps); to start over, add --fresh true or choose a new --run_name."]
    assert "Resuming from" not in again.stderr
    assert run.info.status == "FINISHED"


def test_the_end_table_prints_paths_whole_when_piped(finished: tuple[Path, subprocess.CompletedProcess]) -> None:
    workdir, result = finished
    assert "…" not in result.stdout
    run_dir = re.search(r"run dir\s+│ (\S+)", result.stdout)
    assert run_dir is not None and run_dir.group(1) == "runs/digits/done"
    plot = re.search(r"time breakdown\s+│ (\S+)", result.stdout)
    assert plot is not None and (workdir / plot.group(1)).is_file()


def test_runs_carry_tags_to_search_by(finished: tuple[Path, subprocess.CompletedProcess]) -> None:
    workdir, _ = finished
    (run,) = runs_of(workdir, "digits")
    tags = run.data.tags
    assert tags["atscale.recipe"] == "digits.yaml"
    assert tags["atscale.model"] == "ImageClassifier"
    assert tags["atscale.data"] == "DigitsDataModule"
    assert tags["atscale.strategy"] == "auto"
    assert tags["atscale.devices"] == "auto x 1"
    assert tags["atscale.precision"] == "32-true"
    assert tags["atscale.market"] == "on_demand"
    assert re.fullmatch(r"[0-9a-f]{40}", tags["atscale.git_sha"])
    assert tags["mlflow.note.content"].startswith("```\npython") and "--run_name done" in tags["mlflow.note.content"]


def test_a_run_prints_no_warning_wall(finished: tuple[Path, subprocess.CompletedProcess]) -> None:
    _, result = finished
    noise = ("weights_only", "LeafSpec", "set_vital", "litlogger", "INFO mlflow", "Seed set to",
             "previous checkpoint was still being written")
    assert not [line for line in lines(result.stderr) if any(n in line for n in noise)], result.stderr
    counts: dict[str, int] = {}
    for line in lines(result.stderr) + lines(result.stdout):
        counts[line] = counts.get(line, 0) + 1
    assert max(counts.values()) <= 2, [k for k, v in counts.items() if v > 2]
    assert len(lines(result.stderr)) <= 6, result.stderr  # the budget: GPU/TPU lines, experiment created, stopped
