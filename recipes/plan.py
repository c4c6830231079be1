"""Plan a training run: how many devices, on which market, for what expected time and cost.

Given the time of one step on one device, the number of steps, a scaling law and an instance from the
price catalog (``callbacks/analysis/prices.yaml``), this tabulates, for each device count N and each market
(on-demand, spot), the expected wall time and cost of the run, and picks the cheapest plan that meets
a deadline and the fastest that fits a budget. The model:

* speedup ``C(N)`` from Amdahl (``--serial-fraction``) or the Universal Scalability Law
  (``--usl-a``/``--usl-b``), so the work takes ``W = steps x step_time / C(N)``;
* ``ceil(N / GPUs per instance)`` instances (a machine without GPUs counts as one device);
* on-demand: never interrupted. Spot: each instance is interrupted with probability
  ``--interruption-rate`` per ``--rate-period-h`` (Poisson; default: the catalog row's typical rate,
  with its source), any interruption stops the synchronous job, so its MTBF is
  ``M = 1 / (instances x -ln(1 - p) / period)``;
* a checkpoint every Daly-optimal interval (save cost ``--save-cost-s``), ``--restart-s`` per restart,
  and the exact expected wall time of Daly's exponential model (see ``callbacks/analysis/cost.py``);
  every instance is billed for the whole expected wall time. A job shorter than that interval needs
  no periodic checkpoint, and the table says so.

Examples::

    # 10,000 steps of 3 s on one H100, 5% serial: what do 8 GPUs cost, on which market?
    python -m recipes.plan --step-time 3 --steps 10000 --serial-fraction 0.05 \\
        --instance a3-highgpu-1g --interruption-rate 0.05 --rate-period-h 1 \\
        --save-cost-s 30 --restart-s 120

    # no --interruption-rate: the catalog row's typical spot rate (printed, with where it comes from)
    python -m recipes.plan --step-time 3 --steps 10000 --serial-fraction 0.05 --instance a3-highgpu-1g

    # the cheapest plan done within 2 h, the fastest within $50, and a cost-vs-time plot
    python -m recipes.plan --step-time 3 --steps 10000 --usl-a 0.02 --usl-b 0.0005 \\
        --instance a3-highgpu-8g --interruption-rate 0.05 --deadline-h 2 --budget-usd 50 --plot plan.png

    # an AWS instance (the catalog has on-demand prices only there): give a spot price, as JSON
    python -m recipes.plan --step-time 3 --steps 10000 --serial-fraction 0.05 --instance p5.48xlarge \\
        --price-spot 22.0 --interruption-rate 0.05 --json

Which batch size (``python -m recipes.plan batch ...``, in :mod:`recipes.plan_batch`): steps, wall time and
cost to the same loss per batch size and device count, from the gradient noise scale.

From a finished run (``--run RUN_ID_OR_RUN_DIR``) the measured numbers replace ``--step-time`` and
``--steps``: the run's MLflow record (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``) gives

* the step time: StepTiming's run mean ``time/mean/step_s`` (compute only: checkpoints and validation
  excluded), else the mean of its ``time/step_s`` windows, else the all-in wall duration (MLflow run
  start to end) / steps. A run on ``W`` devices (``manifest.json``'s ``world_size``) measured the
  step at N = W, so one device's step time is that times ``C(W)``;
* the steps: the furthest step the run logged (and its newest checkpoint record, given a run
  directory); ``--steps`` overrides;
* the scaling law: ``--serial-fraction`` or ``--usl-a``/``--usl-b`` when given (the user's word wins),
  else the fit of a ``recipes.scale`` parent run (``--scale-run``: USL when it fitted best, else
  Amdahl), else the run's own ``amdahl/serial_fraction`` (StepTiming), else an error naming what is
  missing.

::

    # what would this run cost on 1-64 H100s, on which market, done within 1 h?
    python -m recipes.plan --run 3f2a...e1 --instance a3-highgpu-1g --interruption-rate 0.05 --deadline-h 1
    python -m recipes.plan --run runs/digits/20250601-120000-ab12 --scale-run 9c0d...77 \
        --instance a3-highgpu-8g --interruption-rate 0.05 --steps 100000 --json

Exit status: 0 with a plan; 1 when no row meets ``--deadline-h`` or ``--budget-usd`` (the answer
says so, naming the limit and the best achievable); 2 on bad input (one line on stderr naming the value).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from callbacks.analysis.ckpt_interval import daly_interval, mtbf_from_rate
from callbacks.analysis.cost import expected_run
from callbacks.analysis.prices import MARKETS, Instance, get_instance, load_catalog, price_for, with_overrides
from callbacks.analysis.scaling import amdahl_speedup, usl_speedup
from callbacks.storage import ckpt_store
from recipes.common import SERIAL_KEY, UsageError, human_duration, positive_ints, tracking_uri

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

__all__ = [
    "DEFAULT_DEVICES",
    "PlanInputs",
    "PlanResult",
    "PlanRow",
    "RunMeasurement",
    "human_duration",
    "main",
    "measure_run",
    "plan",
    "print_table",
    "to_json",
    "write_plot",
]

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
                f"time is {human_duration(fastest.wall_h * 3600)} ({fastest.label}, {_usd(fastest.cost_usd)})."
            )
    if inputs.budget_usd is not None:
        ok = [r for r in rows if r.cost_usd <= inputs.budget_usd]
        pick = min(ok, key=lambda r: (r.wall_h, r.cost_usd)) if ok else None
        result.picks["fastest_within_budget"] = pick
        if pick is None:
            result.feasible = False
            result.messages.append(
                f"No plan fits the budget of ${inputs.budget_usd:,.2f}: the cheapest achievable expected "
                f"cost is {_usd(cheapest.cost_usd)} ({cheapest.label}, {human_duration(cheapest.wall_h * 3600)})."
            )
    return result


# ----------------------------------------------------------------------------------------------- output


def _num(x: float) -> float | None:
    """JSON has no infinity: inf and nan become null."""
    return x if math.isfinite(x) else None


def _row_json(row: PlanRow) -> dict:
    return {k: (_num(v) if isinstance(v, float) else v) for k, v in asdict(row).items()}


def to_json(result: PlanResult) -> dict:
    """The plan as a JSON-ready dict (infinite MTBF and interval become null).

    Args:
        result: From :func:`plan`.

    Returns:
        ``{"inputs", "instance", "rows", "picks", "messages", "feasible"}``.
    """
    inputs = asdict(result.inputs)
    instance = inputs.pop("instance")
    inputs["devices"] = list(inputs["devices"])
    inputs["markets"] = list(inputs["markets"])
    inputs["scaling_law"] = result.inputs.scaling_law
    return {
        "inputs": inputs,
        "instance": instance,
        "rows": [_row_json(r) for r in result.rows],
        "picks": {k: (None if r is None else _row_json(r)) for k, r in result.picks.items()},
        "messages": result.messages,
        "feasible": result.feasible,
    }


def _money(x: float) -> str:
    """USD with cents, or two significant digits below a cent (``0.00028``): a small cost is not ``0.00``."""
    if not math.isfinite(x):
        return "-"
    return f"{x:.2g}" if 0 < x < 0.01 else f"{x:,.2f}"


def _usd(x: float) -> str:
    return "$" + _money(x)


def _count(x: float) -> str:
    return "0" if x == 0 else "<0.01" if x < 0.005 else f"{x:.2f}"


def _console() -> Any:
    """A rich console as wide as the terminal, or ``COLUMNS``; 160 columns when piped without ``COLUMNS``."""
    from rich.console import Console

    if sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit():
        return Console()
    return Console(width=160)


#: Columns left out, in this order, when the table would not fit the console (N, market, wall, cost, pick stay).
_DROP_FIRST = ("inst.", "speedup", "interr.", "work", "ckpt every")
#: The picks in words, and as the table's pick column marks them.
PICK_NAMES = {"cheapest": ("cheapest", "cheapest"), "fastest": ("fastest", "fastest"),
              "cheapest_within_deadline": ("cheapest within {deadline}", "deadline"),
              "fastest_within_budget": ("fastest within {budget}", "budget")}


def print_table(result: PlanResult) -> None:
    """Print the plan as a rich table with the picks marked, the picks in words, then the messages.

    Times carry their unit (:func:`human_duration`). The table fits the console: 100 columns show every
    column but the MTBF (in ``--json``); narrower ones leave out the least needed, and say which.

    Args:
        result: From :func:`plan`.
    """
    from rich.cells import cell_len
    from rich.markup import escape
    from rich.measure import Measurement
    from rich.table import Table

    console = _console()
    inp = result.inputs
    inst = inp.instance
    spot = "n/a" if inst.spot_usd_per_h is None else f"${inst.spot_usd_per_h:g}/h"
    title = (
        f"{inp.steps:,} steps x {human_duration(inp.step_time_s)} on {inst.name} ({inst.gpus}x {inst.gpu or 'CPU'}), "
        f"{inp.scaling_law}"
    )
    caption = (
        f"wall, cost and interr(uptions) are expected values. On-demand ${inst.on_demand_usd_per_h:g}/h, spot {spot} "
        f"per instance ({inst.source}, {inst.date}); spot interruptions {inp.interruption_rate:g} per "
        f"{inp.rate_period_s / 3600:g} h per instance; save {inp.save_cost_s:g} s, restart {inp.restart_s:g} s. "
        "* = Pareto front."
    )
    marks: dict[int, list[str]] = {}
    for key, row in result.picks.items():
        if row is not None:
            marks.setdefault(id(row), []).append(PICK_NAMES[key][1])
    cells = []
    for r in result.rows:
        interval = "-" if not math.isfinite(r.interval_min) else (
            human_duration(r.interval_min * 60) if r.periodic_checkpoint else "not needed")
        cells.append({
            "N": str(r.devices), "market": r.market, "inst.": str(r.instances), "speedup": f"{r.speedup:.2f}",
            "work": human_duration(r.work_h * 3600), "ckpt every": interval, "wall": human_duration(r.wall_h * 3600),
            "cost $": _money(r.cost_usd), "interr.": _count(r.interruptions),
            "pick": ("* " if r.pareto else "") + ", ".join(marks.get(id(r), [])),
        })

    def build(names: list[str], note: str) -> Table:
        table = Table(title=title, caption=caption + note)
        for name in names:  # a cell that must not wrap asks for its width, so measuring the table is exact
            wraps = name in ("ckpt every", "pick")
            least = 6 if wraps else max((cell_len(row[name]) for row in cells), default=None)
            table.add_column(escape(name), justify="left" if name in ("market", "pick") else "right",
                             no_wrap=not wraps, min_width=least)
        for row in cells:
            table.add_row(*(row[name] for name in names))
        return table

    names = list(cells[0]) if cells else ["N", "market", "wall", "cost $", "pick"]
    dropped: list[str] = []
    table = build(names, "")
    while Measurement.get(console, console.options.update_width(10_000), table).minimum > console.width:
        name = next((n for n in _DROP_FIRST if n in names), None)
        if name is None:
            break
        names.remove(name)
        dropped.append(name)
        table = build(names, f" Not shown at {console.width} columns: {', '.join(dropped)} (see --json).")
    console.print(table)
    limits = {"deadline": f"{inp.deadline_h:g} h" if inp.deadline_h is not None else "",
              "budget": _usd(inp.budget_usd) if inp.budget_usd is not None else ""}
    picked = [(PICK_NAMES[key][0].format(**limits) + ":", row) for key, row in result.picks.items() if row]
    width = max((len(name) for name, _ in picked), default=0)
    for name, row in picked:
        console.print(f"{name:<{width}} {row.label}, {human_duration(row.wall_h * 3600)}, {_usd(row.cost_usd)}",
                      markup=False, highlight=False)
    for message in result.messages:
        console.print(message, markup=False, highlight=False)


def write_plot(result: PlanResult, path: str | Path) -> Path:
    """Write a PNG of expected cost against expected wall time, Pareto front marked and labelled.

    Args:
        result: From :func:`plan`.
        path: The PNG file to write.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    path = Path(path)
    rows = [r for r in result.rows if math.isfinite(r.wall_h) and math.isfinite(r.cost_usd)]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for market, marker in (("on_demand", "o"), ("spot", "s")):
        pts = [r for r in rows if r.market == market]
        if pts:
            ax.scatter(
                [r.wall_h for r in pts],
                [r.cost_usd for r in pts],
                marker=marker,
                alpha=0.6,
                label=market.replace("_", "-"),
            )
    front = sorted((r for r in rows if r.pareto), key=lambda r: r.wall_h)
    if front:
        ax.plot([r.wall_h for r in front], [r.cost_usd for r in front], "k--", lw=1, label="Pareto front")
        ax.scatter(
            [r.wall_h for r in front], [r.cost_usd for r in front], facecolors="none", edgecolors="k", s=120
        )
        for r in front:
            ax.annotate(
                r.label, (r.wall_h, r.cost_usd), textcoords="offset points", xytext=(6, 4), fontsize=8
            )
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    if rows and all(r.wall_h > 0 for r in rows):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(plain)
    if rows and all(r.cost_usd > 0 for r in rows):
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
    inst = result.inputs.instance
    ax.set_xlabel("expected wall time (h)")
    ax.set_ylabel("expected cost (USD)")
    ax.set_title(f"{result.inputs.steps:,} steps on {inst.name}, {result.inputs.scaling_law}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------- from a finished run

STEP_MEAN_KEY = "time/mean/step_s"
STEP_WINDOW_KEY = "time/step_s"
SCALE_SERIAL_KEY = "scale/amdahl_serial_fraction"
SCALE_USL_KEYS = ("scale/usl_a", "scale/usl_b")
BEST_LAW_TAG = "atscale.best_law"


@dataclass(frozen=True)
class RunMeasurement:
    """What a finished run's record says about its speed, as the planner uses it.

    Args:
        run_id: The MLflow run.
        run_dir: The run directory, when one was given.
        measured_step_s: Seconds per step as measured, on ``world_size`` devices.
        step_time_source: Where ``measured_step_s`` comes from, in words.
        world_size: Devices the run trained on.
        world_size_source: Where ``world_size`` comes from.
        steps: The run's total optimizer steps.
        steps_source: Where ``steps`` comes from.
        serial_fraction: The run's own ``amdahl/serial_fraction`` measured at ``world_size`` (its
            ``.../world_N`` record, which a run resumed on another device count keeps per world size), else
            the run's latest; None when it logged none.
        serial_fraction_key: The metric ``serial_fraction`` was read from.
        measured_device: What measured the step time: ``"CPU"``, the GPU model(s) in ``manifest.json``,
            or None when unknown.
        device_source: Where ``measured_device`` comes from.
    """

    run_id: str
    run_dir: str | None
    measured_step_s: float
    step_time_source: str
    world_size: int
    world_size_source: str
    steps: int
    steps_source: str
    serial_fraction: float | None
    measured_device: str | None = None
    device_source: str = "no manifest.json"
    serial_fraction_key: str = SERIAL_KEY


def _tracking_client() -> tuple[MlflowClient, str]:
    """A client on ``MLFLOW_TRACKING_URI`` (else the CLI's default); mlflow is imported only here."""
    import mlflow

    uri = tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).is_file():
        raise ValueError(f"no MLflow store at {uri}: set MLFLOW_TRACKING_URI to the store that tracked the run.")
    return mlflow.MlflowClient(tracking_uri=uri), uri


