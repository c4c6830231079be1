"""The planner's model: expected wall time and cost per device count and market, and the picks.

Pure computation on plain numbers (no MLflow, no console, no matplotlib), so a plan can be made, tested and
reused without the command line: :class:`PlanInputs` validates what a plan needs, :func:`plan` tabulates one
:class:`PlanRow` per device count and market and picks the cheapest, the fastest and, when asked, the
cheapest within a deadline and the fastest within a budget (:class:`PlanResult`). The model itself
(Amdahl or USL speedup, Poisson spot interruptions, Daly's checkpoint interval and expected run) is described
in :mod:`recipes.plan`'s docstring and computed by :mod:`callbacks.analysis`.

Formatting lives in :mod:`recipes.plan.report`, figures in :mod:`recipes.plan.plot`, and reading a
finished run's measurements from MLflow in :mod:`recipes.plan.runs`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from callbacks.analysis.ckpt_interval import daly_interval, mtbf_from_rate
from callbacks.analysis.cost_model import expected_run
from callbacks.analysis.prices import MARKETS, Instance, price_for
from callbacks.analysis.scaling import amdahl_speedup, usl_speedup
from recipes.run.common import human_duration

__all__ = ["DEFAULT_DEVICES", "PlanInputs", "PlanResult", "PlanRow", "law_speedup", "money", "plan", "usd"]

DEFAULT_DEVICES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan needs, as plain numbers. Constructing it validates it.

    Give either ``serial_fraction`` (Amdahl) or ``usl_a``/``usl_b`` (USL; a missing one is 0).

    Args:
        step_time_s: Time of one training step on one device, seconds (> 0).
        steps: Number of steps in the run (>= 1).
        instance: The catalog row to price (see :func:`callbacks.analysis.prices.with_overrides`).
        serial_fraction: Amdahl serial fraction in [0, 1]; None when a USL coefficient is given.
        usl_a: USL contention coefficient (>= 0), or None.
        usl_b: USL coherency coefficient (>= 0), or None.
        interruption_rate: Probability that one spot instance is interrupted per period, in [0, 1).
        rate_period_s: The period of that rate, seconds (> 0).
        save_cost_s: Time to write one checkpoint, seconds (> 0).
        restart_s: Time to restart and reload after an interruption, seconds (>= 0).
        devices: Device counts to tabulate (integers >= 1).
        markets: Markets to tabulate, from ``("on_demand", "spot")``.
        deadline_h: Pick the cheapest plan whose expected wall time is within this many hours.
        budget_usd: Pick the fastest plan whose expected cost is within this many USD.

    Raises:
        ValueError: If a value is out of range or the scaling law is ambiguous; the message names it.
    """

    step_time_s: float
    steps: int
    instance: Instance
    serial_fraction: float | None = None
    usl_a: float | None = None
    usl_b: float | None = None
    interruption_rate: float = 0.0
    rate_period_s: float = 3600.0
    save_cost_s: float = 30.0
    restart_s: float = 120.0
    devices: tuple[int, ...] = DEFAULT_DEVICES
    markets: tuple[str, ...] = MARKETS
    deadline_h: float | None = None
    budget_usd: float | None = None

    def __post_init__(self) -> None:
        def finite(x: float) -> bool:
            return isinstance(x, (int, float)) and math.isfinite(x)

        if not (finite(self.step_time_s) and self.step_time_s > 0):
            raise ValueError(f"step time {self.step_time_s!r} s must be a positive number of seconds.")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps={self.steps!r} must be an integer >= 1.")
        usl = self.usl_a is not None or self.usl_b is not None
        if usl and self.serial_fraction is not None:
            raise ValueError(
                f"give either a serial fraction ({self.serial_fraction!r}) or USL coefficients "
                f"(a={self.usl_a!r}, b={self.usl_b!r}), not both."
            )
        if not usl and self.serial_fraction is None:
            raise ValueError("give a scaling law: a serial fraction (Amdahl) or USL coefficients a and b.")
        if self.serial_fraction is not None and not (
            finite(self.serial_fraction) and 0.0 <= self.serial_fraction <= 1.0
        ):
            raise ValueError(f"serial fraction {self.serial_fraction!r} must be in [0, 1].")
        for name, value in (("USL a", self.usl_a), ("USL b", self.usl_b)):
            if value is not None and not (finite(value) and value >= 0):
                raise ValueError(f"{name}={value!r} must be a finite number >= 0.")
        if not (finite(self.interruption_rate) and 0.0 <= self.interruption_rate < 1.0):
            raise ValueError(f"interruption rate {self.interruption_rate!r} must be in [0, 1) (per period).")
        if not (finite(self.rate_period_s) and self.rate_period_s > 0):
            raise ValueError(f"rate period {self.rate_period_s!r} s must be positive.")
        if not (finite(self.save_cost_s) and self.save_cost_s > 0):
            raise ValueError(f"checkpoint save cost {self.save_cost_s!r} s must be positive.")
        if not (finite(self.restart_s) and self.restart_s >= 0):
            raise ValueError(f"restart time {self.restart_s!r} s must be >= 0.")
        if not self.devices:
            raise ValueError("the device list is empty.")
        for n in self.devices:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"device count {n!r} must be an integer >= 1.")
        for market in self.markets:
            if market not in MARKETS:
                raise ValueError(f"market {market!r} must be one of {MARKETS}.")
        if self.deadline_h is not None and not (finite(self.deadline_h) and self.deadline_h > 0):
            raise ValueError(f"deadline {self.deadline_h!r} h must be a positive number of hours.")
        if self.budget_usd is not None and not (finite(self.budget_usd) and self.budget_usd > 0):
            raise ValueError(f"budget {self.budget_usd!r} USD must be a positive amount.")

    def speedup(self, n: int) -> float:
        """Speedup of ``n`` devices over one, from the scaling law.

        Args:
            n: Device count (>= 1).

        Returns:
            ``C(n)``.
        """
        if self.serial_fraction is not None:
            return float(amdahl_speedup(n, self.serial_fraction))
        return float(usl_speedup(n, self.usl_a or 0.0, self.usl_b or 0.0))

    @property
    def scaling_law(self) -> str:
        """The scaling law in words, e.g. ``"Amdahl s=0.05"``."""
        if self.serial_fraction is not None:
            return f"Amdahl s={self.serial_fraction:g}"
        return f"USL a={self.usl_a or 0.0:g} b={self.usl_b or 0.0:g}"


