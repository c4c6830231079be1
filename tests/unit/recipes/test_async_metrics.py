"""The recipe's MLflow logger logs metrics asynchronously: every window arrives, in order, with its step,
once the run is terminated (Lightning's finalize) or flushed (no training)."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest
from lightning.pytorch.loggers import MLFlowLogger

from recipes.run.cli import (
    ASYNC_LOGGING_BUFFER_ENV,
    ASYNC_LOGGING_BUFFER_S,
    ASYNC_LOGGING_THREADS_ENV,
    flush_async_metrics,
)


@pytest.mark.e2e
@pytest.mark.parametrize("end", ["finalize", "flush"])
@pytest.mark.parametrize("buffer_s", [None, ASYNC_LOGGING_BUFFER_S])  # MLflow's default, the recipe's
def test_async_metrics_arrive_in_order_with_exact_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        end: str, buffer_s: str | None) -> None:
    monkeypatch.setenv(ASYNC_LOGGING_THREADS_ENV, "1")
    if buffer_s is not None:
        monkeypatch.setenv(ASYNC_LOGGING_BUFFER_ENV, buffer_s)
    else:
        monkeypatch.delenv(ASYNC_LOGGING_BUFFER_ENV, raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setattr(mlflow.tracking._tracking_service.utils, "_tracking_uri", uri)
    logger = MLFlowLogger(experiment_name="async", tracking_uri=uri, synchronous=False)
    for step in range(0, 200, 10):
        logger.log_metrics({"train/loss": 1000.0 - step, "time/step_s": step / 10}, step=step)
    if end == "finalize":
        logger.finalize("success")
    else:
        flush_async_metrics()
    client = mlflow.MlflowClient(uri)
    history = client.get_metric_history(logger.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(s, 1000.0 - s) for s in range(0, 200, 10)]
    assert [m.step for m in client.get_metric_history(logger.run_id, "time/step_s")] == list(range(0, 200, 10))
    run = client.get_run(logger.run_id)
    assert run.data.metrics["train/loss"] == 810.0  # the latest step's value
    if end == "finalize":
        assert run.info.status == "FINISHED"
