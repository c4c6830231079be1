"""A newcomer's first hour on the real CLI: one-line errors, a finished run that says so, whole paths,
tags to search by, and no warning walls.

One finished run is shared by the tests that read it (module scope); launches that never train run in-process
(``fit_in_process``), except the first, which checks that a real subprocess exits with the code and the
lines the CLI returns.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, FAST, CliResult, run_fit, runs_of, start_fit

pytestmark = pytest.mark.e2e

SHORT = ("--config", str(CONFIGS / "digits.yaml"), *FAST, "--log_model", "false", "--trainer.max_epochs", "1",
         "--trainer.limit_val_batches", "2")


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_an_unknown_key_is_one_error_line_not_the_usage(tmp_path: Path) -> None:
    result = run_fit(tmp_path, *SHORT, "--trainer.max_epochz", "3", real=True)  # its exit code is main's
    assert result.returncode == 2
    assert lines(result.stderr) == ["error: unrecognized arguments: --trainer.max_epochz 3",
                                    "(python -m recipes.fit --help lists every option)"]
    assert runs_of(tmp_path, "digits") == []


def test_a_bad_value_names_it_in_one_line(tmp_path: Path, fit_in_process: Callable[..., CliResult]) -> None:
    result = fit_in_process(*SHORT, "--trainer.max_epochs", "many")
    assert result.returncode == 2
    assert lines(result.stderr) == ["error: trainer.max_epochs: expected int, got 'many'",
                                    "(python -m recipes.fit --help lists every option)"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """One finished one-epoch run, read by the tests below (the relaunch among them changes nothing)."""
    workdir = tmp_path_factory.mktemp("finished")
    return workdir, run_fit(workdir, *SHORT, "--run_name", "done", check=True, real=True)  # import warnings too


def test_relaunching_a_finished_run_says_it_is_complete(finished: tuple[Path, subprocess.CompletedProcess],
                                                        fit_in_process: Callable[..., CliResult]) -> None:
    workdir, _ = finished
    again = fit_in_process(*SHORT, "--run_name", "done", workdir=workdir)
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


def test_an_offline_download_is_one_line_before_any_mlflow_run(tmp_path: Path,
                                                              fit_in_process: Callable[..., CliResult]) -> None:
    # every URL goes to a closed port on loopback: a download fails at once, with or without internet
    result = fit_in_process(*SHORT, "--experiment", "mnist", "--data", "datamodules.vision.MNISTDataModule",
                            "--data.init_args.root", "data/", "--model.init_args.in_channels", "1",
                            http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9")
    assert result.returncode == 2
    errors = [line for line in lines(result.stderr) if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: MNISTDataModule: downloading MNIST into ")
    assert "Traceback" not in result.stderr
    assert runs_of(tmp_path, "mnist") == []


def test_ctrl_c_during_start_up_is_one_line_and_a_stop(tmp_path: Path) -> None:
    proc = start_fit(tmp_path, *SHORT, "--trainer.max_epochs", "50", "--run_name", "c", real=True,
                     start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "runs/digits/c/config.yaml").exists():  # written at setup, before training
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    if proc.returncode == 130:  # before SpotCheckpoint took the signals: the process stops where it is
        assert lines(stderr)[-1] == "interrupted (SIGINT): the run stopped; relaunch the same command to resume it."
    else:  # once it has them, a Ctrl-C is a notice: saved at the first step
        assert proc.returncode == 75, stderr[-3000:]
        (line,) = [line for line in lines(stderr) if line.startswith("atscale:")]
        assert line.startswith("atscale: stopped at step 1 on an interruption notice") and line.endswith("--run_name c")
    assert [r.info.status for r in runs_of(tmp_path, "digits")] == ["KILLED"]