def _get_run(client: MlflowClient, run_id: str, what: str, uri: str) -> Run:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException:
        raise ValueError(f"unknown {what} {run_id!r}: no such MLflow run in {uri}.") from None


def _newest_record(run_dir: Path) -> ckpt_store.CheckpointRecord | None:
    """The run directory's newest checkpoint record (not hashed: records only are read)."""
    directory = run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else run_dir
    for path in ckpt_store.candidates(directory):
        record = ckpt_store.read_record(path, verify_hash=False)
        if record is not None:
            return record
    return None


def _manifest(client: MlflowClient, run: Run, run_dir: Path | None) -> dict | None:
    """The run's ``manifest.json``: from the run directory, else its MLflow artifacts."""
    places = [run_dir / "manifest.json"] if run_dir is not None else []
    artifacts = run.info.artifact_uri or ""
    local = "://" not in artifacts or artifacts.startswith("file://")
    if local:
        places.append(Path(artifacts.removeprefix("file://")) / "manifest.json")
    for path in places:
        if path.is_file():
            return json.loads(path.read_text())
    if local:
        return None
    try:  # a remote artifact store
        with tempfile.TemporaryDirectory() as tmp:
            return json.loads(Path(client.download_artifacts(run.info.run_id, "manifest.json", tmp)).read_text())
    except Exception:  # no manifest logged: the caller says so
        return None


