"""``recipes.run.errors``: a full tracking store or disk told by the type and code of what failed, never by its
message, through every wrapper MLflow and SQLAlchemy put around it, and said in one line."""

from __future__ import annotations

import errno
import sqlite3

import pytest
import sqlalchemy.exc
from mlflow.exceptions import MlflowException

from recipes.run.errors import (
    StoreFull,
    causes,
    disk_error,
    machine_failure,
    out_of_space,
    space_reason,
    store_full_message,
)

STORE = "sqlite:////data/store/mlflow.db"


def sqlite_full() -> sqlite3.OperationalError:
    """A real SQLITE_FULL: a database that may not grow past three pages."""
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (x)")
    db.execute("PRAGMA max_page_count = 3")
    try:
        db.execute("INSERT INTO t VALUES (?)", (b"x" * 100_000,))
    except sqlite3.OperationalError as err:
        return err
    raise AssertionError("the insert fit")


def as_mlflow_raises(dbapi_error: sqlite3.Error) -> MlflowException:
    """What MLflow's SQL store raises (``make_managed_session``): its error from SQLAlchemy's from the driver's."""
    try:
        try:
            raise sqlalchemy.exc.OperationalError("INSERT INTO metrics ...", {}, dbapi_error) from dbapi_error
        except sqlalchemy.exc.OperationalError as wrapped:
            raise MlflowException(message=wrapped) from wrapped
    except MlflowException as err:
        return err


def refused_at_a_save(store_error: BaseException) -> RuntimeError:
    """A stop raised at the next save (``callbacks.checkpoint_io.MetricsNotDurable`` sets its cause so)."""
    stop = RuntimeError("the tracking store refused metrics logged through step 45")
    stop.__cause__ = store_error
    return stop


def test_a_full_sqlite_store_is_found_behind_mlflow_sqlalchemy_and_a_stop() -> None:
    full = sqlite_full()
    assert full.sqlite_errorcode == sqlite3.SQLITE_FULL
    assert out_of_space(refused_at_a_save(as_mlflow_raises(full))) is full
    assert space_reason(full) == "database or disk is full"


def test_the_message_alone_is_not_a_full_store() -> None:
    # a store's own words, raised by anything else (no SQLite error code), say nothing about its disk
    assert out_of_space(refused_at_a_save(RuntimeError("database or disk is full"))) is None
    assert out_of_space(sqlite3.OperationalError("database or disk is full")) is None


def test_other_sqlite_errors_are_not_a_full_store() -> None:
    db = sqlite3.connect(":memory:")
    with pytest.raises(sqlite3.OperationalError) as caught:
        db.execute("SELECT * FROM missing")
    assert out_of_space(as_mlflow_raises(caught.value)) is None


@pytest.mark.parametrize(("code", "full"), [(errno.ENOSPC, True), (errno.EDQUOT, True), (errno.EROFS, False),
                                            (errno.EIO, False), (errno.ENOENT, False)])
def test_an_os_error_is_out_of_space_only_for_no_room(code: int, full: bool) -> None:
    err = OSError(code, errno.errorcode[code], "/data/x")
    found = out_of_space(refused_at_a_save(err))
    assert (found is err) == full
    if full:
        assert space_reason(err) == err.strerror


def test_causes_walk_each_exception_once_and_the_drivers_error_sqlalchemy_keeps() -> None:
    full = sqlite_full()
    wrapped = sqlalchemy.exc.OperationalError("UPDATE runs ...", {}, full)  # raised without `from`: only .orig
    loop = RuntimeError("a")
    loop.__context__ = RuntimeError("b")
    loop.__context__.__context__ = loop
    assert list(causes(wrapped)) == [wrapped, full]
    assert len(list(causes(loop))) == 2
    assert out_of_space(wrapped) is full


def test_the_line_names_the_store_the_cause_and_the_step() -> None:
    assert store_full_message(STORE, "database or disk is full", 90) == (
        f"error: the tracking store {STORE} is full (database or disk is full): training stopped at step 90; free "
        "space and relaunch the same command to resume (the metric points this launch could not write are logged "
        "by the relaunch)")
    unwritten = store_full_message(STORE, "database or disk is full", None, status_unwritten=True)
    assert "the run stopped before training;" in unwritten
    assert unwritten.endswith("; its MLflow run's status could not be written either (it shows RUNNING until the "
                              "relaunch)")


def test_a_failure_of_the_machine_is_one_line_and_any_other_none() -> None:
    full = refused_at_a_save(as_mlflow_raises(sqlite_full()))
    assert machine_failure(full, STORE, 40) == store_full_message(STORE, "database or disk is full", 40)
    created = StoreFull(STORE, "database or disk is full")
    assert machine_failure(refused_at_a_save(created), None) == (
        f"error: the tracking store {STORE} is full (database or disk is full): it could not be created; free space "
        "and relaunch the same command")
    disk = OSError(errno.ENOSPC, "No space left on device", "/runs/x/checkpoints/step=1.ckpt")
    assert machine_failure(disk, STORE, 40) == (
        f"error: {disk}. The run stopped; make room and relaunch the same command to resume from the newest good "
        "checkpoint.")
    assert disk_error(refused_at_a_save(disk)) is disk
    assert machine_failure(ValueError("a bug"), STORE, 40) is None
    assert machine_failure(as_mlflow_raises(sqlite3.OperationalError("database is locked")), STORE, 40) is None
