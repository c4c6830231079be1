"""What the soak reads of a run's durable state: its MLflow store, and the checkpoints that verify.

The store is read through ``mlflow.MlflowClient`` and never created or migrated by the soak (see
:class:`Store`); the checkpoint directory through ``callbacks.storage.ckpt_store``, the records and hashes the
CLI itself checks, so that the soak's idea of "the newest good checkpoint" is the CLI's.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from callbacks.analysis.keys import TRAIN_LOSS_KEY
from callbacks.spot import SpotCheckpoint
from callbacks.storage import ckpt_store
from recipes.run import compat
from recipes.run.common import SEARCH_PAGE_SIZE, all_experiments, all_pages, quoted

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

EXPERIMENT = "digits"
#: How many ``step=*`` checkpoints the run keeps (SpotCheckpoint's default; the soak does not change it).
KEEP = inspect.signature(SpotCheckpoint).parameters["keep"].default
_T = TypeVar("_T")


class Store:
    """Read-only observation of the MLflow sqlite store through ``mlflow.MlflowClient``; never creates or migrates it.

    A client on ``sqlite:///<db>`` creates a missing store and migrates one below MLflow's schema head (a
    store a launch was killed in the middle of making), which would be the soak repairing what it tests.
    So :meth:`client` builds one only once the store exists at the head revision (:meth:`schema`); until
    then a read returns nothing for that poll. (At the head the client's one write is MLflow's default
    experiment, where a launch was killed before adding it: what the next launch adds too.) A read the
    client fails (the store locked) is retried, then returns nothing; its errors are noted in ``errors``.
    The client's engine is built once per store and must not pool connections: a pooled sqlite connection
    keeps reading a store that was deleted and replaced, so :func:`~recipes.bench.chaos.soak` runs in
    :func:`observer_pool`.
    """

    def __init__(self, db: Path) -> None:
        self.db = db
        self.uri = f"sqlite:///{db}"
        self.errors: list[str] = []

    def client(self) -> MlflowClient | None:
        """A client on the store, or None while it is missing or not at MLflow's schema head."""
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        if self.schema()["version"] != compat.mlflow_schema_head():
            return None
        try:
            return MlflowClient(self.uri)
        except MlflowException as err:
            self.errors.append(str(err))
            return None

    def _read(self, read: Callable[[MlflowClient], list[_T]]) -> list[_T]:
        """``read(client)``; [] while the store cannot be read (see the class), after retries when it is locked."""
        from mlflow.exceptions import MlflowException

        for _ in range(10):
            client = self.client()
            if client is None:
                return []
            try:
                return read(client)
            except MlflowException as err:
                self.errors.append(str(err))
                time.sleep(0.2)
        return []

    def runs(self, name: str | None = None) -> list[dict[str, str]]:
        """Active runs of the experiment (named ``name``), oldest first: ``run_id``, ``name``, ``status``."""
        from mlflow.entities import ViewType

        def read(client: MlflowClient) -> list[dict[str, str]]:
            experiment = client.get_experiment_by_name(EXPERIMENT)
            if experiment is None:
                return []
            where = f"attributes.run_name = {quoted(name)}" if name is not None else ""
            return [{"run_id": r.info.run_id, "name": r.info.run_name, "status": r.info.status}
                    for r in _search_runs(client, [experiment.experiment_id], where, ViewType.ACTIVE_ONLY)]
        return self._read(read)

    def train_steps(self, name: str, since_s: float) -> list[tuple[int, int]]:
        """(step, timestamp ms) of every ``train/loss`` of runs named ``name`` logged at or after ``since_s``."""
        from mlflow.entities import ViewType

        def read(client: MlflowClient) -> list[tuple[int, int]]:
            ids = [e.experiment_id for e in all_experiments(client, ViewType.ALL)]
            runs = _search_runs(client, ids, f"attributes.run_name = {quoted(name)}", ViewType.ALL)
            points = [(int(m.step), int(m.timestamp)) for r in runs
                      for m in client.get_metric_history(r.info.run_id, TRAIN_LOSS_KEY)]
            return sorted((p for p in points if p[1] >= int(since_s * 1000)), key=lambda p: p[1])
        return self._read(read)

    def final_metrics(self, name: str) -> dict[str, float]:
        """The latest value of every metric of the active run named ``name`` (empty without exactly one)."""
        from mlflow.entities import ViewType

        def read(client: MlflowClient) -> list[dict[str, float]]:
            experiment = client.get_experiment_by_name(EXPERIMENT)
            if experiment is None:
                return []
            where = f"attributes.run_name = {quoted(name)}"
            return [dict(r.data.metrics)
                    for r in _search_runs(client, [experiment.experiment_id], where, ViewType.ACTIVE_ONLY)]
        found = self._read(read)
        return found[0] if len(found) == 1 else {}

    def history(self, name: str) -> dict[str, list[tuple[int, float]]]:
        """Every metric key of the active run named ``name``: its (step, value) points in order."""
        from mlflow.entities import ViewType

        def read(client: MlflowClient) -> list[dict[str, list[tuple[int, float]]]]:
            experiment = client.get_experiment_by_name(EXPERIMENT)
            if experiment is None:
                return []
            runs = _search_runs(client, [experiment.experiment_id], f"attributes.run_name = {quoted(name)}",
                                ViewType.ACTIVE_ONLY)
            return [{key: sorted((int(m.step), float(m.value)) for m in client.get_metric_history(r.info.run_id, key))
                     for key in r.data.metrics} for r in runs]
        found = self._read(read)
        return found[0] if len(found) == 1 else {}

    def schema(self) -> dict[str, Any]:
        """Whether the store exists, its alembic revision (None: none yet) and its tables, read-only.

        Raw SQL on sqlite's catalog and alembic's version table: MLflow has no public API that reports a
        store's revision or tables (its client checks them, and migrates a store below the head).
        """
        tables = sorted(r[0] for r in self._sql("SELECT name FROM sqlite_master WHERE type = 'table'"))
        version = self._sql("SELECT version_num FROM alembic_version") if "alembic_version" in tables else []
        return {"exists": self.db.exists(), "version": version[0][0] if version else None, "tables": tables}

    def _sql(self, sql: str) -> list[tuple]:
        """Rows of ``sql``; [] when the store or the table does not exist or it stays unreadable (noted)."""
        if not self.db.exists():
            return []
        mode = "ro"
        for _ in range(50):
            try:
                conn = sqlite3.connect(f"file:{self.db}?mode={mode}", uri=True, timeout=30)
                try:
                    return list(conn.execute(sql))
                finally:
                    conn.close()
            except sqlite3.Error as err:
                text = str(err)
                if "no such table" in text:
                    return []
                if "readonly" in text or "read-only" in text:  # a hot journal to roll back: as any client does
                    mode = "rw"
                self.errors.append(text)
                time.sleep(0.2)
        return []