def _world_size(manifest: dict | None, run: Run) -> tuple[int, str]:
    if manifest and isinstance(manifest.get("world_size"), int) and manifest["world_size"] >= 1:
        return manifest["world_size"], "manifest.json"
    params = run.data.params
    devices, nodes = params.get("trainer.devices", ""), params.get("trainer.num_nodes", "1")
    if devices.isdigit() and nodes.isdigit() and int(devices) >= 1:
        return int(devices) * int(nodes), "params trainer.devices x trainer.num_nodes"
    return 1, f"assumed: no manifest.json and trainer.devices={devices or None!r}"


def _measured_device(manifest: dict | None, run: Run) -> tuple[str | None, str]:
    """``("CPU" | GPU model(s) | None, where that comes from)``: the manifest's GPUs, unless the run chose the CPU."""
    if run.data.params.get("trainer.accelerator") == "cpu":
        return "CPU", "params trainer.accelerator=cpu"
    gpus = manifest.get("gpus") if manifest else None
    if not isinstance(gpus, list):
        return None, "no manifest.json" if manifest is None else "manifest.json names no devices"
    if not gpus:
        return "CPU", "manifest.json lists no GPU"
    return " + ".join(dict.fromkeys(map(str, gpus))), "manifest.json"


def device_caveat(device: str | None, device_source: str, instance: Instance) -> str | None:
    """Why a step time measured on ``device`` may not hold on ``instance``, or None when they match.

    Args:
        device: ``"CPU"``, a GPU model as ``torch.cuda.get_device_name`` gives it, or None (unknown).
        device_source: Where ``device`` comes from, for the reader.
        instance: The catalog row the plan prices.

    Returns:
        One sentence, or None when the run measured on the instance's kind of device (a CPU for a
        machine without GPUs; a GPU whose name contains the catalog's model, e.g. ``H100``).
    """
    target = instance.gpu or "CPU"
    if device is not None:
        if instance.gpu is None and device == "CPU":
            return None
        model = (instance.gpu or "").split()[0].lower() if instance.gpu else None
        if model and device != "CPU" and model in device.lower():
            return None
    measured = device or "an unknown device"
    kind = "device" if device is None else "CPU" if device == "CPU" else "GPU"
    return (f"step time measured on {measured} ({device_source}), priced as {instance.name} ({instance.gpus}x "
            f"{target}): the rows assume one {target} steps as fast as that {kind} did. Measure on the target "
            "device, or pass --step-time.") if instance.gpu else (
            f"step time measured on {measured} ({device_source}), priced as {instance.name} (no GPU): the rows "
            f"assume that machine steps as fast as that {kind} did. Measure on the target device, or pass "
            "--step-time.")


