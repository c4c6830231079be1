"""The goodput ledger's arithmetic, by hand-computed values."""

from __future__ import annotations

import pytest

from callbacks.analysis import goodput
from callbacks.analysis.goodput import CATEGORIES, Ledger


def test_categories_sum_and_share() -> None:
    ledger = Ledger()
    ledger.add("productive", 90.0)
    ledger.add("startup", 6.0)
    ledger.add("startup", 4.0)
    assert ledger.total_s() == 100.0
    assert ledger.share() == 0.9
    assert Ledger().share() == 0.0


def test_instances_price_each_category() -> None:
    ledger = Ledger()
    ledger.add("productive", 3600.0, instances=2)  # 1 h on 2 instances
    ledger.add("restart", 1800.0)                   # 0.5 h on 1
    usd = goodput.priced(ledger, 4.0)
    assert (usd["productive"], usd["restart"], usd["startup"]) == (8.0, 2.0, 0.0)
    assert set(usd) == set(CATEGORIES)


def test_split_gap_and_charge_redone_by_hand() -> None:
    # a 100 s gap on 2 instances, 5 s of it from the relaunch's spawn to its clock
    gap = goodput.split_gap(100.0, spawn_s=5.0, instances=2)
    assert gap.seconds == {"startup": 5.0, "restart": 95.0}
    assert gap.instance_s == {"startup": 10.0, "restart": 190.0}
    assert goodput.split_gap(3.0, spawn_s=5.0).seconds == {"startup": 3.0, "restart": 0.0}
    # 10 steps lost at 2 s: their first runs, 20 s, move out of the gap
    charged = goodput.charge_redone(gap, 10, 2.0)
    assert charged.seconds == {"startup": 5.0, "restart": 75.0, "redone": 20.0}
    assert charged.instance_s == {"startup": 10.0, "restart": 150.0, "redone": 40.0}
    # the gap is all there is to move (a fixed restart_s may bill less than was lost); no mean step: nothing
    assert goodput.charge_redone(goodput.split_gap(3.0), 10, 2.0).seconds == {"startup": 0.0, "restart": 0.0,
                                                                           "redone": 3.0}
    assert goodput.charge_redone(gap, 4, None).seconds == gap.seconds


def test_first_steps_charged_at_the_mean() -> None:
    ledger = Ledger()
    ledger.add("productive", 9.0)
    # a 0.5 s first step at a 0.1 s mean: 0.1 s productive, 0.4 s start-up; a rerun first step of 0.05 s: whole
    out = goodput.resolve_first_steps(ledger, [("productive", 0.5, 0.5), ("redone", 0.05, 0.1)], 0.1)
    assert out.seconds == pytest.approx({"productive": 9.1, "startup": 0.4, "redone": 0.05})
    assert out.instance_s["redone"] == pytest.approx(0.1)  # the launch ran on 2 instances
    assert out.total_s() == pytest.approx(9.55)
    assert ledger.seconds == {"productive": 9.0}  # the input is left alone
    assert goodput.resolve_first_steps(ledger, [("productive", 0.5, 0.5)], None).seconds == {
        "productive": 9.5, "startup": 0.0}


def test_carve_comm() -> None:
    ledger = Ledger()
    ledger.add("productive", 100.0, instances=2)
    out = goodput.carve_comm(ledger, 0.05)
    assert out.seconds == {"productive": 95.0, "comm_exposed": 5.0}
    assert out.instance_s == {"productive": 190.0, "comm_exposed": 10.0}


def test_metrics_keys_and_largest_badputs() -> None:
    ledger = Ledger()
    for category, seconds in (("productive", 720.0), ("startup", 36.0), ("redone", 72.0), ("tail", 3.6),
                              ("checkpoint", 36.0)):
        ledger.add(category, seconds)
    out = goodput.metrics(ledger, 10.0)  # $10 per hour: 36 s = $0.10
    assert out["goodput/startup_usd"] == pytest.approx(0.1)
    assert out["goodput/redone_usd"] == pytest.approx(0.2)
    assert out["goodput/share"] == pytest.approx(720 / 867.6)
    assert set(out) == {f"goodput/{c}_{u}" for c in CATEGORIES for u in ("s", "usd")} | {"goodput/share"}
    usd = goodput.priced(ledger, 10.0)
    # ties (start-up and checkpoint at $0.10) in the categories' order
    assert goodput.largest_badputs(usd) == [("redone", pytest.approx(0.2)), ("startup", pytest.approx(0.1)),
                                            ("checkpoint", pytest.approx(0.1))]


def test_state_round_trip_and_unattributed() -> None:
    ledger = Ledger()
    ledger.add("validation", 2.0, 3)
    ledger.add("unattributed", 5.0)
    again = Ledger.from_state(ledger.state())
    assert again == ledger
    assert goodput.metrics(again, 3600.0)["goodput/unattributed_usd"] == 5.0


def test_check_sum() -> None:
    ledger = Ledger()
    ledger.add("productive", 99.95)
    assert goodput.check_sum(ledger, 100.0) == pytest.approx(5e-4)
    with pytest.raises(ValueError, match=r"sum to 99\.950000 s, not the 101\.000000 s billed"):
        goodput.check_sum(ledger, 101.0)


@pytest.mark.parametrize(("call", "named"), [
    (lambda: Ledger().add("lunch", 1.0), "goodput category 'lunch'"),
    (lambda: Ledger().add("startup", -1.0), "startup=-1.0"),
    (lambda: Ledger().add("startup", float("nan")), "startup=nan"),
    (lambda: goodput.charge_redone(Ledger(), -1, 1.0), "lost_steps=-1"),
    (lambda: goodput.split_gap(-1.0), "gap_s=-1.0"),
    (lambda: goodput.carve_comm(Ledger(), 1.5), "comm_share=1.5"),
    (lambda: goodput.priced(Ledger(), -2.0), "usd_per_instance_h=-2.0"),
])
def test_bad_input_names_the_value(call, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(".", r"\.")):
        call()
