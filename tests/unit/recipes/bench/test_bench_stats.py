"""recipes.bench.stats: the throughput window, the bootstrap intervals and the verdicts, by hand."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest

from recipes.bench import stats
from recipes.bench.stats import (
    bootstrap_ci,
    bootstrap_ratio_ci,
    ci_settled,
    effective_stall_ci,
    verdict,
    verdict_at_most,
    window_throughput,
)

REPO = Path(__file__).resolve().parents[4]


def test_window_throughput_by_hand() -> None:
    # steps end at 1.0, 1.1, 1.3, 1.6, 2.0 s; warm-up 2 -> 3 steps of 256 samples between 1.1 and 2.0 s
    ends = [1.0, 1.1, 1.3, 1.6, 2.0]
    assert window_throughput(ends, 256, warmup=2) == pytest.approx(3 * 256 / 0.9, rel=1e-12)
    assert window_throughput(ends, 256, warmup=1) == pytest.approx(4 * 256 / 1.0, rel=1e-12)
    with pytest.raises(ValueError, match="warmup=0"):
        window_throughput(ends, 256, warmup=0)
    with pytest.raises(ValueError, match="more than 5 steps"):
        window_throughput(ends, 256, warmup=5)
    with pytest.raises(ValueError, match="did not advance"):
        window_throughput([1.0, 1.0], 8, warmup=1)


def test_bootstrap_ci_resamples_round_indices() -> None:
    seen: list[np.ndarray] = []

    def mean_index(picks: np.ndarray) -> float:
        seen.append(picks)
        return float(np.mean(picks))

    # two rounds: a resample is 00 (mean 0), 01 or 10 (0.5) or 11 (1), with chances 1/4, 1/2, 1/4; of 2000
    # resamples ~500 are 00 and ~500 are 11, so the 2.5 % and 97.5 % quantiles fall among them: 0 and 1
    assert bootstrap_ci(2, mean_index, resamples=2000) == (0.0, 1.0)
    assert all(picks.shape == (2,) and set(picks.tolist()) <= {0, 1} for picks in seen)
    # ... and the 30 % and 70 % quantiles among the ~1000 resamples of mean 0.5
    assert bootstrap_ci(2, mean_index, level=0.4) == (0.5, 0.5)
    # one round resamples only to itself; a statistic that ignores the picks gives a zero-width interval
    assert bootstrap_ci(1, lambda picks: 7.0 + float(picks.sum())) == (7.0, 7.0)
    assert bootstrap_ci(5, lambda picks: 3.0) == (3.0, 3.0)
    # the seed fixes the draws
    spread = [0.3, 1.9, 0.7, 2.4, 1.1]
    stat = lambda picks: float(np.take(spread, picks).mean())  # noqa: E731
    assert bootstrap_ci(5, stat, seed=4) == bootstrap_ci(5, stat, seed=4)
    low, high = bootstrap_ci(5, stat, seed=4)
    assert min(spread) <= low < float(np.mean(spread)) < high <= max(spread)
    with pytest.raises(ValueError, match="at least one round"):
        bootstrap_ci(0, stat)


def test_bootstrap_ratio_ci_by_hand() -> None:
    # identical ratios in every round: the interval is the point
    assert bootstrap_ratio_ci([2.0, 2.0, 2.0], [1.0, 1.0, 1.0]) == (2.0, 2.0, 2.0)
    # two rounds of ratio 1 and 3: a resample's ratio is 1 (00), 2 (01, 10) or 3 (11), with chances 1/4, 1/2,
    # 1/4, so the 95 % interval runs from 1 to 3 and the 40 % one (30 % to 70 % quantiles) is the point 2
    assert bootstrap_ratio_ci([1.0, 3.0], [1.0, 1.0]) == (2.0, 1.0, 3.0)
    assert bootstrap_ratio_ci([1.0, 3.0], [1.0, 1.0], level=0.4) == (2.0, 2.0, 2.0)
    # pairs stay together: rounds (3, 1) and (3, 3) give ratios 3 (00), 6/4 (01, 10) and 1 (11)
    assert bootstrap_ratio_ci([3.0, 3.0], [1.0, 3.0]) == (1.5, 1.0, 3.0)
    # one round: the point
    assert bootstrap_ratio_ci([3.0], [2.0]) == (1.5, 1.5, 1.5)
    # the same seed gives the same interval, and it holds the point estimate
    a = bootstrap_ratio_ci([100.0, 110.0, 105.0, 98.0], [100.0, 100.0, 104.0, 99.0], seed=3)
    assert a == bootstrap_ratio_ci([100.0, 110.0, 105.0, 98.0], [100.0, 100.0, 104.0, 99.0], seed=3)
    assert a[0] == pytest.approx(413 / 403, rel=1e-12) and a[1] <= a[0] <= a[2]
    with pytest.raises(ValueError, match="paired"):
        bootstrap_ratio_ci([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="> 0"):
        bootstrap_ratio_ci([1.0, 0.0], [1.0, 1.0])


def test_effective_stall_ci_by_hand() -> None:
    # per save: sync (6.0 - 5.1) / 3 = 0.3 and (7.2 - 5.0) / 2 = 1.1; async (5.4 - 5.1) / 3 = 0.1 and 5.0 - 5.0 = 0
    ratio, low, high = effective_stall_ci([5.1, 5.0], [6.0, 7.2], [5.4, 5.0], [3, 2])
    assert ratio == pytest.approx(0.1 / 1.4)
    # resamples: round 0 twice 0.1/0.3 = 1/3 (chance 1/4), both 0.1/1.4 (1/2), round 1 twice 0 (1/4): 95 % from 0 to 1/3
    assert (low, high) == (pytest.approx(0.0), pytest.approx(1 / 3))
    # an async round faster than the one without saves stays in (noise): a negative stall
    assert effective_stall_ci([5.0, 5.0], [6.0, 6.0], [4.9, 5.1], [1, 1], resamples=10)[0] == pytest.approx(0.0)
    # a resample of only rounds whose sync saves did not slow the loop has an infinite ratio, and the interval keeps it
    assert effective_stall_ci([5.0, 5.0], [6.0, 4.9], [5.5, 5.0], [1, 1])[1:] == (pytest.approx(0.5), math.inf)
    # saves too small to slow the loop: nothing to compare
    assert all(math.isnan(v) for v in effective_stall_ci([5.0], [4.9], [5.0], [1]))
    with pytest.raises(ValueError, match="equal, non-empty"):
        effective_stall_ci([5.0], [6.0, 6.0], [5.0], [1])
    with pytest.raises(ValueError, match="needs a save"):
        effective_stall_ci([5.0], [6.0], [5.0], [0])


def test_verdict_for_a_figure_that_must_stay_at_or_below_its_goal() -> None:
    assert verdict_at_most(0.00, 0.08, goal=0.10) == "met"  # the whole interval below, however wide
    assert verdict_at_most(0.05, 0.10, goal=0.10) == "met"  # on the goal counts as met
    assert verdict_at_most(0.11, 0.26, goal=0.10) == "missed"
    assert verdict_at_most(0.06, 0.14, goal=0.10) == "inconclusive"
    assert verdict_at_most(math.nan, math.nan, goal=0.10) == "inconclusive"


def test_verdict_and_settling() -> None:
    assert verdict(0.992, 0.998, goal=0.99, margin=0.01) == "met"
    assert verdict(0.990, 0.995, goal=0.99, margin=0.01) == "met"  # on the goal counts as met
    assert verdict(0.950, 0.958, goal=0.99, margin=0.01) == "missed"
    assert verdict(0.985, 0.994, goal=0.99, margin=0.01) == "inconclusive"  # straddles the goal
    assert verdict(0.995, 1.030, goal=0.99, margin=0.01) == "inconclusive"  # wider than the margin
    assert verdict(0.613, 0.691, goal=1 / 1.15, margin=0.05) == "missed"  # wide, but wholly below the goal
    assert ci_settled(0.990, 0.9999, 0.01) and not ci_settled(0.98, 0.99, 0.01)


def _project_imports(module: str, seen: set[str] | None = None) -> set[str]:
    """Every project module ``module`` imports, at any depth and anywhere in its code (functions included)."""
    seen = set() if seen is None else seen
    path = REPO / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = REPO / module.replace(".", "/") / "__init__.py"
    if module in seen or not path.exists():
        return seen
    seen.add(module)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in ("recipes", "callbacks", "datamodules"):
                _project_imports(name, seen)
    return seen


def test_the_gpu_bench_and_the_shared_modules_do_not_import_the_cpu_bench() -> None:
    # recipes.bench.subcommands imports every benchmark for its subcommands; nothing they import imports it back
    for module in ("recipes.bench.gpu", "recipes.bench.lm", "recipes.bench.runs", "recipes.bench.stats"):
        assert "recipes.bench.subcommands" not in _project_imports(module), module
    # the walk sees imports inside functions
    assert "recipes.bench.gpu" in _project_imports("recipes.bench.subcommands")


def test_every_piece_runs_between_two_full_runs_in_a_seeded_order() -> None:
    pieces = ["a", "b", "c", "d", "e"]
    order = stats.bracketed_order(pieces, 3)
    assert order == stats.bracketed_order(pieces, 3)  # seeded by the round: reproducible
    assert sorted(v for v in order if v != "full") == pieces and order[0] == order[-1] == "full"
    assert order.count("full") == 4  # full, 2 pieces, full, 2 pieces, full, 1 piece, full
    assert any(stats.bracketed_order(pieces, i) != order for i in range(10))  # other rounds, other orders
    brackets = stats.bracketing_fulls(["full", "a", "b", "full", "c", "full"])
    assert brackets == {"a": (0, 3), "b": (0, 3), "c": (3, 5)}


def test_bracketed_rounds_pair_each_run_with_the_full_runs_beside_it() -> None:
    calls: list[tuple[str, int]] = []

    def run(variant: str, index: int) -> dict[str, float]:  # a machine that slows by 1 s with every run
        calls.append((variant, index))
        return {"t": float(len(calls))}

    runs, beside = stats.bracketed_rounds(["a", "b", "c"], 2, run)
    # round 0: full a c full b full (runs 1-6); round 1: full b c full a full (runs 7-12)
    assert calls == [("full", 0), ("a", 0), ("c", 0), ("full", 0), ("b", 0), ("full", 0),
                     ("full", 1), ("b", 1), ("c", 1), ("full", 1), ("a", 1), ("full", 1)]
    assert {v: [r["t"] for r in rs] for v, rs in runs.items()} == {
        "full": [1, 4, 6, 7, 10, 12], "a": [2, 11], "b": [5, 8], "c": [3, 9]}
    assert {p: [r["t"] for r in rs] for p, rs in beside.items()} == {
        "a": [2.5, 11.0], "b": [5.0, 8.5], "c": [2.5, 8.5]}


def test_time_ratio_is_the_ratio_of_mean_times_and_its_interval_holds_it() -> None:
    recipe, plain = [1.1, 1.2, 1.3], [1.0, 1.0, 1.0]
    ratio, low, high = stats.time_ratio_ci(recipe, plain)
    assert ratio == pytest.approx(1.2)
    assert low <= ratio <= high
    assert (low, high) == pytest.approx((1.1, 1.3), abs=1e-9)  # 3 rounds: the extremes bound every resample


def test_equal_times_give_a_zero_width_interval_at_one() -> None:
    assert stats.time_ratio_ci([2.0, 2.0], [2.0, 2.0]) == pytest.approx((1.0, 1.0, 1.0))


def test_median_ratio_and_spread_by_hand() -> None:
    from recipes.bench.stats import median_ratio, spread

    # medians 9.0 and 6.19 (the rounds): 1.454...x, where the best rounds gave 6.6 / 5.91 = 1.117x
    recipe, plain = [7.7, 9.2, 9.0, 6.6, 9.2], [6.16, 6.19, 7.81, 6.94, 5.91]
    assert median_ratio(recipe, plain) == pytest.approx(9.0 / 6.19, rel=1e-12)
    assert spread(recipe) == pytest.approx(9.2 / 6.6, rel=1e-12)
    assert spread([2.0, 2.0]) == 1.0
    with pytest.raises(ValueError, match="needs rounds on both sides"):
        median_ratio([], [1.0])
    with pytest.raises(ValueError, match=r"denominator's median 0\.0"):
        median_ratio([1.0], [0.0])
    with pytest.raises(ValueError, match=r"spread: needs positive rounds, got \[1\.0, 0\.0\]"):
        spread([1.0, 0.0])
