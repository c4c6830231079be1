"""An MLflow logger whose relaunches leave the run's metric history as an uninterrupted run's.

A resumed run redoes the steps between its checkpoint and the interruption, and each launch computes
the one-off metrics of its start again (baselines at step 0, the thread count, the cost so far). MLflow
only appends points: without care, the redone steps and the repeated start appear twice in the run's
history, or not, depending on whether the async queue had flushed before the kill. Since a resume is
bitwise, the redone points carry the values already stored; this logger reads the run's stored points
once, when it first logs in a continued run, and leaves out each (key, step) point as many times as the
store already holds it. The history then has exactly the points an uninterrupted run logs. Keys that
measure the clock (``time/*``, throughput, cost) keep the first launch's value for a redone step; the
``spot/*`` events (interruptions, lost steps) are the launches' own and are always logged.

No Lightning or MLflow option does this (MLflow has no "upsert" of a metric point): hence this subclass.

:meth:`unconfirmed` is what a checkpoint's record carries (``callbacks.checkpoint_io.PublishGate``): the points
logged so far that the store has not confirmed; :meth:`restore` logs those a relaunch's store lacks, so a kill
at any moment loses no point of the steps a relaunch does not redo.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from callbacks.analysis.keys import SPOT_PREFIX
from recipes.run.compat import async_write_state, init_mlflow_logger_without_client
from recipes.run.context import global_rank_from_env

log = logging.getLogger(__name__)

#: Keys MLflow's system-metrics monitor logs itself, never through this logger: not worth reading.
_NOT_OURS = ("system/",)
#: Keys of events that befell a launch (a notice, a resume and what it redid): each is logged, even at a step
#: the store holds already, since two launches interrupted at one step are two interruptions.
EVENT_KEYS = (SPOT_PREFIX,)


class ResumableMLFlowLogger(MLFlowLogger):
    """``MLFlowLogger`` that, in a continued run (``run_id`` given), logs no point the run already holds.

    Args:
        *args: as :class:`~lightning.pytorch.loggers.MLFlowLogger`.
        restore: ``[key, value, step, timestamp]`` points to log first in a continued run where the store lacks
            them (the resumed checkpoint's record: what a kill or a refusing store kept from the store).
        **kwargs: as :class:`~lightning.pytorch.loggers.MLFlowLogger`; ``run_id`` marks a continued run.
    """

    def __init__(self, *args: Any, restore: list[list[Any]] | None = None, **kwargs: Any) -> None:
        if global_rank_from_env() == 0:
            super().__init__(*args, **kwargs)
        else:  # never logs, never reads the store: no MLflow client, no MLflow import (about 1.6 CPU-s a rank)
            init_mlflow_logger_without_client(self, *args, **kwargs)
        self._restore = restore or []  # points a relaunch logs first where the store lacks them (restore())
        self._continued = kwargs.get("run_id") is not None
        self._stored: dict[str, Counter[int]] | None = None  # key -> step -> points already in the store
        self._relogged: Counter[tuple[str, int]] = Counter()
        # each async write not yet confirmed: its RunOperations and its points [key, value, step, timestamp ms]
        self._pending: list[tuple[Any, list[list[Any]]]] = []
        self._pending_lock = threading.Lock()
        self._watch = False  # keep the writes' outcomes (set by watch_writes)
        self._watching = False  # the client's log_batch is wrapped

    def _stored_points(self) -> dict[str, Counter[int]]:
        if self._stored is None:
            from mlflow.exceptions import MlflowException

            self._stored = {}
            try:
                client, run_id = self.experiment, self.run_id
                for key in client.get_run(run_id).data.metrics:
                    if not key.startswith(_NOT_OURS + EVENT_KEYS):
                        self._stored[key] = Counter(m.step for m in client.get_metric_history(run_id, key))
            except MlflowException as err:  # the store lacks the run: nothing to leave out
                log.debug("No stored history to continue from: %s", err)
            if self._restore:  # before this launch logs anything: what it logs again is then left out
                restored = self.restore(self._restore)
                if restored:
                    log.warning("Logged %d metric point(s) that the tracking store had lost before the checkpoint "
                                "this run resumes from (kept in its record).", restored)
                self._restore = []
        return self._stored

    def watch_writes(self) -> None:
        """Keep each async write's points until the store confirms them, for :meth:`unconfirmed`: Lightning's
        ``log_metrics`` drops what ``log_batch`` returns, and it alone says whether the store took the points (a
        full disk fails MLflow's writer thread, not the call)."""
        self._watch = True

    def _wrap_writes(self) -> None:
        if self._watching or not self._watch:
            return
        client = self.experiment
        log_batch = client.log_batch

        def watched(*args: Any, **kwargs: Any) -> Any:
            operation = log_batch(*args, **kwargs)
            points = [[m.key, m.value, m.step, m.timestamp] for m in kwargs.get("metrics") or []]
            if operation is not None and points:
                with self._pending_lock:
                    self._pending.append((operation, points))
            return operation

        client.log_batch = watched  # this logger's own client only
        self._watching = True

    def unconfirmed(self) -> tuple[list[list[Any]], BaseException | None]:
        """The points logged so far that the store has not confirmed yet (or refused), and its first refusal."""
        points: list[list[Any]] = []
        refused: BaseException | None = None
        with self._pending_lock:
            kept = []
            for operation, batch in self._pending:
                done, error = async_write_state(operation)
                if done and error is None:
                    continue  # in the store
                kept.append((operation, batch))
                points.extend(batch)
                refused = refused or error
            self._pending = kept
        return points, refused

    def restore(self, points: list[list[Any]]) -> int:
        """Log the ``[key, value, step, timestamp]`` points (a checkpoint record's) that the store lacks; return
        how many. What a kill or a refusing store kept from the store comes back with its original timestamp."""
        from mlflow.entities import Metric

        stored = self._stored_points()
        missing = [Metric(key=k, value=float(v), timestamp=int(t), step=int(s)) for k, v, s, t in points
                   if not stored.get(k) or not stored[k][int(s)]]
        for start in range(0, len(missing), 1000):
            self.experiment.log_batch(self.run_id, metrics=missing[start:start + 1000], synchronous=True)
        for metric in missing:
            stored.setdefault(metric.key, Counter())[metric.step] += 1
        return len(missing)

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self._wrap_writes()  # at the first write: the run exists by then
        if self._continued:
            stored, at = self._stored_points(), step or 0  # MLflowLogger stores step None as 0
            fresh = {}
            for key, value in metrics.items():
                held = stored.get(key)
                if held is not None and held[at] > self._relogged[key, at]:
                    self._relogged[key, at] += 1  # a point the interrupted launch logged already
                else:
                    fresh[key] = value
            metrics = fresh
            if not metrics:
                return
        super().log_metrics(metrics, step)