def measure_run(client: MlflowClient, run: Run, run_dir: Path | None = None) -> RunMeasurement:
    """Read a finished run's step time, steps and world size from its MLflow record (and run directory).

    Args:
        client: An ``mlflow.MlflowClient`` on the store that tracked the run.
        run: The ``mlflow.entities.Run``.
        run_dir: Its run directory, if known (its newest checkpoint record also gives the steps).

    Returns:
        The :class:`RunMeasurement` (see the module docstring for the order of preference).

    Raises:
        ValueError: If the run logged no steps, or has neither timing metrics nor an end time.
    """
    run_id = run.info.run_id
    metrics = run.data.metrics
    logged = 0
    for key in metrics:
        if not key.startswith("system/"):  # MLflow's system metrics count samples, not steps
            logged = max([logged, *(m.step for m in client.get_metric_history(run_id, key))])
    record = _newest_record(run_dir) if run_dir is not None else None
    steps, steps_source = logged, "furthest step the run logged"
    if record is not None and record.global_step >= steps:
        steps_source = "newest checkpoint record" if record.global_step > steps else f"{steps_source} and checkpoint"
        steps = record.global_step
    if steps < 1:
        raise ValueError(f"run {run_id} logged no training steps: give --steps and --step-time.")
    if metrics.get(STEP_MEAN_KEY, 0) > 0:
        measured, source = metrics[STEP_MEAN_KEY], f"{STEP_MEAN_KEY} (StepTiming's run mean)"
    elif STEP_WINDOW_KEY in metrics:
        values = [m.value for m in client.get_metric_history(run_id, STEP_WINDOW_KEY)]
        measured, source = sum(values) / len(values), f"mean of {len(values)} {STEP_WINDOW_KEY} windows"
    else:
        if run.info.end_time is None:
            raise ValueError(f"run {run_id} has not finished (status {run.info.status}) and logged no "
                             f"{STEP_MEAN_KEY}: give --step-time.")
        wall = (run.info.end_time - run.info.start_time) / 1000.0
        measured, source = wall / steps, f"wall duration {wall:g} s / {steps} steps (MLflow run start to end)"
    if not measured > 0:
        raise ValueError(f"run {run_id}: measured step time {measured!r} s is not positive: give --step-time.")
    manifest = _manifest(client, run, run_dir)
    world, world_source = _world_size(manifest, run)
    device, device_source = _measured_device(manifest, run)
    serial_key = f"{SERIAL_KEY}/world_{world}" if f"{SERIAL_KEY}/world_{world}" in metrics else SERIAL_KEY
    serial = metrics.get(serial_key)
    return RunMeasurement(run_id=run_id, run_dir=None if run_dir is None else str(run_dir),
                          measured_step_s=float(measured), step_time_source=source, world_size=world,
                          world_size_source=world_source, steps=int(steps), steps_source=steps_source,
                          serial_fraction=None if serial is None else float(serial), measured_device=device,
                          device_source=device_source, serial_fraction_key=serial_key)


