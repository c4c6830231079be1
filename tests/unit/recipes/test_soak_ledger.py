"""The soak's ledger check (recipes/soak/ledger.py): launches on the books, and the tolerances, by hand."""

from __future__ import annotations

from recipes.soak.faults import Fault
from recipes.soak.launch import Launch, unlogged_bound
from recipes.soak.ledger import check_ledger, on_the_books

CATEGORIES = ("productive", "startup", "redone", "checkpoint", "validation", "data_wait", "comm_exposed", "tail",
              "restart")


def launch(resumed_from: int | None, first_step_s: float | None, wall_s: float, decided: bool = True) -> Launch:
    return Launch("x", "r", [], 0.0, None, "", "", resumed_from=resumed_from, first_step_s=first_step_s,
                  wall_s=wall_s, decided=decided)


def final(startup: float, lost: int, billed: float = 100.0) -> dict[str, float]:
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    seconds.update(startup=startup, redone=lost * 0.5, productive=billed - startup - lost * 0.5)
    out = {f"goodput/{k}_s": v for k, v in seconds.items()}
    out.update({"goodput/redone_usd": lost * 0.5 / 1000, "cost/lost_work_usd": lost * 0.5 / 1000,
                "cost/lost_steps": float(lost), "cost/billed_s": billed, "goodput/share": 0.5})
    return out


def test_on_the_books_by_hand() -> None:
    first = launch(None, 20.0, 30.0)         # notice save at 16: the next resumed past it
    killed = launch(16, None, 22.0)          # saved 25 before its SIGKILL, no loss reached the store
    refused = launch(None, None, 1.0, decided=False)  # the lock refused it
    lost = launch(25, 18.0, 19.0)            # killed before saving: the next resumes from 25 again
    last = launch(25, 20.0, 24.0)
    assert on_the_books([first, killed, refused, lost, last]) == [first, killed, last]


def test_check_ledger_tolerances() -> None:
    launches = [launch(None, 20.0, 30.0), launch(16, None, 22.0), launch(25, 20.0, 24.0)]
    faults = [Fault(0, "sigterm", "r", "training", lost_steps=0), Fault(1, "sigkill", "r", "training", lost_steps=3)]
    # measured 40 s on the books, 22 s unmeasured, allowed 10 % + 1 s a launch = 7 s: 33 .. 69 s
    record, problems = check_ledger(final(67.0, 4), launches, faults)
    assert problems == []
    assert record["startup_s"]["bounds"] == [33.0, 69.0]
    assert record["lost_steps"] == {"ledger": 4, "faults": 3, "bounds": [1, 5]}  # one step a fault allowed
    _, problems = check_ledger(final(70.0, 6), launches, faults)
    assert problems == ["the ledger counts 6 lost steps, outside the faults' 1 .. 5 (3 in the loss history; allowed: "
                        "1 a fault, and the steps a SIGKILLed launch ran past its history)",
                        "redone $0.0030 against the faults' 1 .. 5 steps x $0.000500",
                        "start-up 70.00 s outside 33.00 .. 69.00 s for the 3 launch(es) on the books "
                        "(40.00 s measured)"]
    broken = final(50.0, 3)
    broken["goodput/tail_s"] = 1.0
    assert check_ledger(broken, launches, faults)[1] == ["the categories sum to 101.000 s, not the 100.000 s billed"]
    assert check_ledger({}, launches, faults)[1] == ["the run logged no goodput ledger (goodput/share, cost/billed_s)"]


def test_a_sigkill_drops_queued_losses_within_the_launchs_pace() -> None:
    """Seen in CI: the ledger counted 10 lost steps, the history 5 (the SIGKILL dropped MLflow's queued losses)."""
    launches = [launch(None, 20.0, 30.0), launch(25, 20.0, 24.0)]
    # losses every 100 ms up to step 9 at t = 0.9 s; killed at t = 1.4 s: at most 5 more steps ran
    logged = [(step, step * 100) for step in range(10)]
    assert unlogged_bound(logged, 1.4) == 5
    assert unlogged_bound(logged[:1], 1.4) is None  # one loss: no pace to go by
    assert unlogged_bound([(0, 0), (2, 2)], 0.5) == 498  # sub-millisecond steps: a millisecond a step
    killed = Fault(1, "sigkill", "r", "training", lost_steps=5, unlogged_max=5)
    record, problems = check_ledger(final(40.0, 10), launches, [killed])
    assert problems == [] and record["lost_steps"]["bounds"] == [4, 11]
    assert check_ledger(final(40.0, 12), launches, [killed])[1][0].startswith(
        "the ledger counts 12 lost steps, outside the faults' 4 .. 11")
    unknown = Fault(1, "sigkill", "r", "training", lost_steps=5, unlogged_max=None)
    assert check_ledger(final(40.0, 50), launches, [unknown])[1] == []  # no pace: no upper bound
    assert check_ledger(final(40.0, 3), launches, [unknown])[1][0].startswith(
        "the ledger counts 3 lost steps, outside the faults' 4 .. ?")
