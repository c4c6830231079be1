"""Checkpoint-interval formulas against hand-computed and published values (DESIGN.md, formulas)."""

from __future__ import annotations

import math

import pytest

from callbacks.analysis.ckpt_interval import (
    IntervalChoice,
    choose_interval,
    daly_interval,
    expected_overhead,
    interval_mismatch,
    mtbf_from_rate,
    young_interval,
)

MIN = 60.0
HOUR = 3600.0


def test_young_by_hand():
    # sqrt(2 * 300 s * 86400 s) = sqrt(51,840,000) = 7200 s exactly.
    assert young_interval(300.0, 86400.0) == pytest.approx(7200.0, rel=1e-15)
    # sqrt(2 * 30 * 15) = 30.
    assert young_interval(30.0, 15.0) == pytest.approx(30.0, rel=1e-15)
    assert young_interval(30.0, math.inf) == math.inf


@pytest.mark.parametrize(
    ("mtbf_s", "expected_min", "digits"),
    [(24 * HOUR, 116.7, 1), (6 * HOUR, 56.7, 1), (15 * MIN, 9.14, 2)],
)
def test_daly_published_cases(mtbf_s, expected_min, digits):
    """Daly (2006), d = 5 min: M = 24 h -> 116.7 min, 6 h -> 56.7 min, 15 min -> 9.14 min."""
    assert round(daly_interval(5 * MIN, mtbf_s) / MIN, digits) == expected_min


def test_daly_by_hand_and_limits():
    # d = 5, M = 15 (minutes): x = 1/6; sqrt(150) (1 + sqrt(1/6)/3 + 1/54) - 5.
    x = 1.0 / 6.0
    assert daly_interval(5.0, 15.0) == pytest.approx(math.sqrt(150.0) * (1 + math.sqrt(x) / 3 + x / 9) - 5.0)
    # d >= 2M: the interval is M.
    assert daly_interval(100.0, 50.0) == 50.0
    assert daly_interval(100.0, 40.0) == 40.0
    assert daly_interval(30.0, math.inf) == math.inf


def test_mtbf_from_rate_by_hand():
    # 5% per hour: lambda = -ln(0.95)/3600 s = 0.0512932943875505 / 3600 s -> M = 70184.61 s = 19.496 h.
    m = mtbf_from_rate(0.05, HOUR)
    assert m == pytest.approx(HOUR / 0.0512932943875505, rel=1e-12)
    assert m == pytest.approx(70184.6127, abs=1e-3)
    # 8 instances in one synchronous job: M / 8.
    assert mtbf_from_rate(0.05, HOUR, instances=8) == pytest.approx(70184.6127 / 8, abs=1e-3)
    # 50% per 10 minutes: -ln 0.5 = 0.693147 -> M = 600 / 0.693147 = 865.617 s.
    assert mtbf_from_rate(0.5, 600.0) == pytest.approx(865.6170245, abs=1e-6)
    assert mtbf_from_rate(0.0, HOUR, instances=64) == math.inf


@pytest.mark.parametrize("p", [1.0, -0.1, 1.5, math.nan])
def test_mtbf_from_rate_rejects_rate_outside_unit_interval(p):
    with pytest.raises(ValueError, match=rf"p={p!r}"):
        mtbf_from_rate(p, HOUR)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"period_s": 0.0}, "period_s=0.0"), ({"period_s": HOUR, "instances": 0}, "instances=0")],
)
def test_mtbf_from_rate_rejects_bad_period_and_instances(kwargs, named):
    with pytest.raises(ValueError, match=named):
        mtbf_from_rate(0.05, **kwargs)


def test_young_daly_reject_bad_values():
    with pytest.raises(ValueError, match=r"save_cost_s=-1\.0"):
        young_interval(-1.0, 100.0)
    with pytest.raises(ValueError, match=r"mtbf_s=0\.0"):
        daly_interval(10.0, 0.0)


def test_overhead_by_hand_and_at_young_optimum():
    # d = 300, M = 86400, R = 600, t = 7200 (Young): 300/7200 + 7200/172800 + 600/86400 = 13/144.
    assert expected_overhead(7200.0, 300.0, 86400.0, 600.0) == pytest.approx(13 / 144, rel=1e-14)
    # ... which is sqrt(2d/M) + R/M = sqrt(600/86400) + 600/86400 = 1/12 + 1/144.
    assert expected_overhead(7200.0, 300.0, 86400.0, 600.0) == pytest.approx(1 / 12 + 1 / 144, rel=1e-14)
    # No interruptions: only the saves, d/t.
    assert expected_overhead(600.0, 30.0, math.inf, 120.0) == pytest.approx(0.05, rel=1e-15)


def test_interval_mismatch():
    assert interval_mismatch(600.0, 1200.0) == 2.0
    assert interval_mismatch(1200.0, 600.0) == 2.0
    assert interval_mismatch(900.0, 900.0) == 1.0
    assert interval_mismatch(math.inf, math.inf) == 1.0
    assert interval_mismatch(600.0, math.inf) == math.inf
    with pytest.raises(ValueError, match=r"chosen_s=0"):
        interval_mismatch(0, 600.0)


def test_choose_interval():
    choice = choose_interval(300.0, 0.05, HOUR, instances=4, restart_s=120.0)
    m = HOUR / (-math.log(0.95)) / 4
    assert isinstance(choice, IntervalChoice)
    assert choice.mtbf_s == pytest.approx(m, rel=1e-12)
    assert choice.young_s == pytest.approx(math.sqrt(2 * 300.0 * m), rel=1e-12)
    assert choice.daly_s == pytest.approx(daly_interval(300.0, m), rel=1e-12)
    t = choice.daly_s
    assert choice.overhead == pytest.approx(300.0 / t + t / (2 * m) + 120.0 / m, rel=1e-12)
    never = choose_interval(300.0, 0.0)
    assert (never.young_s, never.daly_s, never.mtbf_s, never.overhead) == (math.inf, math.inf, math.inf, 0.0)


def test_overhead_check_by_hand() -> None:
    from callbacks.analysis.ckpt_interval import daly_interval, overhead_check

    # 3600 s productive, 10 saves of 2 s, 2 interruptions each losing 90 s of steps and 60 s of restart, 3900 s billed
    check = overhead_check(3600.0, 20.0, 180.0, 120.0, saves=10, interruptions=2, billed_s=3900.0)
    assert check.realized == pytest.approx(320 / 3600)                       # 8.9 %
    assert (check.save_cost_s, check.interval_s, check.mtbf_s, check.restart_s) == (2.0, 360.0, 1950.0, 60.0)
    assert check.predicted == pytest.approx(2 / 360 + 360 / 3900 + 60 / 1950)  # 12.9 %
    assert check.optimum_interval_s == pytest.approx(daly_interval(2.0, 1950.0))
    assert check.seed == pytest.approx(2 / (3900 / 3600) * (150 / 3600))       # 7.7 %
    quiet = overhead_check(100.0, 1.0, 0.0, 0.0, saves=4, interruptions=0, billed_s=110.0)
    assert (quiet.realized, quiet.predicted, quiet.seed) == (0.01, pytest.approx(1 / 100), 0.0)
    with pytest.raises(ValueError, match=r"productive_s=0\.0"):
        overhead_check(0.0, 1.0, 0.0, 0.0, saves=1, interruptions=0, billed_s=1.0)
    with pytest.raises(ValueError, match="saves=-1"):
        overhead_check(1.0, 1.0, 0.0, 0.0, saves=-1, interruptions=0, billed_s=1.0)