def _resolve_run(client: MlflowClient, ref: str, uri: str) -> tuple[Run, Path | None]:
    """``ref`` as a run directory (its checkpoint records name the MLflow run) or an MLflow run id."""
    path = Path(ref)
    if not path.is_dir():
        return _get_run(client, ref, "run", uri), None
    record = _newest_record(path)
    run_id = record.extra.get("mlflow_run_id") if record is not None else None
    if not run_id:
        raise ValueError(f"run directory {ref!r} has no checkpoint record naming its MLflow run "
                         "(checkpoints/*.meta.json): pass the MLflow run id instead.")
    return _get_run(client, run_id, f"run (from {ref})", uri), path


def _law_from_scale_run(client: MlflowClient, run_id: str, uri: str) -> tuple[dict[str, float], str]:
    run = _get_run(client, run_id, "--scale-run", uri)
    metrics, best = run.data.metrics, run.data.tags.get(BEST_LAW_TAG)
    if best == "usl" and SCALE_USL_KEYS[0] in metrics:
        law = {"usl_a": metrics[SCALE_USL_KEYS[0]], "usl_b": metrics.get(SCALE_USL_KEYS[1], 0.0)}
        return law, f"USL fit of recipes.scale run {run_id} (best R²)"
    if SCALE_SERIAL_KEY in metrics:
        return {"serial_fraction": metrics[SCALE_SERIAL_KEY]}, f"Amdahl fit of recipes.scale run {run_id}"
    raise ValueError(f"--scale-run {run_id} logged no {SCALE_SERIAL_KEY}: is it a recipes.scale parent run?")


