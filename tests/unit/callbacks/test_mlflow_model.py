"""callbacks.mlflow_model.LogModel: deferral past trainer.fit (what the CLI asks for), without MLflow."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

from callbacks.mlflow_model import LogModel


def _trainer(world_size: int = 1, interrupted: bool = False) -> SimpleNamespace:
    return SimpleNamespace(world_size=world_size, callbacks=[SimpleNamespace(interrupted=interrupted)])


def test_deferred_model_is_logged_once_after_fit() -> None:
    callback, trainer, module = LogModel(defer=True), _trainer(), object()
    with mock.patch.object(LogModel, "_log_fit") as log_fit:
        callback.on_fit_end(trainer, module)
        log_fit.assert_not_called()  # not inside trainer.fit
        callback.log_deferred()
        log_fit.assert_called_once_with(trainer, module)
        callback.log_deferred()
        log_fit.assert_called_once()  # once only


def test_not_deferred_on_more_ranks_or_by_default_and_never_after_an_interruption() -> None:
    with mock.patch.object(LogModel, "_log_fit") as log_fit:
        LogModel().on_fit_end(_trainer(), "a")
        LogModel(defer=True).on_fit_end(_trainer(world_size=2), "b")  # every rank gathers inside fit, as before
        assert [c.args[1] for c in log_fit.call_args_list] == ["a", "b"]
        deferred = LogModel(defer=True)
        deferred.on_fit_end(_trainer(interrupted=True), "c")
        deferred.log_deferred()
        assert len(log_fit.call_args_list) == 2


def test_the_model_goes_to_the_loggers_store_not_the_global_one(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The logger's tracking URI, read through its public MlflowClient, is where the model is logged."""
    import mlflow
    from lightning.pytorch.loggers import MLFlowLogger

    from tests.conftest import TinyModule

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'global.db'}")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'global.db'}")
    own = f"sqlite:///{tmp_path / 'own.db'}"
    logger = MLFlowLogger(experiment_name="e", tracking_uri=own)
    trainer = SimpleNamespace(loggers=[logger], is_global_zero=True, datamodule=None)
    seen: list[str] = []

    def log(*args: object) -> SimpleNamespace:
        seen.append(mlflow.get_tracking_uri())
        return SimpleNamespace(model_uri="models:/m")

    with mock.patch.object(LogModel, "_log", side_effect=log):
        LogModel()._log_fit(trainer, TinyModule())  # type: ignore[arg-type]
    mlflow.set_tracking_uri(None)
    assert seen == [own]
