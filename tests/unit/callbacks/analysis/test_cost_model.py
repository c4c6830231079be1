"""Cost arithmetic and the expected-time model, by hand and against Monte Carlo."""

from __future__ import annotations

import math

import numpy as np
import pytest

from callbacks.analysis.cost_model import (
    Expectation,
    expected_interruptions,
    expected_run,
    expected_segment_time,
    expected_wall_time,
    run_cost,
    savings_pct,
    segments,
    simulate,
    spot_cost_with_surcharge,
)


def test_run_cost_by_hand():
    assert run_cost(8, 3.0) == 24.0  # $3/h on-demand for 8 h
    assert run_cost(8, 3.0, instances=4) == 96.0
    assert run_cost(0, 3.0) == 0.0


def test_spot_surcharge_and_savings_by_hand():
    spot = spot_cost_with_surcharge(8, 0.90, 0.05)  # 0.90 * 8 * 1.05
    assert spot == pytest.approx(7.56, abs=1e-12)
    assert savings_pct(spot, run_cost(8, 3.0)) == pytest.approx(68.5, abs=1e-10)  # 1 - 7.56/24
    assert savings_pct(30.0, 24.0) == pytest.approx(-25.0, abs=1e-12)


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda: run_cost(-1, 3.0), "hours=-1"),
        (lambda: run_cost(1, -3.0), "price_per_hour=-3.0"),
        (lambda: run_cost(1, 3.0, instances=0), "instances=0"),
        (lambda: spot_cost_with_surcharge(8, 0.9, -0.05), "surcharge_frac=-0.05"),
        (lambda: savings_pct(1.0, 0.0), "on_demand_usd=0.0"),
        (lambda: expected_wall_time(0.0, 600, 30, 120, 3600), "work_s=0.0"),
        (lambda: expected_wall_time(3600, -5, 30, 120, 3600), "interval_s=-5"),
        (lambda: expected_wall_time(3600, 600, -30, 120, 3600), "save_cost_s=-30"),
        (lambda: expected_wall_time(3600, 600, 30, -1, 3600), "restart_s=-1"),
        (lambda: expected_wall_time(3600, 600, 30, 120, 0), "mtbf_s=0"),
        (lambda: simulate(3600, 600, 30, 120, 3600, trials=0), "trials=0"),
    ],
)
def test_bad_inputs_name_the_value(call, named):
    with pytest.raises(ValueError, match=named):
        call()


def test_segments():
    assert segments(30000, 1800) == (17, 1200.0)  # 16 x 1800 = 28800, 1200 left
    assert segments(3600, 1200) == (3, 1200.0)
    assert segments(0.3, 0.1) == (3, pytest.approx(0.1))  # 0.3/0.1 = 2.9999999999999996 counts as 3
    assert segments(100, math.inf) == (1, 100.0)
    assert segments(100, 500) == (1, 100.0)


def test_expected_wall_time_without_interruptions():
    # 17 segments, 16 saves of 60 s (the finished job writes no last checkpoint).
    assert expected_wall_time(30000, 1800, 60, 120, math.inf) == 30000 + 16 * 60
    assert expected_wall_time(30000, math.inf, 60, 120, math.inf) == 30000


def test_expected_wall_time_by_hand():
    # W = 3600, t = 1200, d = 60, R = 120, M = 7200: two segments of 1260 s, then 1200 s without a save.
    m, r = 7200.0, 120.0
    f_full = m * math.exp(r / m) * (math.exp(1260 / m) - 1)
    f_last = m * math.exp(r / m) * (math.exp(1200 / m) - 1)
    assert f_full == pytest.approx(1400.1146, abs=1e-3)
    assert expected_wall_time(3600, 1200, 60, r, m) == pytest.approx(2 * f_full + f_last, rel=1e-14)
    assert expected_wall_time(3600, 1200, 60, r, m) == pytest.approx(4127.97, abs=0.01)
    # One segment, no restart: the classic M (e^{W/M} - 1), e.g. W = M -> M (e - 1).
    assert expected_segment_time(1000.0, 0.0, 1000.0) == pytest.approx(1000 * (math.e - 1), rel=1e-14)
    assert expected_segment_time(1000.0, 0.0, math.inf) == 1000.0


def test_expected_interruptions_and_run():
    wall = expected_wall_time(3600, 1200, 60, 120, 7200)
    assert expected_interruptions(3600, 1200, 60, 120, 7200) == pytest.approx(wall / 7200, rel=1e-14)
    assert expected_interruptions(3600, 1200, 60, 120, math.inf) == 0.0
    exp = expected_run(3600, 1200, 60, 120, 7200, instances=4, price_per_hour=4.42)
    assert isinstance(exp, Expectation)
    assert exp.wall_s == wall
    assert exp.cost_usd == pytest.approx(wall / 3600 * 4 * 4.42, rel=1e-14)
    assert exp.interruptions == pytest.approx(wall / 7200, rel=1e-14)
    # On-demand, never interrupted: 1 h of work on 2 instances at $3/h with no checkpoints = $6.
    assert expected_run(3600, math.inf, 30, 120, math.inf, 2, 3.0) == Expectation(3600.0, 6.0, 0.0)


