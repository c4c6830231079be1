"""Manifest logs the training data as the run's MLflow dataset input, once however many launches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow
import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import MLFlowLogger
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import BAD_REQUEST, INTERNAL_ERROR

from callbacks.manifest import Manifest
from datamodules.digits import DigitsDataModule
from recipes.classifier import ImageClassifier


def _fit(tmp_path: Path, uri: str, run_id: str | None) -> str:
    logger = MLFlowLogger(experiment_name="e", tracking_uri=uri, run_id=run_id)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, logger=logger,
                      default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, callbacks=[Manifest(tmp_path / "run")])
    trainer.fit(ImageClassifier(num_classes=10, in_channels=1, width=4), datamodule=DigitsDataModule(batch_size=32))
    return logger.run_id


def test_the_training_data_is_the_runs_dataset_input(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = _fit(tmp_path, uri, None)
    _fit(tmp_path, uri, run_id)  # a relaunch into the same run
    inputs = mlflow.MlflowClient(uri).get_run(run_id).inputs.dataset_inputs
    assert [(i.dataset.name, i.dataset.digest, i.dataset.source_type) for i in inputs] == \
        [("DigitsDataModule", DigitsDataModule().fingerprint()[:36], "code")]
    assert [(t.key, t.value) for t in inputs[0].tags] == [("mlflow.data.context", "train")]
    assert '"datamodule": "datamodules.digits.DigitsDataModule"' in inputs[0].dataset.source


def test_a_launch_that_loses_the_dataset_insert_race_still_records_its_input(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Launches starting together into one experiment race to insert the same dataset row.

    A tracking server answers the loser with PostgreSQL's unique violation as a 400, which MLflow's client does not
    retry; the row exists by then, so the launch asks again rather than failing the run. The fake below loses the
    race once (tests/e2e/test_team_server.py races 8 real launches).
    """
    real = mlflow.MlflowClient.log_inputs
    calls: list[str] = []

    def racing(self: mlflow.MlflowClient, run_id: str, datasets: Any = None, **kwargs: Any) -> None:
        calls.append(run_id)
        if len(calls) == 1:
            raise MlflowException("(psycopg2.errors.UniqueViolation) duplicate key value violates unique constraint "
                                  '"dataset_pk"', error_code=BAD_REQUEST)
        real(self, run_id, datasets=datasets, **kwargs)

    monkeypatch.setattr(mlflow.MlflowClient, "log_inputs", racing)
    monkeypatch.setattr("callbacks.manifest.DATASET_RETRY_WAIT_S", 0.0)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = _fit(tmp_path, uri, None)
    assert len(calls) == 2
    inputs = mlflow.MlflowClient(uri).get_run(run_id).inputs.dataset_inputs
    assert [i.dataset.name for i in inputs] == ["DigitsDataModule"]


def test_a_store_that_keeps_refusing_the_input_costs_a_warning_not_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refusing(self: mlflow.MlflowClient, run_id: str, datasets: Any = None, **kwargs: Any) -> None:
        raise MlflowException("store says no", error_code=INTERNAL_ERROR)

    monkeypatch.setattr(mlflow.MlflowClient, "log_inputs", refusing)
    monkeypatch.setattr("callbacks.manifest.DATASET_RETRY_WAIT_S", 0.0)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.warns(UserWarning, match=r"dataset input was not recorded after 3 attempts: store says no"):
        run_id = _fit(tmp_path, uri, None)
    run = mlflow.MlflowClient(uri).get_run(run_id)
    assert run.inputs.dataset_inputs == []
    assert "manifest.json" in [a.path for a in mlflow.MlflowClient(uri).list_artifacts(run_id)]
