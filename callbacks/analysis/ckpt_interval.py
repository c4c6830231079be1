"""How often to checkpoint a job that can be interrupted.

Saving a checkpoint costs ``d`` seconds; an interruption throws away the work done since the last
completed checkpoint. Save too often and the saves dominate; save too rarely and the lost work does.
This module gives the classic optimum intervals and the overhead they leave, from a mean time
between failures ``M`` that it can derive from a cloud's interruption rate.

Formulas (all times in seconds):

* Young (1974): ``t = sqrt(2 d M)``.
* Daly (2006), higher order: ``t = sqrt(2dM) [1 + (1/3) sqrt(d/(2M)) + (1/9) d/(2M)] - d`` for
  ``d < 2M``, else ``t = M``. Daly's cases with ``d`` = 5 min: ``M`` = 24 h -> 116.7 min,
  6 h -> 56.7 min, 15 min -> 9.14 min.
* A Poisson rate ``p`` of interruptions per period ``dt`` -> ``lambda = -ln(1 - p) / dt``,
  ``M = 1 / lambda``; ``N`` instances in one synchronous job (any one interrupted stops them all)
  -> ``M / N``.
* First-order overhead of an interval ``t``: ``d/t + t/(2M) + R/M`` (``R`` = restart time).

This module is pure Python (no Lightning, no torch) so that a callback and a CLI can share it, and so
it can be copied into another project on its own.

Example::

    >>> round(daly_interval(5 * 60, 24 * 3600) / 60, 1)
    116.7
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "IntervalChoice",
    "OverheadCheck",
    "choose_interval",
    "daly_interval",
    "expected_overhead",
    "interval_mismatch",
    "mtbf_from_rate",
    "overhead_check",
    "young_interval",
]


def _check_save_and_mtbf(save_cost_s: float, mtbf_s: float) -> None:
    if not save_cost_s > 0 or math.isinf(save_cost_s):
        raise ValueError(f"save_cost_s={save_cost_s!r} must be a positive, finite number of seconds.")
    if not mtbf_s > 0:
        raise ValueError(f"mtbf_s={mtbf_s!r} must be a positive number of seconds (math.inf: never).")


def young_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum checkpoint interval ``sqrt(2 d M)``.

    Args:
        save_cost_s: Time ``d`` to write one checkpoint, in seconds (> 0).
        mtbf_s: Mean time between interruptions ``M`` of the whole job, in seconds (> 0; ``math.inf``
            when the job is never interrupted).

    Returns:
        The interval of work between checkpoints, in seconds (``math.inf`` when ``M`` is infinite).

    Raises:
        ValueError: If ``save_cost_s`` or ``mtbf_s`` is not positive; the message names the value.
    """
    _check_save_and_mtbf(save_cost_s, mtbf_s)
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def daly_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum checkpoint interval.

    ``t = sqrt(2dM) [1 + (1/3) sqrt(d/(2M)) + (1/9) d/(2M)] - d`` for ``d < 2M``, else ``t = M``
    (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
    Future Generation Computer Systems 22, 2006).

    Args:
        save_cost_s: Time ``d`` to write one checkpoint, in seconds (> 0).
        mtbf_s: Mean time between interruptions ``M`` of the whole job, in seconds (> 0; ``math.inf``
            when the job is never interrupted).

    Returns:
        The interval of work between checkpoints, in seconds (``math.inf`` when ``M`` is infinite).

    Raises:
        ValueError: If ``save_cost_s`` or ``mtbf_s`` is not positive; the message names the value.
    """
    _check_save_and_mtbf(save_cost_s, mtbf_s)
    if math.isinf(mtbf_s):
        return math.inf
    if save_cost_s >= 2.0 * mtbf_s:
        return float(mtbf_s)
    x = save_cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * save_cost_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - save_cost_s


def mtbf_from_rate(p: float, period_s: float, instances: int = 1) -> float:
    """Mean time between interruptions of a job, from a per-period interruption probability.

    Interruptions are taken as a Poisson process: a probability ``p`` of at least one interruption
    in ``period_s`` gives the rate ``lambda = -ln(1 - p) / period_s`` per instance, and ``M = 1/lambda``.
    A synchronous job on ``instances`` machines stops when any one of them is interrupted, so its
    rate is ``instances * lambda`` and its MTBF ``M / instances``.

    Args:
        p: Probability of an interruption of one instance within one period, in ``[0, 1)``.
        period_s: Length of that period in seconds (> 0), e.g. 3600 for "5% per hour".
        instances: Number of instances the job runs on (>= 1).

    Returns:
        The job's mean time between interruptions in seconds; ``math.inf`` when ``p == 0``.

    Raises:
        ValueError: If ``p`` is outside ``[0, 1)``, ``period_s`` is not positive or ``instances`` < 1;
            the message names the value.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"interruption rate p={p!r} must be in [0, 1) (a probability per period).")
    if not period_s > 0:
        raise ValueError(f"period_s={period_s!r} must be a positive number of seconds.")
    if int(instances) != instances or instances < 1:
        raise ValueError(f"instances={instances!r} must be an integer >= 1.")
    if p == 0.0:
        return math.inf
    rate = -math.log1p(-p) / period_s
    return 1.0 / (rate * int(instances))


