"""A full tracking store, seen from the run's side: a store that cannot be created leaves nothing and says why in
one line (``recipes.run.tracking.ensure_store``), the store's last refused writes fail the run instead of finishing
it (``confirm_metrics``), lost points a relaunch cannot restore are named (``lost_steps``), and MLflow's own
tracebacks for each refused write stay off the screen (``recipes.run.process.quiet_known_noise``)."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlflow
import pytest

from recipes.run import tracking
from recipes.run.errors import MetricsRefused, StoreFull
from recipes.run.process import quiet_known_noise
from tests.unit.recipes.run.test_errors import as_mlflow_raises, sqlite_full


def test_a_store_created_on_a_full_disk_is_store_full_and_leaves_nothing(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    class FullDisk:  # MLflow's client creating the store: its file begun, then SQLite has no room to grow it
        def __init__(self, tracking_uri: str) -> None:
            Path(tracking_uri.removeprefix("sqlite:///")).write_bytes(b"SQLite format 3\0")

        def search_experiments(self, **kwargs: Any) -> None:
            raise as_mlflow_raises(sqlite_full())

    monkeypatch.setattr(mlflow, "MlflowClient", FullDisk)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(StoreFull) as caught:
        tracking.ensure_store(uri)
    assert str(caught.value) == (f"the tracking store {uri} is full (database or disk is full): it could not be "
                                 "created; free space and relaunch the same command")
    assert list(tmp_path.iterdir()) == []


def test_a_store_refused_for_another_reason_is_still_raised_as_it_was(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    class Locked:
        def __init__(self, tracking_uri: str) -> None:
            pass

        def search_experiments(self, **kwargs: Any) -> None:
            raise as_mlflow_raises(sqlite3.OperationalError("database is locked"))

    monkeypatch.setattr(mlflow, "MlflowClient", Locked)
    with pytest.raises(mlflow.exceptions.MlflowException):
        tracking.ensure_store(f"sqlite:///{tmp_path / 'mlflow.db'}")


class FakeLogger:
    """What ``confirm_metrics`` reads of ``ResumableMLFlowLogger``: its writes' outcome and the run's history."""

    def __init__(self, refused: BaseException | None = None, history: dict[str, list[int]] | None = None) -> None:
        self.refused, self.run_id = refused, "r1"
        history = history or {}
        self.experiment = SimpleNamespace(
            get_run=lambda run_id: SimpleNamespace(data=SimpleNamespace(metrics=dict.fromkeys(history, 0.0))),
            get_metric_history=lambda run_id, key: [SimpleNamespace(step=s) for s in history[key]])

    def unconfirmed(self) -> tuple[list[Any], BaseException | None]:
        return [], self.refused


def test_a_refused_last_write_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mlflow, "flush_async_logging", lambda: None)
    refused = as_mlflow_raises(sqlite_full())
    with pytest.raises(MetricsRefused) as caught:
        tracking.confirm_metrics(FakeLogger(refused), every=10, trained=90, continued=False)
    assert caught.value.__cause__ is refused
    tracking.confirm_metrics(FakeLogger(), every=10, trained=90, continued=False)  # all written: nothing to say
    tracking.confirm_metrics(object(), every=10, trained=90, continued=True)  # a logger that cannot tell: nothing


def test_a_relaunch_names_the_points_nothing_restored(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(mlflow, "flush_async_logging", lambda: None)
    every_step = [s for s in range(9, 90, 10) if s not in (9, 19)]
    history = {"train/loss": every_step, "train/acc": every_step, "train/acc_epoch": [44, 89],
               "train/samples_per_sec": [29], "val/acc": [44]}
    with caplog.at_level(logging.WARNING, logger="recipes.run.tracking"):
        tracking.confirm_metrics(FakeLogger(history=history), every=10, trained=90, continued=True)
        tracking.confirm_metrics(FakeLogger(history=history), every=10, trained=90, continued=False)  # not looked
    assert [r.getMessage() for r in caplog.records] == [
        "Metric points that the tracking store lost could not be restored (no checkpoint's record kept them): "
        "train/acc at steps 9, 19; train/loss at steps 9, 19."]


@pytest.mark.parametrize(("history", "lost"), [
    ({"train/loss": [9, 29, 39]}, {"train/loss": [19, 49]}),  # to the steps trained (59: not yet)
    ({"train/loss": [9, 19, 29, 39, 49]}, {}),
    ({"train/loss": [49, 99]}, {}),  # once an epoch (50 steps), on the cadence: not judged
    ({"train/loss": [9]}, {}),  # one point: not judged
    ({"train/loss": [9, 19, 33]}, {"train/loss": [29, 39, 49]}),  # 33: where a run stopped, off the cadence
    ({"train/loss": [9, 19, 29, 39, 49, 50]}, {}),
])
def test_lost_steps(history: dict[str, list[int]], lost: dict[str, list[int]]) -> None:
    assert tracking.lost_steps(history, every=10, trained=59) == lost


def test_mlflows_tracebacks_for_a_full_stores_writes_are_dropped_others_kept(
        capsys: pytest.CaptureFixture) -> None:
    quiet_known_noise()
    quiet_known_noise()  # a second fit in the process adds no second filter
    db_utils = logging.getLogger("mlflow.store.db.utils")
    queue = logging.getLogger("mlflow.utils.async_logging.async_logging_queue")
    assert sum(type(f).__name__ == "_DropOutOfSpace" for f in db_utils.filters) == 1
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    for logger in (db_utils, queue):
        logger.addHandler(handler)
    try:
        for error in (as_mlflow_raises(sqlite_full()), as_mlflow_raises(sqlite3.OperationalError("no such table"))):
            try:
                raise error
            except Exception as err:
                db_utils.exception("SQLAlchemy database error. The following exception is caught.\n%s", err)
                queue.error(f"Run Id r1: Failed to log run data: Exception: {err}")  # as MLflow: no exc_info
    finally:
        for logger in (db_utils, queue):
            logger.removeHandler(handler)
    assert [m.split("\n")[0] for m in seen] == [
        "SQLAlchemy database error. The following exception is caught.",
        "Run Id r1: Failed to log run data: Exception: (sqlite3.OperationalError) no such table"]
