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
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

import mlflow
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

log = logging.getLogger(__name__)

#: Keys MLflow's system-metrics monitor logs itself, never through this logger: not worth reading.
_NOT_OURS = ("system/",)
#: Keys of events that befell a launch (a notice, a resume and what it redid): each is logged, even at a step
#: the store holds already, since two launches interrupted at one step are two interruptions.
EVENT_KEYS = ("spot/",)


class ResumableMLFlowLogger(MLFlowLogger):
    """``MLFlowLogger`` that, in a continued run (``run_id`` given), logs no point the run already holds.

    Args:
        *args: as :class:`~lightning.pytorch.loggers.MLFlowLogger`.
        **kwargs: as :class:`~lightning.pytorch.loggers.MLFlowLogger`; ``run_id`` marks a continued run.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._continued = kwargs.get("run_id") is not None
        self._stored: dict[str, Counter[int]] | None = None  # key -> step -> points already in the store
        self._relogged: Counter[tuple[str, int]] = Counter()

    def _stored_points(self) -> dict[str, Counter[int]]:
        if self._stored is None:
            self._stored = {}
            try:
                client, run_id = self.experiment, self.run_id
                for key in client.get_run(run_id).data.metrics:
                    if not key.startswith(_NOT_OURS + EVENT_KEYS):
                        self._stored[key] = Counter(m.step for m in client.get_metric_history(run_id, key))
            except mlflow.exceptions.MlflowException as err:  # the store lacks the run: nothing to leave out
                log.debug("No stored history to continue from: %s", err)
        return self._stored

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
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