def expected_overhead(interval_s: float, save_cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """First-order fraction of extra time that checkpointing and interruptions add.

    ``overhead ~ d/t + t/(2M) + R/M``: a save of ``d`` per ``t`` of work, on average half an interval
    of work lost per interruption, and a restart of ``R`` per interruption, with ``1/M``
    interruptions per second. At Young's optimum ``t = sqrt(2dM)`` the first two terms are equal and it
    is ``sqrt(2d/M) + R/M``. Valid while ``t`` and ``d`` are small against ``M``; for the exact
    expected time use :func:`callbacks.analysis.cost_model.expected_wall_time`.

    Args:
        interval_s: Work between checkpoints ``t``, in seconds (> 0; ``math.inf``: never save).
        save_cost_s: Time ``d`` to write one checkpoint, in seconds (>= 0).
        mtbf_s: Mean time between interruptions ``M``, in seconds (> 0; ``math.inf``: never).
        restart_s: Time ``R`` to restart and reload after an interruption, in seconds (>= 0).

    Returns:
        The overhead as a fraction of the useful work (0.1 = 10% longer).

    Raises:
        ValueError: If an argument is out of range; the message names the value.
    """
    if not interval_s > 0:
        raise ValueError(f"interval_s={interval_s!r} must be positive.")
    if not save_cost_s >= 0:
        raise ValueError(f"save_cost_s={save_cost_s!r} must be >= 0.")
    if not mtbf_s > 0:
        raise ValueError(f"mtbf_s={mtbf_s!r} must be positive (math.inf: never interrupted).")
    if not restart_s >= 0:
        raise ValueError(f"restart_s={restart_s!r} must be >= 0.")
    save_term = save_cost_s / interval_s
    if math.isinf(mtbf_s):
        return save_term
    if math.isinf(interval_s):
        return math.inf
    return save_term + interval_s / (2.0 * mtbf_s) + restart_s / mtbf_s


def interval_mismatch(chosen_s: float, optimum_s: float) -> float:
    """How far a chosen checkpoint interval is from the optimum, as a ratio >= 1.

    ``max(chosen/optimum, optimum/chosen)``: 1.0 is exact, 2.0 means twice or half the optimum. The
    overhead near the optimum is flat, so a caller usually warns only above 2.

    Args:
        chosen_s: The interval in use, in seconds (> 0).
        optimum_s: The optimum, e.g. from :func:`daly_interval`, in seconds (> 0).

    Returns:
        The ratio, >= 1 (``math.inf`` when exactly one of the two is infinite, 1.0 when both are).

    Raises:
        ValueError: If either interval is not positive; the message names the value.
    """
    if not chosen_s > 0:
        raise ValueError(f"chosen_s={chosen_s!r} must be positive.")
    if not optimum_s > 0:
        raise ValueError(f"optimum_s={optimum_s!r} must be positive.")
    if math.isinf(chosen_s) and math.isinf(optimum_s):
        return 1.0
    if math.isinf(chosen_s) or math.isinf(optimum_s):
        return math.inf
    return max(chosen_s / optimum_s, optimum_s / chosen_s)


@dataclass(frozen=True)
class IntervalChoice:
    """A checkpoint interval recommendation.

    Args:
        young_s: Young's interval ``sqrt(2dM)``, seconds.
        daly_s: Daly's interval (the one to use), seconds.
        mtbf_s: The job's mean time between interruptions, seconds.
        overhead: First-order overhead fraction at Daly's interval (:func:`expected_overhead`).
    """

    young_s: float
    daly_s: float
    mtbf_s: float
    overhead: float


def choose_interval(
    save_cost_s: float,
    interruption_rate: float,
    period_s: float = 3600.0,
    instances: int = 1,
    restart_s: float = 0.0,
) -> IntervalChoice:
    """Checkpoint interval for a job from its save cost and its instances' interruption rate.

    Args:
        save_cost_s: Time to write one checkpoint, seconds (> 0).
        interruption_rate: Probability of an interruption of one instance per period, in ``[0, 1)``.
        period_s: The period of that rate, seconds (default one hour).
        instances: Instances in the synchronous job (>= 1).
        restart_s: Time to restart after an interruption, seconds (>= 0).

    Returns:
        The :class:`IntervalChoice`; with no interruptions both intervals are ``math.inf`` and the
        overhead 0.

    Raises:
        ValueError: If an argument is out of range; the message names the value.
    """
    mtbf = mtbf_from_rate(interruption_rate, period_s, instances)
    young = young_interval(save_cost_s, mtbf)
    daly = daly_interval(save_cost_s, mtbf)
    overhead = expected_overhead(daly, save_cost_s, mtbf, restart_s)
    return IntervalChoice(young_s=young, daly_s=daly, mtbf_s=mtbf, overhead=overhead)


@dataclass(frozen=True)
class OverheadCheck:
    """A run's realized checkpoint-and-interruption overhead beside what the models predict for it.

    All overheads are fractions of the productive time (0.1 = 10 % longer).

    Args:
        realized: ``(checkpoint stalls + redone steps + restart gaps) / productive`` from the goodput ledger.
        save_cost_s: measured ``d``: checkpoint stall seconds / saves.
        interval_s: realized ``t``: productive seconds / saves (work between two saves).
        mtbf_s: measured ``M``: billed seconds / interruptions (``math.inf`` without one).
        restart_s: measured ``R``: restart-gap seconds / interruptions (0 without one).
        interruptions: relaunches that resumed.
        predicted: first-order Young/Daly overhead at the realized interval, ``d/t + t/(2M) + R/M``.
        optimum_interval_s: Daly's interval for ``d`` and ``M`` (``math.inf`` without interruptions).
        predicted_at_optimum: the same overhead at that interval.
        seed: the flat ``P_interrupt x Overhead`` surcharge: interruptions per hour times the hours each cost
            (redone work and restart), as ``1 + P x Overhead`` multiplies the bill.
    """

    realized: float
    save_cost_s: float
    interval_s: float
    mtbf_s: float
    restart_s: float
    interruptions: int
    predicted: float
    optimum_interval_s: float
    predicted_at_optimum: float
    seed: float


def overhead_check(productive_s: float, checkpoint_s: float, redone_s: float, restart_s: float, saves: int,
                   interruptions: int, billed_s: float) -> OverheadCheck:
    """Check Young/Daly's overhead against what a run's goodput ledger realized.

    Example (hand-computed): 3600 s productive, 10 saves of 2 s, 2 interruptions losing 90 s of steps and
    60 s of restart each, 3900 s billed: realized (20 + 180 + 120) / 3600 = 8.9 %; d = 2 s, t = 360 s,
    M = 1950 s, R = 60 s: predicted 2/360 + 360/3900 + 60/1950 = 12.9 %; the seed's surcharge: 2 per 3900 s
    = 1.846 per hour, x (90 + 60) s = 0.0417 h each -> 7.7 %.

    Raises:
        ValueError: for negative seconds or counts, or no productive time (the message names the value).
    """
    for name, value in (("productive_s", productive_s), ("checkpoint_s", checkpoint_s), ("redone_s", redone_s),
                        ("restart_s", restart_s), ("billed_s", billed_s)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"overhead_check: {name}={value!r} must be a finite number of seconds >= 0.")
    for name, count in (("saves", saves), ("interruptions", interruptions)):
        if isinstance(count, bool) or int(count) != count or count < 0:
            raise ValueError(f"overhead_check: {name}={count!r} must be an integer >= 0.")
    if productive_s <= 0:
        raise ValueError(f"overhead_check: productive_s={productive_s!r} must be > 0 (no step was productive).")
    d = checkpoint_s / saves if saves else 0.0
    t = productive_s / saves if saves else math.inf
    m = billed_s / interruptions if interruptions else math.inf
    r = restart_s / interruptions if interruptions else 0.0
    predicted = expected_overhead(t, d, m, r) if (saves or interruptions) else 0.0
    if interruptions and d > 0:
        optimum = daly_interval(d, m)
        at_optimum = expected_overhead(optimum, d, m, r)
    else:
        optimum, at_optimum = math.inf, (d / t if saves else 0.0)
    per_interruption_h = ((redone_s + restart_s) / interruptions / 3600.0) if interruptions else 0.0
    seed = (interruptions / (billed_s / 3600.0) if billed_s > 0 else 0.0) * per_interruption_h
    return OverheadCheck(realized=(checkpoint_s + redone_s + restart_s) / productive_s, save_cost_s=d,
                         interval_s=t, mtbf_s=m, restart_s=r, interruptions=int(interruptions),
                         predicted=predicted, optimum_interval_s=optimum, predicted_at_optimum=at_optimum,
                         seed=seed)