def _search_runs(client: MlflowClient, experiment_ids: list[str], where: str, view: int) -> list[Run]:
    """Every run ``client.search_runs`` finds, page after page, oldest first."""
    return all_pages(client.search_runs, experiment_ids=experiment_ids, filter_string=where, run_view_type=view,
                     max_results=SEARCH_PAGE_SIZE, order_by=["attributes.start_time ASC"])


@contextlib.contextmanager
def observer_pool() -> Iterator[None]:
    """MLflow's engines made meanwhile in this process open a connection per session (``NullPool``; see
    :class:`Store`). Entered before the soak's threads start and left after they end: it sets the process's
    environment (``MLFLOW_SQLALCHEMYSTORE_POOLCLASS``, which the launches do not inherit: :meth:`Soak.env`)."""
    from mlflow.environment_variables import MLFLOW_SQLALCHEMYSTORE_POOLCLASS

    key = MLFLOW_SQLALCHEMYSTORE_POOLCLASS.name
    before = os.environ.get(key)
    os.environ[key] = "NullPool"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def good_checkpoints(directory: Path) -> dict[str, int]:
    """``{name: step}`` of the checkpoints in ``directory`` whose record verifies (size and SHA-256)."""
    out = {}
    for path in ckpt_store.candidates(directory):
        record = ckpt_store.read_record(path)
        if record is not None:
            out[path.name] = record.global_step
    return out


def newest_good(directory: Path, pattern: str = "*") -> tuple[str, int] | None:
    """The checkpoint the CLI would resume from: newest good by step, then save time."""
    record = ckpt_store.newest_good(directory, pattern)
    return (record.path.name, record.global_step) if record is not None else None


def pruned_by_policy(name: str, step: int, now: dict[str, int], keep: int = KEEP) -> bool:
    """Whether the run's own pruning may have removed checkpoint ``name`` given the good ones ``now``."""
    if name.startswith("step="):
        return sum(1 for n, s in now.items() if n.startswith("step=") and s > step) >= keep
    if name.startswith("best-"):
        return any(n.startswith("best-") and s > step for n, s in now.items())
    return False
