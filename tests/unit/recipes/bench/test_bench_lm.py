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


@pytest.mark.parametrize(("args", "named"), [
    (["--steps", "6"], "--steps 6"),
    (["--rounds", "0"], "--rounds 0"),
    (["--ablate", "--pieces", "spot,nope"], "--pieces nope"),
])
def test_bad_settings_are_one_line_and_exit_2(args: list[str], named: str, capsys: pytest.CaptureFixture) -> None:
    assert bench.main(["lm", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {named}") and "\n" not in err


