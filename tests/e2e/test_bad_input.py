"""Bad input: one clear error naming the bad value, exit code 2, and no MLflow run left RUNNING.

Refusals at start-up run in-process (``fit_in_process``: the CLI's code path without an interpreter start-up each);
the failure in the middle of a run is a real subprocess.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from recipes.classifier import ImageClassifier
from tests.conftest import CONFIGS, FAST, CliResult, free_port, run_fit, runs_of

DIGITS = ("--config", str(CONFIGS / "digits.yaml"), *FAST)


class ExplodingClassifier(ImageClassifier):
    """Fails at its third training step: a real bug in the middle of a run."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_step == 2:
            raise RuntimeError("boom at step 2")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(("args", "named"), [
    (("--trainer.no_such_key", "1"), "no_such_key"),
    (("--trainer.max_epochs", "many"), "many"),
    (("--trainer.strategy", "warp_drive"), "warp_drive"),
    (("--trainer.accelerator", "cpu", "--trainer.devices", "64"), "trainer.devices=64"),
    (("--data", "datamodules.vision.MNISTDataModule", "--data.init_args.root", "/no/such/folder",
      "--data.init_args.download", "false"), "/no/such/folder"),
    (("--spot.provider", "ibm"), "ibm"),
    (("--cost.instance", "p9.mega"), "p9.mega"),
    (("--cost.market", "spot", "--cost.instance", "p4d.24xlarge"), "p4d.24xlarge"),  # no spot price listed
    # checked where the class lives, at construction: the optimizer's own checks, the module's, the trainer's
    (("--model.init_args.optimizer.init_args.lr", "-1"), "Invalid learning rate: -1.0"),
    (("--model.init_args.optimizer.init_args.weight_decay", "-1"), "Invalid weight_decay value: -1.0"),
    (("--model.init_args.width", "0"), "ImageClassifier(width=0)"),
    (("--model.init_args.in_channels", "0"), "ImageClassifier(in_channels=0)"),
    (("--trainer.val_check_interval", "0"), "trainer.val_check_interval=0"),
    (("--trainer.check_val_every_n_epoch", "0"), "trainer.check_val_every_n_epoch=0"),
    (("--trainer.accumulate_grad_batches", "0"), "trainer.accumulate_grad_batches=0"),
])
def test_bad_value_exits_2_naming_it(tmp_path: Path, args: tuple[str, ...], named: str,
                                     fit_in_process: Callable[..., CliResult]) -> None:
    result = fit_in_process(*DIGITS, *args)
    assert result.returncode == 2, result.stderr[-3000:]
    assert named in result.stderr
    assert "Traceback" not in result.stderr
    assert runs_of(tmp_path, "digits") == []  # nothing started
    assert nothing_written(tmp_path)


def nothing_written(workdir: Path) -> bool:
    """No run directory, lock file, config or manifest was left under ``workdir/runs``."""
    left = sorted(str(p.relative_to(workdir)) for p in (workdir / "runs").rglob("*")) if (workdir / "runs").exists() \
        else []
    assert left == [], left
    return True


@pytest.mark.parametrize(("first", "fixed"), [
    (("--model.init_args.optimizer.init_args.lr", "-1"), ()),
    (("--trainer.val_check_interval", "0"), ()),
    (("--model.init_args.width", "0"), ()),
    (("--model.init_args.width", "0"), ("--fresh", "true")),
])
def test_a_refused_first_launch_never_blocks_the_corrected_one(tmp_path: Path, first: tuple[str, ...],
                                                               fixed: tuple[str, ...],
                                                               fit_in_process: Callable[..., CliResult]) -> None:
    args = (*DIGITS, "--run_name", "a6", "--trainer.max_steps", "3", "--trainer.limit_val_batches", "1",
            "--log_model", "false")
    assert fit_in_process(*args, *first).returncode == 2
    corrected = fit_in_process(*args, *fixed)
    assert corrected.returncode == 0, corrected.stderr[-3000:]
    assert [r.info.status for r in runs_of(tmp_path, "digits")] == ["FINISHED"]


def test_a_first_launch_that_failed_before_any_checkpoint_never_blocks_a_changed_relaunch(tmp_path: Path) -> None:
    """A first launch that failed mid-run (a bug, a bad value no check caught) left a FAILED MLflow run and no
    checkpoint: there is no training state a changed config could be ignored by, so the relaunch starts, in a new
    MLflow run (the failed one keeps its own params)."""
    args = (*DIGITS, "--run_name", "a6", "--trainer.max_steps", "3", "--trainer.limit_val_batches", "1",
            "--log_model", "false")
    failed = run_fit(tmp_path, *args, "--model", "tests.e2e.test_bad_input.ExplodingClassifier",
                     "--model.init_args.optimizer.init_args.lr", "0.5")
    assert failed.returncode == 1 and "boom at step 2" in failed.stderr
    assert not list((tmp_path / "runs/digits/a6/checkpoints").glob("step=*"))
    corrected = run_fit(tmp_path, *args)
    assert corrected.returncode == 0, corrected.stderr[-3000:]
    assert "resuming would keep the checkpoint's training state" not in corrected.stderr
    runs = sorted(runs_of(tmp_path, "digits"), key=lambda r: r.info.start_time)
    assert [r.info.status for r in runs] == ["FAILED", "FINISHED"]
    assert runs[1].data.params["model.init_args.optimizer.init_args.lr"] == "0.003"


@pytest.mark.parametrize(("uri", "named"), [
    ("bogus://x", "bogus://x"),
    ("file:///proc/nope", "file:///proc/nope"),
    ("sqlite:////nonexistent/dir/x.db", "/nonexistent/dir"),
])
def test_a_tracking_store_that_cannot_be_used_exits_2_naming_it(tmp_path: Path, uri: str, named: str,
                                                                fit_in_process: Callable[..., CliResult]) -> None:
    result = fit_in_process(*DIGITS, MLFLOW_TRACKING_URI=uri)
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and named in line
    assert not Path("/nonexistent").exists()  # the store's folder is not made up
    assert nothing_written(tmp_path)


def test_unreachable_tracking_server_exits_2_naming_it(fit_in_process: Callable[..., CliResult]) -> None:
    uri = f"http://127.0.0.1:{free_port()}"
    result = fit_in_process(*DIGITS, MLFLOW_TRACKING_URI=uri)
    assert result.returncode == 2
    assert f"MLflow tracking server {uri} is unreachable" in result.stderr
    assert "Traceback" not in result.stderr


def test_failure_mid_run_marks_the_mlflow_run_failed(tmp_path: Path) -> None:
    result = run_fit(tmp_path, *DIGITS, "--model", "tests.e2e.test_bad_input.ExplodingClassifier")
    assert result.returncode == 1
    assert "boom at step 2" in result.stderr  # a real bug keeps its traceback
    (run,) = runs_of(tmp_path, "digits")
    assert run.info.status == "FAILED"
