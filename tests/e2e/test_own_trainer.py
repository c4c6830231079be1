"""The script of docs/guides/own-trainer.md, run as it stands: a plain ``Trainer`` with the project's callbacks.

It runs once whole, and once interrupted by a real SIGTERM after its first checkpoint and launched again. The
interrupted run exits 75 leaving a good checkpoint, the relaunch continues the same MLflow run, and the two end
bitwise equal; the MLflow run has its params; checkpoints stay where the script puts them, pruned to ``keep``.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import mlflow
import pytest

from callbacks.storage import ckpt_store
from tests.conftest import REPO, assert_bitwise_equal, cli_env, final_weights, start_module
from tests.forked import ForkedProcess

pytestmark = pytest.mark.e2e

PAGE = REPO / "docs" / "guides" / "own-trainer.md"


def script() -> str:
    (code,) = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    return code


def workdir(root: Path) -> tuple[Path, dict[str, str]]:
    root.mkdir()
    (root / "configs").symlink_to(REPO / "configs")
    (root / "train.py").write_text(script())
    return root, cli_env(root, OMP_NUM_THREADS="1")  # one thread count for every launch: exact resume


def launch(root: Path, env: dict[str, str]) -> subprocess.Popen | ForkedProcess:
    """``python train.py`` in ``root`` (a fork of the session's zygote where the environment allows)."""
    return start_module("train", cwd=root, env=env, script=root / "train.py", stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)


def test_the_page_script_resumes_exactly_and_tracks_one_run(tmp_path: Path) -> None:
    whole, whole_env = workdir(tmp_path / "whole")
    cut, cut_env = workdir(tmp_path / "cut")
    reference = launch(whole, whole_env)
    interrupted = launch(cut, cut_env)
    checkpoints = cut / "runs" / "digits" / "own-trainer" / "checkpoints"
    deadline = time.monotonic() + 300
    while not any(checkpoints.glob("step=*.ckpt.meta.json")):
        assert interrupted.poll() is None, interrupted.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.02)
    interrupted.send_signal(signal.SIGTERM)  # a spot notice, as Kubernetes sends it
    _, err = interrupted.communicate(timeout=300)
    assert interrupted.returncode == 75, err[-3000:]
    saved = ckpt_store.newest_good(checkpoints)
    assert saved is not None and 20 <= saved.global_step < 45, saved  # mid-fit, and verified
    first_id = saved.extra["mlflow_run_id"]

    again = launch(cut, cut_env)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    _, err = reference.communicate(timeout=300)
    assert reference.returncode == 0, err[-3000:]
    assert_bitwise_equal(final_weights(cut, "own-trainer"), final_weights(whole, "own-trainer"))

    client = mlflow.MlflowClient(f"sqlite:///{cut / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("digits").experiment_id])
    assert run.info.run_id == first_id and run.info.status == "FINISHED"  # one MLflow run, continued
    assert run.data.params["num_classes"] == "10" and run.data.params["decision"] == "bayes"
    assert run.data.metrics["spot/interruptions"] == 1.0
    assert sorted(p.name for p in checkpoints.glob("step=*.ckpt")) == ["step=00000040.ckpt", "step=00000045.ckpt"]
    # nothing beside the run's directory and MLflow's (its store, its artifact root): no ./1/<run id>/checkpoints/
    assert sorted(p.name for p in cut.iterdir()) == ["configs", "mlflow.db", "mlruns", "runs", "train.py"]
    assert (cut / "runs" / "digits" / "own-trainer" / "time_breakdown.png").is_file()
