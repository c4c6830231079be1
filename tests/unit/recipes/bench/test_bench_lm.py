"""The GPT recipe's benchmark (recipes.bench.lm): its step arithmetic, its ratios, and its usage errors."""

from __future__ import annotations

import math

import pytest

from recipes.bench import cli as bench
from recipes.bench import lm as bench_lm


def test_median_step_leaves_out_the_warm_up_steps() -> None:
    # intervals: 5 warm-up steps of 1 s each (left out), then 0.1, 0.3, 0.2 -> median 0.2
    ends = [float(i) for i in range(bench_lm.WARMUP_STEPS + 1)]
    last = ends[-1]
    ends += [last + 0.1, last + 0.4, last + 0.6]
    assert bench_lm._median_step_s(ends) == pytest.approx(0.2)
    assert math.isnan(bench_lm._median_step_s(ends[:bench_lm.WARMUP_STEPS + 1]))


def test_time_ratio_is_the_ratio_of_mean_times_and_its_interval_holds_it() -> None:
    recipe, plain = [1.1, 1.2, 1.3], [1.0, 1.0, 1.0]
    ratio, low, high = bench_lm._ratio(recipe, plain)
    assert ratio == pytest.approx(1.2)
    assert low <= ratio <= high
    assert (low, high) == pytest.approx((1.1, 1.3), abs=1e-9)  # 3 rounds: the extremes bound every resample


def test_equal_times_give_a_zero_width_interval_at_one() -> None:
    assert bench_lm._ratio([2.0, 2.0], [2.0, 2.0]) == pytest.approx((1.0, 1.0, 1.0))


@pytest.mark.parametrize(("args", "named"), [
    (["--steps", "6"], "--steps 6"),
    (["--rounds", "0"], "--rounds 0"),
    (["--ablate", "--pieces", "spot,nope"], "--pieces nope"),
])
def test_bad_settings_are_one_line_and_exit_2(args: list[str], named: str, capsys: pytest.CaptureFixture) -> None:
    assert bench.main(["lm", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {named}") and "\n" not in err


def test_every_piece_runs_between_two_full_runs_in_a_seeded_order() -> None:
    pieces = ["a", "b", "c", "d", "e"]
    order = bench_lm.bracketed_order(pieces, 3)
    assert order == bench_lm.bracketed_order(pieces, 3)  # seeded by the round: reproducible
    assert sorted(v for v in order if v != "full") == pieces and order[0] == order[-1] == "full"
    assert order.count("full") == 4  # full, 2 pieces, full, 2 pieces, full, 1 piece, full
    assert any(bench_lm.bracketed_order(pieces, i) != order for i in range(10))  # other rounds, other orders
    brackets = bench_lm.bracketing_fulls(["full", "a", "b", "full", "c", "full"])
    assert brackets == {"a": (0, 3), "b": (0, 3), "c": (3, 5)}
