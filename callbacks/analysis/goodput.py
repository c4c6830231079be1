"""The goodput ledger: where a run's billed seconds went, and what each part cost. Pure Python.

A run's billed time (``cost/billed_s``, per instance, every launch and the gaps between launches) is split
into categories that add up to it exactly: the *productive* step time and the *badput* by cause.

================  ==========================================================================================
category          what it holds
================  ==========================================================================================
``productive``    optimizer steps that count: forward, backward, optimizer (each step once: a rerun of a
                  lost step counts here, its lost first run under ``redone``)
``startup``       process start to each launch's first step, plus that first step's time above the run's
                  mean step (imports, process group, model and data, checkpoint restore, compilation)
``redone``        the work interruptions lost: the lost steps (``cost/lost_steps``, exact from the steps
                  sidecar) x the run's mean step time, the same count and figure as ``cost/lost_work_usd``;
                  taken out of the billed gaps between launches, where those first runs were spent
``checkpoint``    the training loop's stall in checkpoint saves
``validation``    validation runs (checkpoint saves inside them excluded)
``data_wait``     between two steps: waiting for the batch, the loop's bookkeeping and per-step collectives
``comm_exposed``  gradient communication the backward did not hide (DDP, measured by ``StepTiming``)
``tail``          after the last step, neither validation nor a save: the end of training
``restart``       the gaps between launches that are billed, less what is known of them (see below)
================  ==========================================================================================

A gap between launches runs from the checkpoint's save to the relaunch's bill clock. It holds the
interrupted launch's work after that save, its shutdown, the time the job was down, and the relaunch's
start before the clock (its imports, unless the bill starts at process spawn). Two parts of it are known and
moved out of ``restart``: the lost steps' first runs (``redone``: lost steps x mean step, see
:func:`charge_redone`) and the relaunch's seconds from process spawn to the bill clock (start-up). The reruns
are measured as they run; ``CostTracker`` reports them beside the charge (they ran at another time, on a
machine whose load may differ: on a quiet machine the two agree within a few per cent).

Dollars: each category's instance-seconds times the price of a market (:func:`priced`). This module knows
no clocks, no torch and no Lightning: :class:`callbacks.cost.CostTracker` feeds it.

Example (hand-computed; the unit tests check these numbers)::

    ledger = Ledger()
    ledger.add("productive", 90.0)
    ledger.add("startup", 10.0)
    ledger.share()                       # 0.9
    priced(ledger, 3.6)["startup"]       # 10 s at $3.60/h = $0.01
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from . import keys

__all__ = ["BADPUT", "CATEGORIES", "LABELS", "Ledger", "carve_comm", "charge_redone", "check_sum", "largest_badputs",
           "metrics", "priced", "resolve_first_steps", "split_gap"]

#: Every category, productive first; the others are badput.
CATEGORIES = ("productive", "startup", "redone", "checkpoint", "validation", "data_wait", "comm_exposed", "tail",
              "restart")
BADPUT = CATEGORIES[1:]
#: Words for tables and plots.
LABELS = {"productive": "productive steps", "startup": "start-up", "redone": "redone steps",
          "checkpoint": "checkpoint stalls", "validation": "validation", "data_wait": "data wait",
          "comm_exposed": "exposed comm", "tail": "tail", "restart": "gaps between launches",
          "unattributed": "unattributed"}
#: Categories the ledger may hold besides :data:`CATEGORIES`: seconds restored from a checkpoint written
#: before the ledger existed (nothing says what they were).
EXTRA = ("unattributed",)


def _check_category(category: str) -> None:
    if category not in CATEGORIES and category not in EXTRA:
        raise ValueError(f"goodput category {category!r} is not one of {', '.join(CATEGORIES)}.")


def _check_seconds(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"goodput: {name}={value!r} must be a finite number of seconds >= 0.")


@dataclass
class Ledger:
    """Seconds and instance-seconds per category.

    Args:
        seconds: per-instance seconds per category (what ``cost/billed_s`` counts).
        instance_s: instance-seconds per category (what is priced); a category missing here is priced as
            its ``seconds`` on one instance.
    """

    seconds: dict[str, float] = field(default_factory=dict)
    instance_s: dict[str, float] = field(default_factory=dict)

    def add(self, category: str, seconds: float, instances: float = 1.0) -> None:
        """Add ``seconds`` (per instance) run on ``instances`` instances to ``category``.

        Raises:
            ValueError: for an unknown category or negative or non-finite seconds.
        """
        _check_category(category)
        _check_seconds(category, seconds)
        self.seconds[category] = self.seconds.get(category, 0.0) + seconds
        self.instance_s[category] = self.instance_s.get(category, 0.0) + seconds * instances

    def move(self, source: str, target: str, seconds: float) -> float:
        """Move up to ``seconds`` of ``source`` into ``target`` (instance-seconds in proportion); returns the moved."""
        _check_category(target)
        held = self.seconds.get(source, 0.0)
        moved = min(max(0.0, seconds), held)
        if moved <= 0:
            return 0.0
        inst = self.instance_s.get(source, held) * moved / held
        self.seconds[source] = held - moved
        self.instance_s[source] = self.instance_s.get(source, held) - inst
        self.seconds[target] = self.seconds.get(target, 0.0) + moved
        self.instance_s[target] = self.instance_s.get(target, 0.0) + inst
        return moved

    def merged(self, *others: Ledger) -> Ledger:
        """A new ledger holding this one's and ``others``' sums."""
        out = Ledger(dict(self.seconds), dict(self.instance_s))
        for other in others:
            for key, value in other.seconds.items():
                out.seconds[key] = out.seconds.get(key, 0.0) + value
                out.instance_s[key] = out.instance_s.get(key, 0.0) + other.instance_s.get(key, value)
        return out

    def total_s(self) -> float:
        """Seconds of every category together: the billed seconds it accounts for."""
        return math.fsum(self.seconds.values())

    def share(self) -> float:
        """Productive seconds / all seconds (0 for an empty ledger)."""
        total = self.total_s()
        return self.seconds.get("productive", 0.0) / total if total > 0 else 0.0

    def state(self) -> dict[str, dict[str, float]]:
        """Plain dicts for a checkpoint (``weights_only`` loads them)."""
        return {"seconds": dict(self.seconds), "instance_s": dict(self.instance_s)}

    @classmethod
    def from_state(cls, state: Mapping[str, Mapping[str, float]]) -> Ledger:
        """The inverse of :meth:`state`."""
        return cls({k: float(v) for k, v in state.get("seconds", {}).items()},
                   {k: float(v) for k, v in state.get("instance_s", {}).items()})


def split_gap(gap_s: float, spawn_s: float = 0.0, instances: float = 1.0) -> Ledger:
    """Split a billed gap between launches: the relaunch's spawn-to-clock seconds (start-up), and the rest.

    Args:
        gap_s: the billed gap (checkpoint's save -> relaunch's bill clock, or a fixed ``restart_s``).
        spawn_s: seconds from the relaunch's process spawn to its bill clock, inside the gap (0 when the
            bill starts at spawn).
        instances: instances the gap is billed on.

    Returns:
        ``startup`` = ``min(gap, spawn_s)``, ``restart`` = the rest. Example: a 100 s gap, 5 s spawn -> 5 / 95 s.
    """
    _check_seconds("gap_s", gap_s)
    _check_seconds("spawn_s", spawn_s)
    spawn = min(gap_s, spawn_s)
    out = Ledger()
    out.add("startup", spawn, instances)
    out.add("restart", gap_s - spawn, instances)
    return out


def charge_redone(ledger: Ledger, lost_steps: int, mean_step_s: float | None) -> Ledger:
    """Move the lost steps' first runs, ``lost_steps x mean_step_s``, out of the gaps into ``redone``.

    An interrupted launch ran those steps after its last save, inside the gap the relaunch bills; they are
    priced at the run's mean step, as ``cost/lost_work_usd`` prices them, so the two figures are one count.
    At most the gaps' seconds move (a fixed ``restart_s`` may bill less than was lost).

    Example: 10 steps lost at 2 s from a 100 s gap -> 20 s ``redone``, 80 s ``restart``.
    """
    if isinstance(lost_steps, bool) or int(lost_steps) != lost_steps or lost_steps < 0:
        raise ValueError(f"goodput: lost_steps={lost_steps!r} must be an integer >= 0.")
    out = ledger.merged()
    if mean_step_s:
        out.move("restart", "redone", lost_steps * mean_step_s)
    return out


def resolve_first_steps(ledger: Ledger, first_steps: Iterable[tuple[str, float, float]],
                        mean_step_s: float | None) -> Ledger:
    """Charge each launch's first step at the mean step time to its category, the excess to start-up.

    A launch's first step holds one-off work (lazy initialization, bucket building, compilation): it is
    start-up except for the ordinary step it also is. Example: a 0.5 s first step at a 0.1 s mean puts
    0.1 s in its category (``productive`` or ``redone``) and 0.4 s in ``startup``.

    Args:
        ledger: the ledger without the first steps.
        first_steps: ``(category, seconds, instance-seconds)`` of each launch's first step.
        mean_step_s: the run's mean step time; None charges each first step whole to its category.

    Returns:
        A new ledger with the first steps added.
    """
    out = ledger.merged()
    for category, seconds, inst in first_steps:
        instances = inst / seconds if seconds > 0 else 1.0
        charge = seconds if mean_step_s is None else min(seconds, mean_step_s)
        out.add(category, charge, instances)
        out.add("startup", seconds - charge, instances)
    return out


def carve_comm(ledger: Ledger, comm_share: float) -> Ledger:
    """Move the exposed communication out of the productive step time.

    Args:
        ledger: a ledger with ``productive`` seconds.
        comm_share: exposed communication / step time, as measured over the run's timed steps (``StepTiming``'s
            totals); 0 without a measurement.

    Returns:
        A new ledger; e.g. 100 s productive at a share of 0.05 -> 95 s productive, 5 s ``comm_exposed``.
    """
    if not (0.0 <= comm_share <= 1.0):
        raise ValueError(f"goodput: comm_share={comm_share!r} must be within [0, 1].")
    out = ledger.merged()
    out.move("productive", "comm_exposed", out.seconds.get("productive", 0.0) * comm_share)
    return out


def priced(ledger: Ledger, usd_per_instance_h: float) -> dict[str, float]:
    """Dollars per category at one price per instance-hour (every category, 0 where empty)."""
    if not (usd_per_instance_h >= 0 and math.isfinite(usd_per_instance_h)):
        raise ValueError(f"goodput: usd_per_instance_h={usd_per_instance_h!r} must be a finite number >= 0.")
    names = [*CATEGORIES, *(k for k in ledger.seconds if k not in CATEGORIES)]
    return {k: ledger.instance_s.get(k, ledger.seconds.get(k, 0.0)) / 3600.0 * usd_per_instance_h for k in names}


def largest_badputs(usd: Mapping[str, float], n: int | None = 3) -> list[tuple[str, float]]:
    """The ``n`` (``None``: every) badput categories costing most, largest first (ties in :data:`CATEGORIES` order),
    non-zero only."""
    order = {k: i for i, k in enumerate((*CATEGORIES, *EXTRA))}
    items = [(k, v) for k, v in usd.items() if k != "productive" and v > 0]
    return sorted(items, key=lambda kv: (-kv[1], order.get(kv[0], len(order))))[:n]


def metrics(ledger: Ledger, usd_per_instance_h: float) -> dict[str, float]:
    """The ``goodput/*`` keys: ``<category>_s``, ``<category>_usd`` (this price) and ``share``."""
    usd = priced(ledger, usd_per_instance_h)
    out: dict[str, float] = {}
    for key in usd:
        if key in CATEGORIES or ledger.seconds.get(key):
            out[keys.goodput_seconds_key(key)] = ledger.seconds.get(key, 0.0)
            out[keys.goodput_usd_key(key)] = usd[key]
    out[keys.GOODPUT_SHARE_KEY] = ledger.share()
    return out


def check_sum(ledger: Ledger, billed_s: float, rel: float = 1e-3) -> float:
    """The ledger's relative gap to the billed seconds; raises when it passes ``rel``.

    Raises:
        ValueError: if ``|total - billed| > rel x billed`` (the message names both).
    """
    total = ledger.total_s()
    gap = abs(total - billed_s) / billed_s if billed_s > 0 else abs(total)
    if gap > rel:
        raise ValueError(f"goodput: the categories sum to {total:.6f} s, not the {billed_s:.6f} s billed "
                         f"({gap:.3%} > {rel:.3%}).")
    return gap
