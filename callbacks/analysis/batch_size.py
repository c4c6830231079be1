"""Which batch size, on how many devices, reaches a given loss soonest or cheapest: pure math.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", eq. 2.11): to reach a given
loss, training with batch ``B`` takes

    S(B) = S_min (1 + B_noise / B)   optimizer steps, and
    E(B) = E_min (1 + B / B_noise)   examples,          with S_min = E_min / B_noise,

where ``B_noise`` is the gradient noise scale (``B_simple`` as :mod:`callbacks.noise_scale` measures it
is the practical estimate). Below ``B_noise`` doubling the batch nearly halves the steps; above it the
steps hardly fall and the examples (compute) grow. Doubling ``B`` cuts the steps by the factor
``(2B + B_noise) / (2B + 2 B_noise)``: by less than 10 % once ``B > 4 B_noise`` — this module's
"past diminishing returns" (:data:`DIMINISHING_FACTOR`).

Wall time to the loss is ``S(B) x t(B, N)``: the step time of global batch ``B`` on ``N``
data-parallel devices, ``t(B, N) = t_1(B / N) + c(N)`` with ``t_1`` the measured step time of one device
at its per-device batch (:class:`StepTimeModel`, fitted to a few measured points) and ``c(N)`` the
gradient communication per step (0 on one device; :func:`callbacks.analysis.comm_model.ring_allreduce_time` or
a measurement). Dollars are wall hours x instances x the instance's price per hour.

With a linear step time ``t(B) = t0 + c B`` on one device, wall time
``S_min (1 + B_noise / B)(t0 + c B)`` is smallest at ``B* = sqrt(B_noise t0 / c)``
(:func:`optimal_batch_linear`): a larger noise scale or a larger fixed cost per step moves the best
batch up; a larger cost per example moves it down.

numpy and scipy only: no torch, no Lightning.

Example::

    >>> steps_to_target(64, b_noise=64, s_min=100)
    200.0
    >>> s_min_from_reference(steps=300, batch=32, b_noise=64)
    100.0
    >>> optimal_batch_linear(b_noise=100, t0=0.01, per_example_s=0.0001)
    100.0
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy.optimize import nnls

__all__ = [
    "DIMINISHING_FACTOR",
    "BatchPlan",
    "BatchRow",
    "StepTimeModel",
    "diminishing_returns",
    "examples_to_target",
    "fit_step_time",
    "optimal_batch_linear",
    "plan_batches",
    "s_min_from_reference",
    "step_saving_from_doubling",
    "steps_to_target",
]

#: ``B > DIMINISHING_FACTOR x B_noise``: doubling the batch saves less than 10 % of the steps.
DIMINISHING_FACTOR = 4.0


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"{name}={value!r} must be a positive number.")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} must be a positive finite number.")
    return value


def steps_to_target(batch: float, b_noise: float, s_min: float) -> float:
    """Optimizer steps to the target loss at batch ``batch``: ``S_min (1 + B_noise / B)``.

    Args:
        batch: Global batch size B (> 0).
        b_noise: Gradient noise scale B_noise (> 0), examples.
        s_min: Steps needed with an infinite batch (> 0).

    Raises:
        ValueError: If a value is not a positive finite number; the message names it.
    """
    return _positive("s_min", s_min) * (1.0 + _positive("b_noise", b_noise) / _positive("batch", batch))


def examples_to_target(batch: float, b_noise: float, e_min: float) -> float:
    """Examples to the target loss at batch ``batch``: ``E_min (1 + B / B_noise)``.

    Args:
        batch: Global batch size B (> 0).
        b_noise: Gradient noise scale B_noise (> 0).
        e_min: Examples needed with a batch of one (> 0), ``= S_min x B_noise``.

    Raises:
        ValueError: If a value is not a positive finite number.
    """
    return _positive("e_min", e_min) * (1.0 + _positive("batch", batch) / _positive("b_noise", b_noise))


def s_min_from_reference(steps: float, batch: float, b_noise: float) -> float:
    """``S_min`` from one run that reached the target in ``steps`` at batch ``batch``: ``S / (1 + B_noise / B)``.

    Args:
        steps: Steps the reference run took to the target (> 0).
        batch: Its global batch (> 0).
        b_noise: The noise scale (> 0).

    Raises:
        ValueError: If a value is not a positive finite number.
    """
    return _positive("steps", steps) / (1.0 + _positive("b_noise", b_noise) / _positive("batch", batch))


def step_saving_from_doubling(batch: float, b_noise: float) -> float:
    """Fraction of the steps that doubling the batch saves: ``1 - S(2B)/S(B) = B_noise / (2 (B + B_noise))``.

    0.5 at ``B << B_noise`` (steps halve), 0.25 at ``B = B_noise``, 0.1 at ``B = 4 B_noise``, towards 0 beyond.
    """
    b, bn = _positive("batch", batch), _positive("b_noise", b_noise)
    return bn / (2.0 * (b + bn))


def diminishing_returns(batch: float, b_noise: float, factor: float = DIMINISHING_FACTOR) -> bool:
    """True when ``B > factor x B_noise`` (default 4: doubling then saves under 10 % of the steps)."""
    return _positive("batch", batch) > _positive("factor", factor) * _positive("b_noise", b_noise)


def optimal_batch_linear(b_noise: float, t0: float, per_example_s: float) -> float:
    """The batch that minimizes wall time ``S(B)(t0 + c B)`` on one device: ``sqrt(B_noise t0 / c)``.

    Args:
        b_noise: The noise scale (> 0).
        t0: Fixed time per step, seconds (> 0).
        per_example_s: Time per example, seconds (> 0; with 0 the best batch is unbounded).

    Raises:
        ValueError: If a value is not a positive finite number.
    """
    return math.sqrt(_positive("b_noise", b_noise) * _positive("t0", t0) / _positive("per_example_s", per_example_s))


@dataclass(frozen=True)
class StepTimeModel:
    """Step time of one device against its batch: ``t(b) = t0 + per_example_s x b`` (both >= 0).

    Args:
        t0: Fixed time per step (kernel launches, optimizer, Python), seconds.
        per_example_s: Time per example, seconds.
        points: The measured ``(batch, seconds)`` pairs it was fitted to.
        max_rel_error: Largest ``|fit - measured| / measured`` over the points.
    """

    t0: float
    per_example_s: float
    points: tuple[tuple[float, float], ...] = ()
    max_rel_error: float = 0.0

    def __call__(self, batch: float) -> float:
        """Predicted step time at a per-device batch ``batch``, seconds."""
        return self.t0 + self.per_example_s * float(batch)


def fit_step_time(batches: Sequence[float], seconds: Sequence[float]) -> StepTimeModel:
    """Least-squares fit of ``t(b) = t0 + c b`` with ``t0, c >= 0`` (scipy's NNLS) to measured step times.

    A single batch size cannot separate the two terms: it is read as all fixed cost (``t0 = t``,
    ``c = 0``); give two or more.

    Args:
        batches: Per-device batch sizes measured (> 0).
        seconds: Their mean step times, seconds (> 0).

    Raises:
        ValueError: If the lists are empty, of different lengths, or hold a non-positive value.
    """
    if len(batches) != len(seconds) or not batches:
        raise ValueError(f"step times: {len(batches)} batch sizes and {len(seconds)} times; "
                         "need matching, non-empty lists.")
    b = np.array([_positive("batch", x) for x in batches])
    t = np.array([_positive("step time", x) for x in seconds])
    if len(set(b.tolist())) == 1:
        t0, c = float(t.mean()), 0.0
    else:
        (t0, c), _ = nnls(np.column_stack([np.ones_like(b), b]), t)
    fitted = t0 + c * b
    err = float(np.max(np.abs(fitted - t) / t))
    return StepTimeModel(float(t0), float(c), tuple(zip(b.tolist(), t.tolist(), strict=True)), err)


@dataclass(frozen=True)
class BatchRow:
    """One (global batch, device count) option.

    Args:
        batch: Global batch B.
        devices: Data-parallel devices N (per-device batch B / N).
        steps: ``S(B)``.
        examples: ``E(B) = S(B) x B``.
        step_s: ``t(B, N)``, seconds.
        wall_s: ``S(B) x t(B, N)``, seconds.
        instances: Instances billed, ``ceil(N / devices per instance)``.
        cost_usd: ``wall hours x instances x price``.
        steps_over_min: ``S(B) / S_min = 1 + B_noise / B``.
        examples_over_min: ``E(B) / E_min = 1 + B / B_noise``.
        doubling_saves: Fraction of steps that doubling B would save.
        diminishing: ``B > factor x B_noise``.
    """

    batch: int
    devices: int
    steps: float
    examples: float
    step_s: float
    wall_s: float
    instances: int
    cost_usd: float
    steps_over_min: float
    examples_over_min: float
    doubling_saves: float
    diminishing: bool

    def as_dict(self) -> dict:
        """Plain-Python fields (for JSON)."""
        return asdict(self)


@dataclass
class BatchPlan:
    """The rows and the picks.

    Args:
        b_noise: The noise scale used.
        s_min: ``S_min`` used.
        rows: One :class:`BatchRow` per feasible (batch, devices), batches ascending then devices.
        fastest: The row with the least wall time (ties: the cheaper).
        cheapest: The row with the least cost (ties: the faster).
        skipped: ``(batch, devices, why)`` for combinations left out (batch not divisible by N...).
    """

    b_noise: float
    s_min: float
    rows: list[BatchRow]
    fastest: BatchRow
    cheapest: BatchRow
    skipped: list[tuple[int, int, str]] = field(default_factory=list)


def plan_batches(
    b_noise: float,
    s_min: float,
    batches: Sequence[int],
    step_time: Callable[[float], float],
    devices: Sequence[int] = (1,),
    comm_s: Callable[[int], float] | None = None,
    price_per_instance_h: float = 0.0,
    devices_per_instance: int = 1,
    factor: float = DIMINISHING_FACTOR,
) -> BatchPlan:
    """Steps, wall time and dollars to the target for each global batch and device count; the picks.

    Args:
        b_noise: Gradient noise scale (> 0).
        s_min: Steps with an infinite batch (> 0); see :func:`s_min_from_reference`.
        batches: Global batch sizes (integers >= 1).
        step_time: One device's step time at a per-device batch, seconds (a :class:`StepTimeModel`).
        devices: Data-parallel device counts (integers >= 1). A batch that N does not divide, or that is
            below N, is skipped for that N.
        comm_s: Gradient communication per step on N devices, seconds (None: none). Not called for N = 1.
        price_per_instance_h: USD per instance-hour (>= 0).
        devices_per_instance: Devices one instance holds (>= 1).
        factor: The diminishing-returns threshold, in units of B_noise.

    Returns:
        The :class:`BatchPlan`.

    Raises:
        ValueError: If a value is out of range, or no (batch, devices) combination is feasible.
    """
    b_noise, s_min = _positive("b_noise", b_noise), _positive("s_min", s_min)
    if not (math.isfinite(price_per_instance_h) and price_per_instance_h >= 0):
        raise ValueError(f"price per instance-hour {price_per_instance_h!r} must be a finite number >= 0.")
    if isinstance(devices_per_instance, bool) or not isinstance(devices_per_instance, int) or devices_per_instance < 1:
        raise ValueError(f"devices per instance {devices_per_instance!r} must be an integer >= 1.")
    for name, values in (("batch", batches), ("device count", devices)):
        if not values:
            raise ValueError(f"the {name} list is empty.")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} {v!r} must be an integer >= 1.")
    rows, skipped = [], []
    for b in sorted(set(int(x) for x in batches)):
        steps = steps_to_target(b, b_noise, s_min)
        for n in sorted(set(int(x) for x in devices)):
            if b % n:
                skipped.append((b, n, f"batch {b} does not split evenly over {n} devices"))
                continue
            step_s = float(step_time(b / n)) + (float(comm_s(n)) if comm_s is not None and n > 1 else 0.0)
            wall_s = steps * step_s
            instances = math.ceil(n / devices_per_instance)
            rows.append(BatchRow(
                batch=b, devices=n, steps=steps, examples=steps * b, step_s=step_s, wall_s=wall_s,
                instances=instances, cost_usd=wall_s / 3600.0 * instances * price_per_instance_h,
                steps_over_min=1.0 + b_noise / b, examples_over_min=1.0 + b / b_noise,
                doubling_saves=step_saving_from_doubling(b, b_noise),
                diminishing=diminishing_returns(b, b_noise, factor),
            ))
    if not rows:
        raise ValueError("no batch size splits evenly over any of the device counts: nothing to plan.")
    fastest = min(rows, key=lambda r: (r.wall_s, r.cost_usd))
    cheapest = min(rows, key=lambda r: (r.cost_usd, r.wall_s))
    return BatchPlan(b_noise=b_noise, s_min=s_min, rows=rows, fastest=fastest, cheapest=cheapest, skipped=skipped)