@dataclass(frozen=True)
class PlanRow:
    """One (device count, market) option.

    Args:
        devices: Device count N.
        market: ``"on_demand"`` or ``"spot"``.
        instances: Instances billed, ``ceil(N / devices per instance)``.
        price_per_h: Price per instance-hour, USD.
        speedup: ``C(N)``.
        work_h: Uninterrupted run time ``steps x step_time / C(N)``, hours.
        mtbf_h: The job's mean time between interruptions, hours (inf: never interrupted).
        interval_min: Daly checkpoint interval, minutes (inf: no checkpoints needed).
        wall_h: Expected wall time, hours.
        cost_usd: Expected cost, USD.
        interruptions: Expected number of interruptions.
        pareto: True when no other row is at least as cheap and as fast, and strictly one of the two.
        periodic_checkpoint: True when the job is longer than the checkpoint interval (False: never
            interrupted, or done before the first periodic checkpoint would be due).
    """

    devices: int
    market: str
    instances: int
    price_per_h: float
    speedup: float
    work_h: float
    mtbf_h: float
    interval_min: float
    wall_h: float
    cost_usd: float
    interruptions: float
    pareto: bool = False
    periodic_checkpoint: bool = False

    @property
    def label(self) -> str:
        """Short name, e.g. ``"N=8 spot"``."""
        return f"N={self.devices} {self.market}"


@dataclass
class PlanResult:
    """The table and the picks.

    Args:
        inputs: What was planned.
        rows: One :class:`PlanRow` per device count and market, in that order.
        picks: Row chosen per criterion: ``cheapest``, ``fastest`` and, when asked,
            ``cheapest_within_deadline`` and ``fastest_within_budget`` (None when no row qualifies).
        messages: Notes for the reader (skipped markets, unmet limits).
        feasible: False when a deadline or budget was given and no row meets it.
    """

    inputs: PlanInputs
    rows: list[PlanRow]
    picks: dict[str, PlanRow | None] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)
    feasible: bool = True


def _pareto_flags(rows: Sequence[PlanRow]) -> list[bool]:
    flags = []
    for r in rows:
        dominated = any(
            o.wall_h <= r.wall_h
            and o.cost_usd <= r.cost_usd
            and (o.wall_h < r.wall_h or o.cost_usd < r.cost_usd)
            for o in rows
        )
        flags.append(not dominated)
    return flags


