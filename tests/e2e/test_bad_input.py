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
])
def test_bad_value_exits_2_naming_it(tmp_path: Path, args: tuple[str, ...], named: str,
                                     fit_in_process: Callable[..., CliResult]) -> None:
    result = fit_in_process(*DIGITS, *args)
    assert result.returncode == 2, result.stderr[-3000:]
    assert named in result.stderr
    assert "Traceback" not in result.stderr
    assert runs_of(tmp_path, "digits") == []  # nothing started


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
