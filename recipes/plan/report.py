"""The device plan in words: the rich table with its picks and messages, and the JSON of ``--json``.

Formatting only: it reads a :class:`~recipes.plan.model.PlanResult` and computes nothing the model does
not. The table fits the console (columns are dropped in a fixed order when it is narrow, and the caption
says which); JSON has no infinity, so an infinite MTBF or checkpoint interval becomes null.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import asdict
from typing import Any

from recipes.plan.model import PlanResult, PlanRow, money, usd
from recipes.run.common import human_duration

__all__ = ["PICK_NAMES", "print_overhead_check", "print_table", "projection_note", "rich_console", "to_json"]


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


def _count(x: float) -> str:
    return "0" if x == 0 else "<0.01" if x < 0.005 else f"{x:.2f}"


def rich_console() -> Any:
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

    console = rich_console()
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
            "cost $": money(r.cost_usd), "interr.": _count(r.interruptions),
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
              "budget": usd(inp.budget_usd) if inp.budget_usd is not None else ""}
    picked = [(PICK_NAMES[key][0].format(**limits) + ":", row) for key, row in result.picks.items() if row]
    width = max((len(name) for name, _ in picked), default=0)
    for name, row in picked:
        console.print(f"{name:<{width}} {row.label}, {human_duration(row.wall_h * 3600)}, {usd(row.cost_usd)}",
                      markup=False, highlight=False)
    for message in result.messages:
        console.print(message, markup=False, highlight=False)


def projection_note(measured: Any, law_source: str) -> str | None:
    """What the scaling law is: a one-process projection (and what it assumes), or a measurement beside one."""
    own = measured.serial_fraction
    if law_source.startswith("the run's") and measured.world_size == 1:
        return ("a projection, not a measurement: Amdahl from one process's serial share, which holds no "
                "communication and no second rank's threads on shared cores; measure with python -m recipes.scale "
                "--devices 1,2 and pass --scale-run")
    if own is not None and "recipes.scale run" in law_source:
        return (f"measured by the sweep; the run's own one-process projection, s={own:.3g} "
                f"(x{1 / (own + (1 - own) / 2):.2f} at N=2), stands beside it")
    return None


def print_overhead_check(check: dict) -> None:
    """The run's realized checkpoint + lost-work overhead beside Young/Daly's and the flat surcharge formula."""
    mtbf = "none seen" if math.isinf(check["mtbf_s"]) else f"{human_duration(check['mtbf_s'])}"
    optimum = ("not needed" if math.isinf(check["optimum_interval_s"])
               else human_duration(check["optimum_interval_s"]))
    print(f"checkpoints and interruptions ({check['interruptions']} resume(s); measured save d = "
          f"{check['save_cost_s']:.3g} s, work between saves t = {human_duration(check['interval_s'])}, "
          f"M = {mtbf}, restart R = {check['restart_s']:.3g} s):")
    print(f"  realized      {check['realized']:.2%} of the productive time (checkpoint stalls + redone steps + "
          "restart gaps, from the goodput ledger)")
    print(f"  Young/Daly    {check['predicted']:.2%} at the realized t (d/t + t/2M + R/M); "
          f"{check['predicted_at_optimum']:.2%} at Daly's t = {optimum}")
    print(f"  1 + P x O     {check['seed']:.2%} (interruptions per hour x hours each cost): leaves out the saves "
          "paid without any interruption (d/t), takes the work an interruption loses as fixed when it is t/2 "
          "on average (so it cannot choose t), and is linear in P (no interruption of a redo or a restart)")
