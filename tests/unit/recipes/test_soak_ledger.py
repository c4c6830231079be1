"""The soak's ledger check (recipes/soak/ledger.py): launches on the books, and the tolerances, by hand."""

from __future__ import annotations

from recipes.soak.faults import Fault
from recipes.soak.launch import Launch
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
    assert record["lost_steps"] == {"ledger": 4, "faults": 3}  # one step a fault allowed
    _, problems = check_ledger(final(70.0, 6), launches, faults)
    assert problems == ["the ledger counts 6 lost steps, the faults 3 (allowed: 1 a fault)",
                        "redone $0.0030 against the faults' 3 steps x $0.000500",
                        "start-up 70.00 s outside 33.00 .. 69.00 s for the 3 launch(es) on the books "
                        "(40.00 s measured)"]
    broken = final(50.0, 3)
    broken["goodput/tail_s"] = 1.0
    assert check_ledger(broken, launches, faults)[1] == ["the categories sum to 101.000 s, not the 100.000 s billed"]
    assert check_ledger({}, launches, faults)[1] == ["the run logged no goodput ledger (goodput/share, cost/billed_s)"]