def _speedup(n: int, law: dict[str, float]) -> float:
    if law.get("serial_fraction") is not None:
        return float(amdahl_speedup(n, law["serial_fraction"]))
    return float(usl_speedup(n, law.get("usl_a") or 0.0, law.get("usl_b") or 0.0))


# ------------------------------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m recipes.plan",
        description="Expected wall time and cost per device count and market (on-demand vs spot). "
                    "For which batch size: python -m recipes.plan batch --help.",
    )
    p.add_argument("--run", metavar="RUN_ID_OR_RUN_DIR",
                   help="plan from a finished run: its MLflow run id or run directory (measured step time, steps, "
                        "scaling law)")
    p.add_argument("--step-time", type=float,
                   help="seconds per step on one device (required without --run; overrides the run's)")
    p.add_argument("--steps", type=int, help="steps in the run (required without --run; overrides the run's)")
    law = p.add_argument_group("scaling law (one of; with --run, else the run's amdahl/serial_fraction)")
    law.add_argument("--serial-fraction", type=float, help="Amdahl serial fraction s in [0, 1]")
    law.add_argument("--usl-a", type=float, help="USL contention coefficient a >= 0")
    law.add_argument("--usl-b", type=float, help="USL coherency coefficient b >= 0")
    law.add_argument("--scale-run", metavar="RUN_ID",
                     help="the fit logged by a recipes.scale parent run (USL if it fitted best, else Amdahl)")
    p.add_argument("--instance", required=True, help="instance name from the price catalog")
    p.add_argument("--catalog", help="price catalog YAML (default: callbacks/analysis/prices.yaml)")
    p.add_argument("--price-on-demand", type=float, help="override the on-demand USD per instance-hour")
    p.add_argument("--price-spot", type=float, help="override the spot USD per instance-hour")
    p.add_argument(
        "--interruption-rate",
        type=float,
        help="probability that one spot instance is interrupted per period, in [0, 1) (default: the catalog "
        "row's typical rate and period, with its source)",
    )
    p.add_argument("--rate-period-h", type=float,
                   help="period of --interruption-rate, hours (default 1 with --interruption-rate)")
    p.add_argument(
        "--save-cost-s", type=float, default=30.0, help="seconds to write a checkpoint (default 30)"
    )
    p.add_argument(
        "--restart-s", type=float, default=120.0, help="seconds to restart and reload (default 120)"
    )
    p.add_argument(
        "--devices",
        default=",".join(map(str, DEFAULT_DEVICES)),
        help="comma-separated device counts (default 1,2,4,8,16,32,64)",
    )
    p.add_argument("--deadline-h", type=float, help="pick the cheapest plan done within this many hours")
    p.add_argument("--budget-usd", type=float, help="pick the fastest plan within this many USD")
    p.add_argument("--json", action="store_true", help="print rows and picks as JSON instead of a table")
    p.add_argument("--plot", help="write a PNG of cost vs wall time with the Pareto front")
    return p