def _plan_row(inputs: PlanInputs, n: int, market: str, price: float) -> PlanRow:
    inst = inputs.instance
    instances = math.ceil(n / inst.devices_per_instance)
    speedup = inputs.speedup(n)
    work_s = inputs.steps * inputs.step_time_s / speedup
    rate = inputs.interruption_rate if market == "spot" else 0.0
    mtbf_s = mtbf_from_rate(rate, inputs.rate_period_s, instances)
    interval_s = daly_interval(inputs.save_cost_s, mtbf_s)
    exp = expected_run(work_s, interval_s, inputs.save_cost_s, inputs.restart_s, mtbf_s, instances, price)
    return PlanRow(
        devices=n,
        market=market,
        instances=instances,
        price_per_h=price,
        speedup=speedup,
        work_h=work_s / 3600.0,
        mtbf_h=mtbf_s / 3600.0,
        interval_min=interval_s / 60.0,
        wall_h=exp.wall_s / 3600.0,
        cost_usd=exp.cost_usd,
        interruptions=exp.interruptions,
        periodic_checkpoint=interval_s < work_s,
    )


def plan(inputs: PlanInputs) -> PlanResult:
    """Tabulate expected wall time and cost per device count and market, and pick the best rows.

    Args:
        inputs: The validated :class:`PlanInputs`.

    Returns:
        The :class:`PlanResult`. A market whose price the catalog lacks is skipped with a message; if
        that leaves no row, ``rows`` is empty and ``feasible`` False.
    """
    messages: list[str] = []
    prices: dict[str, float] = {}
    for market in inputs.markets:
        try:
            prices[market] = price_for(inputs.instance, market)
        except ValueError as err:
            messages.append(f"{market} rows skipped: {err}")
    rows = [_plan_row(inputs, n, m, p) for n in inputs.devices for m, p in prices.items()]
    rows = [
        PlanRow(**{**asdict(r), "pareto": flag}) for r, flag in zip(rows, _pareto_flags(rows), strict=True)
    ]
    result = PlanResult(inputs=inputs, rows=rows, messages=messages)
    spot = [r for r in rows if math.isfinite(r.interval_min)]
    short = [r for r in spot if not r.periodic_checkpoint]
    if short:
        which = "in any spot row" if len(short) == len(spot) else "for " + ", ".join(r.label for r in short)
        messages.append(
            f"no periodic checkpoint needed {which}: the job is shorter than the optimal interval ({short[0].label}: "
            f"{human_duration(short[0].work_h * 3600)} of work, {human_duration(short[0].interval_min * 60)} between "
            "checkpoints); the final checkpoint is enough."
        )
    if not rows:
        result.feasible = False
        result.messages.append("no market has a price for this instance: nothing to plan.")
        return result
    fastest = min(rows, key=lambda r: (r.wall_h, r.cost_usd))
    cheapest = min(rows, key=lambda r: (r.cost_usd, r.wall_h))
    result.picks = {"cheapest": cheapest, "fastest": fastest}
    if inputs.deadline_h is not None:
        ok = [r for r in rows if r.wall_h <= inputs.deadline_h]
        pick = min(ok, key=lambda r: (r.cost_usd, r.wall_h)) if ok else None
        result.picks["cheapest_within_deadline"] = pick
        if pick is None:
            result.feasible = False
            result.messages.append(
                f"No plan meets the deadline of {inputs.deadline_h:g} h: the fastest achievable expected "
                f"time is {human_duration(fastest.wall_h * 3600)} ({fastest.label}, {usd(fastest.cost_usd)})."
            )
    if inputs.budget_usd is not None:
        ok = [r for r in rows if r.cost_usd <= inputs.budget_usd]
        pick = min(ok, key=lambda r: (r.wall_h, r.cost_usd)) if ok else None
        result.picks["fastest_within_budget"] = pick
        if pick is None:
            result.feasible = False
            result.messages.append(
                f"No plan fits the budget of ${inputs.budget_usd:,.2f}: the cheapest achievable expected "
                f"cost is {usd(cheapest.cost_usd)} ({cheapest.label}, {human_duration(cheapest.wall_h * 3600)})."
            )
    return result


# The model's messages quote dollars as the table does (recipes.plan.report).


def money(x: float) -> str:
    """USD with cents, or two significant digits below a cent (``0.00028``): a small cost is not ``0.00``."""
    if not math.isfinite(x):
        return "-"
    return f"{x:.2g}" if 0 < x < 0.01 else f"{x:,.2f}"


def usd(x: float) -> str:
    return "$" + money(x)


def law_speedup(n: int, law: dict[str, float]) -> float:
    """Speedup of ``n`` devices from a law given as ``{"serial_fraction"}`` or ``{"usl_a", "usl_b"}``."""
    if law.get("serial_fraction") is not None:
        return float(amdahl_speedup(n, law["serial_fraction"]))
    return float(usl_speedup(n, law.get("usl_a") or 0.0, law.get("usl_b") or 0.0))

