"""The soak's check of a run's goodput ledger against the faults it injected (issue 47).

The soak knows what happened to each run: its launches (when each started, when its first training loss
reached the store, which checkpoint it resumed from) and the steps each fault lost (the furthest step the
struck launch logged less the step the next launch resumed from). The run's final ``goodput/*`` and ``cost/*``
must agree:

- the categories sum to ``cost/billed_s`` within :data:`SUM_TOLERANCE` (0.1 %);
- redone steps: the ledger's lost steps (``cost/lost_steps``, exact from the steps sidecar) lie within the soak's
  sum over the run's faults, less :data:`LOST_STEPS_PER_FAULT` step per fault, and that sum plus the same and the
  steps a SIGKILLed launch can have run past its loss history (a SIGKILL drops the losses still queued for the
  store: seen 10 steps run, 5 in the history; ``Fault.unlogged_max`` bounds them from the launch's fastest logged
  pace; unknown for a launch with fewer than two losses logged, then there is no upper bound), and
  ``goodput/redone_usd`` lies in the same interval of steps at the ledger's mean step price;
- start-up: ``goodput/startup_s`` equals the start-up of the launches whose start-up is on the books within
  :data:`STARTUP_REL` + :data:`STARTUP_PER_LAUNCH_S` per launch. A launch's start-up is on the books when a later
  launch resumed from a checkpoint it wrote (the next launch that got as far as resuming started from a newer
  step than it did) or it is the run's last launch; any other launch's whole life is billed in the next restart
  gap. The soak's figure for a launch is its spawn to its first logged training loss, which also holds the first
  step and the tracking store's write of the loss (hence the allowance per launch); the launches run with
  ``--cost.bill_from spawn``. A launch on the books whose losses never reached the store (SIGKILLed before
  MLflow's queue was written) has no such figure: it adds between 0 and its whole wall time to the bounds.

Dollars are at the soak's price (:data:`PRICE_ARGS`: $3.60 per hour, a thousandth of a dollar a second), so the
figures read as seconds too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from callbacks.analysis import keys
from callbacks.analysis.goodput import CATEGORIES
from recipes.soak.faults import Fault
from recipes.soak.launch import Launch

__all__ = ["LEDGER_ARGS", "check_ledger"]

#: What every soak launch adds to its command: bill from spawn, at a price that makes seconds into dollars.
PRICE_ARGS = ("--cost.price_on_demand", "3.6")
LEDGER_ARGS = ("--cost.bill_from", "spawn", *PRICE_ARGS)
SUM_TOLERANCE = 1e-3
LOST_STEPS_PER_FAULT = 1
STARTUP_REL = 0.10
STARTUP_PER_LAUNCH_S = 1.0


def on_the_books(launches: Sequence[Launch]) -> list[Launch]:
    """The launches (in order) whose start-up the ledger keeps: each that a later launch resumed past, and the last.

    Only launches that got as far as deciding where to start (a resume line, or training from step 0) count: a
    launch refused by the run's lock or killed in its imports neither wrote nor read a checkpoint.
    """
    decided = [launch for launch in launches if launch.decided]
    out = []
    for index, launch in enumerate(decided):
        later = decided[index + 1] if index + 1 < len(decided) else None
        if later is None or (later.resumed_from or 0) > (launch.resumed_from or 0):
            out.append(launch)
    return out


def check_ledger(final: dict[str, float], launches: Sequence[Launch], faults: Sequence[Fault]
                 ) -> tuple[dict[str, Any], list[str]]:
    """The run's ledger beside what the soak saw; returns the record for the report and the problems found.

    Args:
        final: the run's latest value of every metric (MLflow's ``run.data.metrics``).
        launches: the run's launches, in order.
        faults: the run's faults.
    """
    if keys.GOODPUT_SHARE_KEY not in final or keys.BILLED_KEY not in final:
        return {"ledger": None}, [f"the run logged no goodput ledger ({keys.GOODPUT_SHARE_KEY}, {keys.BILLED_KEY})"]
    problems = []
    seconds = {c: final.get(keys.goodput_seconds_key(c), 0.0) for c in CATEGORIES}
    billed = final[keys.BILLED_KEY]
    total = sum(seconds.values())
    if abs(total - billed) > SUM_TOLERANCE * billed:
        problems.append(f"the categories sum to {total:.3f} s, not the {billed:.3f} s billed")
    lost_ledger = int(final.get(keys.LOST_STEPS_KEY, 0))
    counted = [f for f in faults if f.lost_steps is not None]
    lost_soak = sum(f.lost_steps or 0 for f in counted)
    slack = LOST_STEPS_PER_FAULT * len(counted)
    unlogged = [f.unlogged_max for f in counted]
    lost_low = lost_soak - slack
    lost_high = None if None in unlogged else lost_soak + slack + sum(u or 0 for u in unlogged)
    shown = f"{max(lost_low, 0)} .. {'?' if lost_high is None else lost_high}"
    if lost_ledger < lost_low or (lost_high is not None and lost_ledger > lost_high):
        problems.append(f"the ledger counts {lost_ledger} lost steps, outside the faults' {shown} "
                        f"({lost_soak} in the loss history; allowed: {LOST_STEPS_PER_FAULT} a fault, and the steps a "
                        f"SIGKILLed launch ran past its history)")
    step_usd = final.get(keys.LOST_WORK_KEY, 0.0) / lost_ledger if lost_ledger else 0.0
    redone_usd = final.get(keys.goodput_usd_key("redone"), 0.0)
    tiny = 1e-12
    if lost_ledger and (redone_usd < lost_low * step_usd - tiny
                        or (lost_high is not None and redone_usd > lost_high * step_usd + tiny)):
        problems.append(f"redone ${redone_usd:.4f} against the faults' {shown} steps x ${step_usd:.6f}")
    books = on_the_books(launches)
    startup_soak = sum(launch.first_step_s or 0.0 for launch in books)
    unmeasured = sum(launch.wall_s or 0.0 for launch in books if launch.first_step_s is None)
    allowed = STARTUP_REL * startup_soak + STARTUP_PER_LAUNCH_S * len(books)
    low, high = startup_soak - allowed, startup_soak + unmeasured + allowed
    if not low <= seconds["startup"] <= high:
        problems.append(f"start-up {seconds['startup']:.2f} s outside {low:.2f} .. {high:.2f} s for the "
                        f"{len(books)} launch(es) on the books ({startup_soak:.2f} s measured)")
    record = {"ledger": {"seconds": seconds, "usd": {c: final.get(keys.goodput_usd_key(c), 0.0) for c in CATEGORIES},
                         "share": final[keys.GOODPUT_SHARE_KEY], "billed_s": billed},
              "lost_steps": {"ledger": lost_ledger, "faults": lost_soak, "bounds": [lost_low, lost_high]},
              "startup_s": {"ledger": seconds["startup"], "launches_on_the_books": startup_soak,
                            "launches": len(books), "unmeasured_wall_s": unmeasured, "bounds": [low, high]}}
    return record, problems
