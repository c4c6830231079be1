"""When a periodic checkpoint is due: every K optimizer steps, every T minutes, or at Daly's interval.

Lightning's ``ModelCheckpoint(every_n_train_steps, train_time_interval)`` decides the same things, and
broadcasts its time decision from rank 0 to avoid hangs, as this schedule's caller does. Ours differs where
spot training needs it to: the time decision rides in the one vote per step that also carries the notice
(``agreement.py``; ModelCheckpoint adds a broadcast of its own to every step), the interval can be Daly's
optimum for the save cost measured on the first save (``every_minutes="auto"``), and the saves it schedules
are pruned to the ``keep`` newest without a monitored metric (ModelCheckpoint's ``save_top_k`` needs one).

Only the clock of the process that counts (global rank 0) matters; every process keeps one all the same, so
that any rank can be rank 0 after a relaunch. No Lightning import.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

from ..analysis import keys
from ..analysis.ckpt_interval import daly_interval, expected_overhead, interval_mismatch, mtbf_from_rate

__all__ = ["FLOOR_S", "SaveSchedule", "describe_save"]

log = logging.getLogger(__name__)

#: The least save cost Daly's formula is given (a save measured faster still costs something).
FLOOR_S = 1e-3


def describe_save(seconds: float) -> str:
    """The measured save cost for a person: ms below a second (never rounded to zero), and the floor if used."""
    ms = seconds * 1e3
    text = f"{seconds:.2f} s" if seconds >= 1.0 else f"{ms:.0f} ms" if ms >= 10 else f"{ms:.2g} ms"
    floor = f", counted as {FLOOR_S * 1e3:.0f} ms" if seconds < FLOOR_S else ""
    return f"the first save's {text} loop stall{floor}"


class SaveSchedule:
    """Periodic saves by steps and by time, and the interval's choice from the first measured save.

    Args:
        every_n_steps: save every this many optimizer steps (``None``: not by steps).
        every_minutes: save every this many minutes (``None``: not by time; ``"auto"``: Daly's optimum).
        interruption_rate: interruptions of one instance per ``rate_period_h`` (a probability in [0, 1));
            0 leaves the interval unchecked.
        rate_period_h: the period of ``interruption_rate``, in hours.
        clock: the monotonic clock (a test passes its own).
    """

    def __init__(self, every_n_steps: int | None = None, every_minutes: float | Literal["auto"] | None = None,
                 interruption_rate: float = 0.0, rate_period_h: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every_n_steps = every_n_steps
        self.every_minutes = every_minutes
        self.interruption_rate = interruption_rate
        self.rate_period_h = rate_period_h
        self.clock = clock
        #: Seconds between timed saves (``None``: none, or ``auto`` before the first save).
        self.interval_s: float | None = None if every_minutes in (None, "auto") else 60.0 * float(every_minutes)
        self.checked = False
        self.last_save = clock()

    def restart_clock(self) -> None:
        """Count the time to the next save from now (training starts or resumes)."""
        self.last_save = self.clock()

    def due_by_steps(self, step: int) -> bool:
        """Whether ``step`` is a multiple of ``every_n_steps``."""
        return self.every_n_steps is not None and step > 0 and step % self.every_n_steps == 0

    def due_by_clock(self) -> bool:
        """Whether this process's clock says a timed save is due (the caller counts rank 0's alone)."""
        return self.interval_s is not None and self.clock() - self.last_save >= self.interval_s

    def saved(self, save_cost_s: float, instances: int, speak: bool) -> dict[str, float] | None:
        """A save just ended: restart the clock; after the first, choose or check the interval.

        Returns the metrics of that choice (``spot/interval_s`` ...) once, or ``None``. ``speak``: say it in
        the log (rank 0).
        """
        self.last_save = self.clock()
        if self.checked or self.interruption_rate <= 0:
            return None
        self.checked = True
        measured = save_cost_s
        save_cost_s = max(save_cost_s, FLOOR_S)
        mtbf_s = mtbf_from_rate(self.interruption_rate, 3600.0 * self.rate_period_h, instances=instances)
        optimum_s = daly_interval(save_cost_s, mtbf_s)
        cost = describe_save(measured)
        if self.every_minutes == "auto":
            self.interval_s = optimum_s
            if speak:
                log.warning("SpotCheckpoint(every_minutes='auto'): saving every %.1f min (Daly's optimum for %s "
                            "and a %.1f h MTBF).", optimum_s / 60, cost, mtbf_s / 3600)
        elif self.interval_s is not None and interval_mismatch(self.interval_s, optimum_s) > 2.0 and speak:
            log.warning("SpotCheckpoint(every_minutes=%s) is more than 2x away from Daly's optimum of %.1f min "
                        "(for %s and a %.1f h MTBF).", self.every_minutes, optimum_s / 60, cost, mtbf_s / 3600)
        if self.interval_s is None:
            return None
        return {keys.SAVE_INTERVAL_KEY: self.interval_s, keys.OPTIMAL_INTERVAL_KEY: optimum_s,
                keys.SAVE_COST_KEY: save_cost_s,
                keys.EXPECTED_OVERHEAD_KEY: expected_overhead(self.interval_s, save_cost_s, mtbf_s)}