def _explicit_law(args: argparse.Namespace) -> dict[str, float] | None:
    law = {"serial_fraction": args.serial_fraction, "usl_a": args.usl_a, "usl_b": args.usl_b}
    law = {k: v for k, v in law.items() if v is not None}
    if law and args.scale_run:
        flags = ", ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in law.items())
        raise ValueError(f"give either --scale-run {args.scale_run} or {flags}, not both.")
    return law or None


def _interruption(args: argparse.Namespace, instance: Instance) -> tuple[float, float, str]:
    """``(rate, period in hours, where it comes from)``: the user's, else the catalog row's typical rate."""
    if args.interruption_rate is not None:
        period_h = 1.0 if args.rate_period_h is None else args.rate_period_h
        if not period_h > 0:
            raise ValueError(f"--rate-period-h {args.rate_period_h!r} must be a positive number of hours.")
        return args.interruption_rate, period_h, "--interruption-rate"
    if args.rate_period_h is not None:
        raise ValueError(f"--rate-period-h {args.rate_period_h:g} is the period of --interruption-rate: give both, "
                         "or neither for the catalog's typical rate.")
    if instance.spot_interruption_rate is not None:
        return (instance.spot_interruption_rate, instance.spot_interruption_period_h,
                f"catalog default for {instance.name} spot: {instance.spot_interruption_source}")
    if instance.spot_usd_per_h is None:
        return 0.0, 1.0, f"unused: the catalog has no spot price for {instance.name!r}"
    raise ValueError(f"--interruption-rate is required: the catalog has no spot interruption rate for "
                     f"{instance.name!r} (give its row spot_interruption_rate, spot_interruption_period_h and "
                     "spot_interruption_source, or pass --interruption-rate P [--rate-period-h H]).")


