"""recipes.soak.observe.Store: the soak's read-only view of the MLflow store, through MlflowClient, on real sqlite
stores."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import mlflow
import pytest

from recipes.soak.observe import EXPERIMENT, Store, observer_pool


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store MLflow created and migrated to its head, no experiment but the default (copied per test)."""
    db = tmp_path_factory.mktemp("template") / "mlflow.db"
    mlflow.MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


def _store(empty_store: Path, db: Path) -> tuple[Store, mlflow.MlflowClient]:
    shutil.copy(empty_store, db)
    return Store(db), mlflow.MlflowClient(f"sqlite:///{db}")


def test_runs_and_train_steps_as_the_client_logged_them(empty_store: Path, tmp_path: Path) -> None:
    store, client = _store(empty_store, tmp_path / "mlflow.db")
    experiment = client.create_experiment(EXPERIMENT)
    first = client.create_run(experiment, run_name="chaos-1", start_time=1_000).info.run_id
    for step, timestamp in ((0, 5_000), (1, 6_000), (2, 7_000)):
        client.log_metric(first, "train/loss", 1.0 / (step + 1), timestamp=timestamp, step=step)
    client.log_metric(first, "val/acc", 0.5, timestamp=6_500, step=1)  # not a train step
    second = client.create_run(experiment, run_name="chaos-2", start_time=2_000).info.run_id
    client.set_terminated(second, "FINISHED")
    deleted = client.create_run(experiment, run_name="chaos-1", start_time=3_000).info.run_id
    client.log_metric(deleted, "train/loss", 0.1, timestamp=8_000, step=3)
    client.delete_run(deleted)
    other = client.create_run(client.create_experiment("elsewhere"), run_name="chaos-1", start_time=4_000).info
    client.log_metric(other.run_id, "train/loss", 0.2, timestamp=4_000, step=9)

    # active runs of the soak's experiment, oldest first
    assert store.runs() == [{"run_id": first, "name": "chaos-1", "status": "RUNNING"},
                            {"run_id": second, "name": "chaos-2", "status": "FINISHED"}]
    assert store.runs("chaos-2") == [{"run_id": second, "name": "chaos-2", "status": "FINISHED"}]
    assert store.runs("chaos-3") == []
    # train/loss of every run of that name, deleted and in any experiment (as the SQL read them), by time
    assert store.train_steps("chaos-1", since_s=0) == [(9, 4_000), (0, 5_000), (1, 6_000), (2, 7_000), (3, 8_000)]
    assert store.train_steps("chaos-1", since_s=6.0) == [(1, 6_000), (2, 7_000), (3, 8_000)]
    assert store.errors == []


def test_a_missing_store_is_not_created(tmp_path: Path) -> None:
    store = Store(tmp_path / "mlflow.db")
    assert (store.runs(), store.train_steps("chaos-1", 0), store.client()) == ([], [], None)
    assert store.schema() == {"exists": False, "version": None, "tables": []}
    assert not store.db.exists()


def test_a_store_below_the_head_is_read_as_empty_and_left_as_it_is(empty_store: Path, tmp_path: Path) -> None:
    # a launch killed while it migrated the store: some tables, an older revision; a client would migrate it
    store, client = _store(empty_store, tmp_path / "mlflow.db")
    client.create_run(client.create_experiment(EXPERIMENT), run_name="chaos-1")
    with sqlite3.connect(store.db) as conn:
        conn.execute("UPDATE alembic_version SET version_num = 'older'")
        conn.execute("DROP TABLE metrics")
    conn.close()
    tables = store.schema()["tables"]
    assert store.runs() == [] and store.train_steps("chaos-1", 0) == []
    assert store.schema() == {"exists": True, "version": "older", "tables": tables} and "metrics" not in tables

    # tables being created, no revision written yet
    half = Store(tmp_path / "half.db")
    with sqlite3.connect(half.db) as conn:
        conn.execute("CREATE TABLE experiments (experiment_id INTEGER PRIMARY KEY, name VARCHAR(256))")
    conn.close()
    assert half.runs() == [] and half.schema() == {"exists": True, "version": None, "tables": ["experiments"]}


def test_a_replaced_store_is_read_afresh(empty_store: Path, tmp_path: Path) -> None:
    # the soak replaces a store its relaunch could not open; the observer must then read the new file
    with observer_pool():
        store, client = _store(empty_store, tmp_path / "mlflow.db")
        old = client.create_run(client.create_experiment(EXPERIMENT), run_name="chaos-1").info.run_id
        assert [r["run_id"] for r in store.runs()] == [old]
        store.db.unlink()
        shutil.copy(empty_store, store.db)
        assert store.runs() == []
        new_client = mlflow.MlflowClient(store.uri)
        new = new_client.create_run(new_client.create_experiment(EXPERIMENT), run_name="chaos-2").info.run_id
        assert [(r["run_id"], r["name"]) for r in store.runs()] == [(new, "chaos-2")]
