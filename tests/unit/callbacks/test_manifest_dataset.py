"""Manifest logs the training data as the run's MLflow dataset input, once however many launches."""

from __future__ import annotations

from pathlib import Path

import mlflow
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import MLFlowLogger

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