def _inputs_from_args(args: argparse.Namespace) -> tuple[PlanInputs, dict | None, str]:
    """The plan's inputs, (with ``--run``) where the measured ones come from, and where the interruption rate does."""
    catalog = load_catalog(args.catalog)
    instance = with_overrides(get_instance(catalog, args.instance), args.price_on_demand, args.price_spot)
    rate, period_h, rate_source = _interruption(args, instance)
    law = _explicit_law(args)
    law_source = "command line" if law else None
    source = None
    step_time, steps = args.step_time, args.steps
    client = uri = None
    if args.run or args.scale_run:
        client, uri = _tracking_client()
    if law is None and args.scale_run:
        law, law_source = _law_from_scale_run(client, args.scale_run, uri)
    if args.run:
        run, run_dir = _resolve_run(client, args.run, uri)
        measured = measure_run(client, run, run_dir)
        if law is None and measured.serial_fraction is not None:
            key = measured.serial_fraction_key
            law_source = f"the run's {key}" + (f" (measured on {measured.world_size} devices)" if key != SERIAL_KEY
                                               else "")
            law = {"serial_fraction": measured.serial_fraction}
        if law is None:
            raise ValueError(f"no scaling law: run {measured.run_id} logged no {SERIAL_KEY}; give --scale-run "
                             "PARENT_RUN_ID (a recipes.scale sweep), --serial-fraction S or --usl-a A --usl-b B.")
        speedup = _speedup(measured.world_size, law)
        source = asdict(measured)
        source["run_serial_fraction"] = source.pop("serial_fraction")  # what the run measured, used or not
        source.update(speedup_at_world_size=speedup, scaling_law_source=law_source)
        caveat = device_caveat(measured.measured_device, measured.device_source, instance)
        source["caveats"] = []
        if step_time is None:
            step_time = measured.measured_step_s * speedup  # one device's step: C(W) times longer
            source["step_time_source"] = measured.step_time_source
            source["caveats"] += [caveat] if caveat else []
        else:
            source["step_time_source"] = "--step-time"
        if steps is None:
            steps = measured.steps
        else:
            source["steps_source"] = "--steps"
        source["step_time_s"], source["steps"] = step_time, steps
    for flag, value in (("--step-time", step_time), ("--steps", steps)):
        if value is None:
            raise ValueError(f"{flag} is required (or plan from a finished run with --run RUN_ID_OR_RUN_DIR).")
    law = law or {}
    inputs = PlanInputs(
        step_time_s=step_time,
        steps=steps,
        instance=instance,
        serial_fraction=law.get("serial_fraction"),
        usl_a=law.get("usl_a"),
        usl_b=law.get("usl_b"),
        interruption_rate=rate,
        rate_period_s=period_h * 3600.0,
        save_cost_s=args.save_cost_s,
        restart_s=args.restart_s,
        devices=tuple(positive_ints("--devices", args.devices)),
        deadline_h=args.deadline_h,
        budget_usd=args.budget_usd,
    )
    return inputs, source, rate_source


def _print_source(source: dict) -> None:
    where = source["run_id"] + (f" ({source['run_dir']})" if source["run_dir"] else "")
    world = source["world_size"]
    per_device = (f" x C({world}) = {source['speedup_at_world_size']:.3f} -> {source['step_time_s']:.6g} s on one "
                  "device" if world > 1 else "")
    print(f"from run {where}:")
    print(f"  step time  {source['measured_step_s']:.6g} s on {world} device(s) ({source['world_size_source']})"
          f"{per_device} [{source['step_time_source']}]")
    print(f"  steps      {source['steps']:,} [{source['steps_source']}]")
    print(f"  scaling    {source['scaling_law_source']}")
    for caveat in source["caveats"]:
        print(f"caveat: {caveat}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the planner from the command line.

    Args:
        argv: Arguments without the program name; None for ``sys.argv[1:]``.

    Returns:
        0 with a plan; 1 when no row meets the deadline or budget; 2 on bad input.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["batch"]:  # which batch size: recipes/plan_batch.py
        from recipes.plan_batch import main as batch_main

        return batch_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        inputs, source, rate_source = _inputs_from_args(args)
    except (KeyError, ValueError, FileNotFoundError, UsageError) as err:
        message = err.args[0] if err.args else str(err)
        print(f"error: {message}", file=sys.stderr)
        return 2
    try:
        result = plan(inputs)
    except ValueError as err:  # inputs each valid whose products overflow (a step time of 1e308 s)
        print(f"error: --step-time {inputs.step_time_s:g} s x --steps {inputs.steps} gives no finite plan "
              f"({err.args[0] if err.args else err}); give a real step time and step count.", file=sys.stderr)
        return 2
    if args.json:
        out = to_json(result)
        out["interruption_rate_source"] = rate_source
        if source is not None:
            out["run"] = source
        print(json.dumps(out, indent=2))
    else:
        if source is not None:
            _print_source(source)
        if rate_source.startswith("catalog default"):
            _console().print(f"interruption rate {inputs.interruption_rate:g} per {inputs.rate_period_s / 3600:g} h "
                             f"({rate_source}; pass --interruption-rate to override)", markup=False, highlight=False)
        print_table(result)
    if args.plot:
        written = write_plot(result, args.plot)
        if not args.json:
            print(f"wrote {written}")
    return 0 if result.feasible else 1


if __name__ == "__main__":
    raise SystemExit(main())
