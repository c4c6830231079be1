"""ResumableMLFlowLogger against a real sqlite store: a relaunch adds only the points the run lacks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from recipes.run.resumable_logger import ResumableMLFlowLogger
from tests.conftest import REPO

# what an uninterrupted run logs: (step, metrics); "epoch" twice at step 2 (a train and a validation log)
SEQUENCE = [(0, {"baseline/acc": 0.1}), (1, {"train/loss": 2.0, "epoch": 0.0}), (2, {"train/loss": 1.5, "epoch": 0.0}),
            (2, {"val/acc": 0.5, "epoch": 0.0}), (3, {"train/loss": 1.25, "epoch": 1.0}),
            (4, {"train/loss": 1.0, "epoch": 1.0})]


def points(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    client = mlflow.MlflowClient(uri)
    keys = client.get_run(run_id).data.metrics
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def log(logger: ResumableMLFlowLogger, sequence: list) -> None:
    for step, metrics in sequence:
        logger.log_metrics(metrics, step=step)


def test_a_relaunch_leaves_the_history_of_an_uninterrupted_run(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    reference = ResumableMLFlowLogger(experiment_name="e", tracking_uri=uri)
    log(reference, SEQUENCE)

    # the interrupted launch got as far as the validation of step 2 (its "epoch" point included) ...
    first = ResumableMLFlowLogger(experiment_name="e", tracking_uri=uri)
    log(first, SEQUENCE[:4])
    # ... its checkpoint was at step 1: the relaunch logs its start (the baseline again) and redoes steps 2-4
    relaunch = ResumableMLFlowLogger(experiment_name="e", tracking_uri=uri, run_id=first.run_id)
    log(relaunch, [SEQUENCE[0], *SEQUENCE[2:]])

    assert points(uri, first.run_id) == points(uri, reference.run_id)
    assert points(uri, first.run_id)["epoch"] == [(1, 0.0), (2, 0.0), (2, 0.0), (3, 1.0), (4, 1.0)]


def test_a_relaunch_logs_what_the_kill_lost(tmp_path: Path) -> None:
    """Points the interrupted launch never stored (its async queue died with it) are logged by the redo."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = ResumableMLFlowLogger(experiment_name="e", tracking_uri=uri)
    log(first, SEQUENCE[:2])
    relaunch = ResumableMLFlowLogger(experiment_name="e", tracking_uri=uri, run_id=first.run_id)
    log(relaunch, SEQUENCE)
    reference = ResumableMLFlowLogger(experiment_name="e", tracking_uri=uri)
    log(reference, SEQUENCE)
    assert points(uri, first.run_id) == points(uri, reference.run_id)


def test_a_fresh_run_reads_no_history(tmp_path: Path, monkeypatch) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = ResumableMLFlowLogger(experiment_name="e", tracking_uri=uri)
    monkeypatch.setattr(logger, "_stored_points", lambda: (_ for _ in ()).throw(AssertionError("read")))
    log(logger, SEQUENCE)
    assert points(uri, logger.run_id)["train/loss"] == [(1, 2.0), (2, 1.5), (3, 1.25), (4, 1.0)]


def test_events_of_each_launch_are_all_logged(tmp_path: Path) -> None:
    """Two launches interrupted at one step are two interruptions: spot/* points are never left out."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = ResumableMLFlowLogger(experiment_name="e", tracking_uri=uri)
    first.log_metrics({"spot/interruptions": 1.0, "spot/lost_steps": 0.0}, step=50)
    again = ResumableMLFlowLogger(experiment_name="e", tracking_uri=uri, run_id=first.run_id)
    again.log_metrics({"spot/interruptions": 2.0, "spot/lost_steps": 0.0}, step=50)
    assert points(uri, first.run_id) == {"spot/interruptions": [(50, 1.0), (50, 2.0)],
                                         "spot/lost_steps": [(50, 0.0), (50, 0.0)]}


def test_unconfirmed_points_are_those_the_store_has_not_written(tmp_path: Path, monkeypatch) -> None:
    """Async writes: a point is unconfirmed until MLflow's queue wrote it; a refused write is kept and named."""
    monkeypatch.setenv("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", "1")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = ResumableMLFlowLogger(experiment_name="e", tracking_uri=uri, synchronous=False)
    logger.watch_writes()
    logger.log_metrics({"train/loss": 2.0}, step=1)
    pending, refused = logger.unconfirmed()
    assert [p[:3] for p in pending] == [["train/loss", 2.0, 1]] and refused is None  # still in the queue
    mlflow.flush_async_logging()
    assert logger.unconfirmed() == ([], None)  # written: nothing left to carry


def test_restore_logs_only_the_points_the_store_lacks(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = ResumableMLFlowLogger(experiment_name="e", tracking_uri=uri)
    log(first, SEQUENCE[:2])  # steps 0 and 1 reached the store; step 2's points (both logs) died in the queue
    # the checkpoint after step 2 carries every point its store had not confirmed, step 1's included
    record = [["train/loss", 2.0, 1, 1000], ["epoch", 0.0, 1, 1000], ["train/loss", 1.5, 2, 2000],
              ["epoch", 0.0, 2, 2000], ["val/acc", 0.5, 2, 2001], ["epoch", 0.0, 2, 2001]]
    relaunch = ResumableMLFlowLogger(experiment_name="e", tracking_uri=uri, run_id=first.run_id, restore=record)
    log(relaunch, [SEQUENCE[0], *SEQUENCE[4:]])  # its start, then the steps after the checkpoint
    reference = ResumableMLFlowLogger(experiment_name="e", tracking_uri=uri)
    log(reference, SEQUENCE)
    assert points(uri, first.run_id) == points(uri, reference.run_id)


# A rank Lightning's launcher starts (LOCAL_RANK 1), then global rank 0: what the CLI imports and the logger it makes
_RANK_PROBE = """
import os, sys
import recipes.run.cli  # the CLI, with every callback it adds
from recipes.run.resumable_logger import ResumableMLFlowLogger

def make():
    return ResumableMLFlowLogger(experiment_name="e", run_name="r", tracking_uri=sys.argv[1], run_id=None,
                                 tags={"k": "v"}, synchronous=False, restore=[])

def mlflow_imported():
    return any(m == "mlflow" or m.startswith("mlflow.") for m in sys.modules)

other = make()
other.log_metrics({"train/loss": 1.0}, step=1)  # Lightning's rank_zero_only: nothing on a rank other than 0
print(other.version, other.save_dir, mlflow_imported())
os.environ["LOCAL_RANK"] = "0"
make()
print(mlflow_imported())
"""


@pytest.mark.e2e  # a new interpreter that imports torch and Lightning
def test_a_rank_other_than_0_neither_imports_mlflow_nor_makes_a_client(tmp_path: Path) -> None:
    """Only global rank 0 writes to the store; each other rank's interpreter skips MLflow (about 1.6 CPU-s)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "SLURM_PROCID")}
    env.update(LOCAL_RANK="1", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", _RANK_PROBE, f"sqlite:///{tmp_path / 'mlflow.db'}"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["None", "None", "False", "True"], out.stdout
