"""callbacks.analysis.batch_size: McCandlish et al. 2018's steps/examples trade-off, by hand."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from callbacks.analysis.batch_size import (
    diminishing_returns,
    examples_to_target,
    fit_step_time,
    optimal_batch_linear,
    plan_batches,
    s_min_from_reference,
    step_saving_from_doubling,
    steps_to_target,
)


def test_steps_and_examples_by_hand():
    # S(B) = S_min (1 + B_noise / B): 100 (1 + 64/64) = 200; 100 (1 + 64/16) = 500
    assert steps_to_target(64, b_noise=64, s_min=100) == 200.0
    assert steps_to_target(16, b_noise=64, s_min=100) == 500.0
    # E(B) = E_min (1 + B / B_noise): 6400 (1 + 64/64) = 12800; 6400 (1 + 256/64) = 32000
    assert examples_to_target(64, b_noise=64, e_min=6400) == 12800.0
    assert examples_to_target(256, b_noise=64, e_min=6400) == 32000.0
    # the two laws agree: S(B) x B = E(B) when E_min = S_min x B_noise
    for b in (1, 7, 64, 1000):
        assert steps_to_target(b, 64, 100) * b == pytest.approx(examples_to_target(b, 64, 6400), rel=1e-12)


def test_s_min_from_a_reference_run():
    # 300 steps at batch 32 with B_noise 64: S_min = 300 / (1 + 2) = 100, and it gives back the 300
    assert s_min_from_reference(steps=300, batch=32, b_noise=64) == 100.0
    assert steps_to_target(32, 64, s_min_from_reference(300, 32, 64)) == 300.0


def test_diminishing_returns_threshold():
    # doubling saves B_noise / (2 (B + B_noise)): 1/2 -> 0.5 as B -> 0, 0.25 at B = B_noise, 0.1 at 4 B_noise
    assert step_saving_from_doubling(100, 100) == 0.25
    assert step_saving_from_doubling(400, 100) == pytest.approx(0.1, abs=1e-15)
    assert step_saving_from_doubling(1e-9, 100) == pytest.approx(0.5)
    assert not diminishing_returns(400, 100) and diminishing_returns(401, 100)
    assert diminishing_returns(201, 100, factor=2)


def test_optimal_batch_linear_by_hand():
    # B* = sqrt(B_noise t0 / c) = sqrt(100 x 0.01 / 1e-4) = 100
    assert optimal_batch_linear(b_noise=100, t0=0.01, per_example_s=1e-4) == 100.0
    assert optimal_batch_linear(400, 0.01, 1e-4) == 200.0


def test_fit_step_time_recovers_a_line():
    m = fit_step_time([32, 64, 128], [0.0132, 0.0164, 0.0228])
    assert m.t0 == pytest.approx(0.01, abs=1e-12) and m.per_example_s == pytest.approx(1e-4, rel=1e-9)
    assert m.max_rel_error < 1e-9 and m(256) == pytest.approx(0.0356)
    one = fit_step_time([32], [0.02])  # one point: all fixed cost
    assert (one.t0, one.per_example_s) == (0.02, 0.0)
    # negative slope in noisy data: NNLS keeps both terms >= 0
    flat = fit_step_time([32, 64], [0.02, 0.019])
    assert flat.per_example_s >= 0 and flat.t0 > 0


def test_plan_by_hand_one_and_two_devices():
    """B_noise 100, S_min 100, t(b) = 10 ms + 0.1 ms x b, $3.60/h per device, 1 ms of comm on 2 devices."""
    model = fit_step_time([50, 100], [0.015, 0.02])
    plan = plan_batches(100, 100, [50, 100, 200, 400], model, devices=[1, 2, 4], comm_s=lambda n: 0.001,
                        price_per_instance_h=3.6, devices_per_instance=1)
    rows = {(r.batch, r.devices): r for r in plan.rows}
    # N=1: S = 300, 200, 150, 125; t = 15, 20, 30, 50 ms; wall = 4.5, 4.0, 4.5, 6.25 s; $ = wall / 1000
    for b, steps, wall in ((50, 300, 4.5), (100, 200, 4.0), (200, 150, 4.5), (400, 125, 6.25)):
        r = rows[(b, 1)]
        assert (r.steps, r.wall_s, r.instances) == pytest.approx((steps, wall, 1))
        assert r.cost_usd == pytest.approx(wall / 1000)
        assert r.examples == pytest.approx(steps * b)
    # N=2, B=200: t = 10 + 0.1 x 100 + 1 = 21 ms, x 150 = 3.15 s on 2 devices: $0.0063
    r = rows[(200, 2)]
    assert (r.step_s, r.wall_s, r.cost_usd) == pytest.approx((0.021, 3.15, 0.0063))
    assert rows[(100, 2)].wall_s == pytest.approx(200 * 0.016)
    # N=4: B=200 -> 10 + 5 + 1 = 16 ms x 150 = 2.4 s (B=100: 13.5 ms x 200 = 2.7 s; B=400: 21 ms x 125 = 2.625 s)
    assert rows[(200, 4)].wall_s == pytest.approx(2.4) and rows[(400, 4)].wall_s == pytest.approx(2.625)
    assert (plan.fastest.batch, plan.fastest.devices) == (200, 4)  # more devices: the fastest batch moves up
    assert (plan.cheapest.batch, plan.cheapest.devices) == (100, 1)  # B* = sqrt(100 x 0.01 / 1e-4) = 100
    assert (50, 4, "batch 50 does not split evenly over 4 devices") in plan.skipped
    assert not rows[(400, 1)].diminishing and rows[(400, 1)].steps_over_min == 1.25
    assert rows[(50, 1)].examples_over_min == 1.5 and rows[(50, 1)].doubling_saves == pytest.approx(1 / 3)


def test_larger_noise_scale_moves_the_best_batch_up():
    """The theory: B* = sqrt(B_noise t0 / c) grows with B_noise; the planner's pick follows on a grid."""
    model = fit_step_time([32, 64], [0.0132, 0.0164])  # t0 = 10 ms, c = 0.1 ms
    grid = [2**k for k in range(3, 13)]
    picks = [plan_batches(b_noise, 50, grid, model).fastest.batch for b_noise in (25, 100, 400, 1600)]
    assert picks == [64, 128, 256, 512]  # B* = 50, 100, 200, 400, each rounded to its best power of two
    cheapest = [plan_batches(b, 50, grid, model, price_per_instance_h=1.0).cheapest.batch for b in (25, 100, 400, 1600)]
    assert cheapest == picks  # one device: cost is proportional to time


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"b_noise": 0}, "b_noise=0"), ({"s_min": float("nan")}, "s_min=nan"), ({"batches": [0]}, "batch 0"),
    ({"devices": []}, "device count list is empty"), ({"price_per_instance_h": -1}, "price per instance-hour -1"),
])
def test_plan_rejects_bad_values(kwargs, needle):
    args = {"b_noise": 10, "s_min": 10, "batches": [8], "step_time": lambda b: 0.01} | kwargs
    with pytest.raises(ValueError, match=re.escape(needle)):
        plan_batches(**args)


def test_module_is_pure():
    """numpy and scipy only: importing it pulls in neither torch nor Lightning."""
    code = ("import sys, callbacks.analysis.batch_size; "
            "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert math.isfinite(steps_to_target(1, 1, 1))
