"""The GPT recipe's benchmark (recipes.bench.lm): its step arithmetic, its ratios, and its usage errors."""

from __future__ import annotations

import collections
import itertools
import math

import pytest

from recipes.bench import lm as bench_lm
from recipes.bench import subcommands as bench


def test_median_step_leaves_out_the_warm_up_steps() -> None:
    # intervals: 5 warm-up steps of 1 s each (left out), then 0.1, 0.3, 0.2 -> median 0.2
    ends = [float(i) for i in range(bench_lm.WARMUP_STEPS + 1)]
    last = ends[-1]
    ends += [last + 0.1, last + 0.4, last + 0.6]
    assert bench_lm._median_step_s(ends) == pytest.approx(0.2)
    assert math.isnan(bench_lm._median_step_s(ends[:bench_lm.WARMUP_STEPS + 1]))


@pytest.mark.parametrize("variants", [["torch", "lightning", "recipe"], ["lightning", "recipe"]])
def test_every_variant_runs_in_every_place_equally_often(variants: list[str]) -> None:
    # a fixed order (torch, lightning, recipe, then reversed) kept plain Lightning always in the middle: the
    # machine's drift within a round then fell on the recipe's runs alone
    rounds = [bench_lm.round_order(variants, index) for index in range(2 * math.factorial(len(variants)))]
    assert all(sorted(order) == sorted(variants) for order in rounds)
    for place in range(len(variants)):
        assert collections.Counter(order[place] for order in rounds) == {v: len(rounds) // len(variants)
                                                                         for v in variants}
    assert all(a != b for a, b in itertools.pairwise(rounds))  # the order changes every round


@pytest.mark.parametrize(("args", "named"), [
    (["--steps", "6"], "--steps 6"),
    (["--rounds", "0"], "--rounds 0"),
    (["--ablate", "--pieces", "spot,nope"], "--pieces nope"),
    (["--variants", "torch,recipe"], "--variants torch,recipe"),
    (["--variants", "lightning,recipe,fast"], "--variants lightning,recipe,fast"),
])
def test_bad_settings_are_one_line_and_exit_2(args: list[str], named: str, capsys: pytest.CaptureFixture) -> None:
    assert bench.main(["lm", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {named}") and "\n" not in err