SETTINGS = [
    # work_s, interval_s, save_cost_s, restart_s, mtbf_s
    (36000, 1800, 60, 120, 7200),  # 10 h job, MTBF 2 h
    (10000, 700, 30, 300, 2000),  # frequent interruptions, long restarts
    (18000, 600, 100, 600, 1500),  # restarts as long as the MTBF/2.5: many struck restarts
    (50000, math.inf, 0, 0, 100000),  # no checkpoints at all: one segment of M(e^{W/M} - 1)
    (1000, 100, 10, 50, 100),  # MTBF about one segment
]


@pytest.mark.parametrize("setting", SETTINGS)
def test_simulation_agrees_with_formula(setting):
    sim = simulate(*setting, trials=20_000, seed=1234)
    wall = expected_wall_time(*setting)
    assert sim.trials == 20_000
    assert sim.mean_wall_s == pytest.approx(wall, rel=0.05)
    # the standard error is far smaller than 5%: check agreement at 4 standard errors too
    assert abs(sim.mean_wall_s - wall) < 4 * sim.std_wall_s / math.sqrt(sim.trials)
    assert sim.mean_interruptions == pytest.approx(wall / setting[4], rel=0.05)
    # lost work is part of the wall time beyond the uninterrupted run; all of it when nothing else costs time
    # (no checkpoints and no restart time: setting 3), so the bound is inclusive
    n, _ = segments(setting[0], setting[1])
    beyond = sim.mean_wall_s - setting[0] - (n - 1) * setting[2]
    assert 0 < sim.mean_lost_work_s <= beyond * (1 + 1e-12)
    if setting[2] == 0 and setting[3] == 0:
        assert sim.mean_lost_work_s == pytest.approx(beyond, rel=1e-12)


def _naive_run(rng: np.random.Generator, work_s, interval_s, save_s, restart_s, mtbf_s) -> float:
    """One run, event by event: independent of the vectorized simulator's tricks."""
    n, last = segments(work_s, interval_s)
    clock = 0.0
    next_failure = rng.exponential(mtbf_s)
    for i in range(n):
        length = last if i == n - 1 else interval_s + save_s
        need = length  # the first attempt follows a completed save: no restart
        while clock + need > next_failure:  # struck during the restart, the work or the save
            clock = next_failure
            next_failure = clock + rng.exponential(mtbf_s)
            need = restart_s + length
        clock += need
    return clock


@pytest.mark.parametrize("setting", [(7200, 900, 60, 300, 1800), (1000, 100, 10, 50, 100), SETTINGS[2]])
def test_naive_event_simulation_agrees_with_formula(setting):
    rng = np.random.default_rng(7)
    runs = np.array([_naive_run(rng, *setting) for _ in range(3000)])
    wall = expected_wall_time(*setting)
    assert runs.mean() == pytest.approx(wall, rel=0.05)
    assert abs(runs.mean() - wall) < 4 * runs.std(ddof=1) / math.sqrt(runs.size)


def test_simulation_without_interruptions_is_exact_and_seed_reproducible():
    sim = simulate(30000, 1800, 60, 120, math.inf, trials=10, seed=0)
    assert (sim.mean_wall_s, sim.std_wall_s, sim.mean_interruptions, sim.mean_lost_work_s) == (
        30960.0,
        0.0,
        0.0,
        0.0,
    )
    assert simulate(3600, 600, 30, 120, 1800, trials=500, seed=3) == simulate(
        3600, 600, 30, 120, 1800, trials=500, seed=3
    )
    assert simulate(3600, 600, 30, 120, 1800, trials=500, seed=3) != simulate(
        3600, 600, 30, 120, 1800, trials=500, seed=4
    )


_default_rng = np.random.default_rng


class _CountingGenerator:
    """A numpy Generator that records each draw's method and size."""

    def __init__(self, seed: int) -> None:
        self._rng = _default_rng(seed)
        self.draws: list[tuple[str, int]] = []

    def __getattr__(self, name: str):
        method = getattr(self._rng, name)

        def draw(*args, **kwargs):
            out = method(*args, **kwargs)
            self.draws.append((name, int(np.size(out))))
            return out

        return draw


@pytest.mark.parametrize("setting", [(36000, 1800, 60, 120, 7200), (1000, 100, 10, 50, 100)])
def test_simulation_draws_whole_arrays_not_one_run_at_a_time(setting, monkeypatch):
    """What makes 20,000 trials cheap, checked exactly (no wall clock): a handful of array draws, one per retry
    round; every retry is one exponential draw, so they add up to the interruptions counted."""
    made: list[_CountingGenerator] = []
    monkeypatch.setattr(np.random, "default_rng", lambda seed: made.append(_CountingGenerator(seed)) or made[-1])
    trials = 20_000
    sim = simulate(*setting, trials=trials, seed=0)
    (rng,) = made
    names = [name for name, _ in rng.draws]
    sizes = [size for _, size in rng.draws]
    assert names[:3] == ["binomial", "random", "random"] and set(names[3:]) == {"exponential"}
    assert sizes[:2] == [trials, trials]  # which full segments fail, whether the last one does: per run
    first_failures = sizes[2]
    retries = sizes[3:]
    assert retries[0] == first_failures and retries == sorted(retries, reverse=True) and retries[-1] > 0
    assert len(retries) < 100  # rounds: the longest streak of struck retries (seed 0: 9 and 52), not the runs
    assert sum(retries) == round(sim.mean_interruptions * trials)  # every interruption is one retry drawn
    assert sim.trials == trials
