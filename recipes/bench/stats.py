"""Statistics the benchmarks share (``bench overhead|checkpoint|fit`` and ``bench gpu``): pure maths, no torch.

A throughput window (:func:`window_throughput`), percentile bootstrap intervals over interleaved rounds
(:func:`bootstrap_ci`, by ``scipy.stats.bootstrap`` over the round indices, so a round's paired measurements
stay together; :func:`bootstrap_ratio_ci`, :func:`effective_stall_ci`), and the verdicts an interval gives
against a goal (:func:`verdict`, :func:`verdict_with_floor`, :func:`verdict_at_most`, :func:`ci_settled`), and
what a typical round pays beside the best (:func:`median_ratio`, :func:`spread`).
Ablations run their variants in bracketed rounds (:func:`bracketed_rounds`): each piece turned off between
two full runs, so a piece's cost is measured against the full runs beside it.
It imports neither :mod:`recipes.bench` nor :mod:`recipes.bench.gpu`: both import it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import numpy as np
import scipy.stats


def window_throughput(step_ends: Sequence[float], samples_per_step: int, warmup: int) -> float:
    """Samples/s from the end of step ``warmup`` to the end of the last step.

    Args:
        step_ends: clock reading at the end of every step, in order.
        samples_per_step: samples in one step.
        warmup: steps before the window (>= 1; their end opens it).

    Returns:
        ``(len(step_ends) - warmup) * samples_per_step / (step_ends[-1] - step_ends[warmup - 1])``.

    Raises:
        ValueError: if ``warmup < 1``, no step follows the warm-up, or the clock did not advance.
    """
    if warmup < 1 or len(step_ends) <= warmup:
        raise ValueError(f"window_throughput: need warmup >= 1 and more than {warmup} steps "
                         f"(got warmup={warmup}, {len(step_ends)} steps).")
    elapsed = step_ends[-1] - step_ends[warmup - 1]
    if elapsed <= 0:
        raise ValueError(f"window_throughput: the clock did not advance ({elapsed!r} s).")
    return (len(step_ends) - warmup) * samples_per_step / elapsed


def bootstrap_ci(rounds: int, statistic: Callable[[np.ndarray], float], level: float = 0.95,
                 resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``statistic`` over interleaved rounds, by ``scipy.stats.bootstrap``.

    The one array scipy resamples is the round indices, ``np.arange(rounds)``: ``statistic(picks)`` gets an
    integer array of ``rounds`` indices drawn with replacement (an index may repeat) and computes the figure
    from those rounds of every series it reads, so the paired measurements of one round stay together (what
    scipy's ``paired=True`` does inside). Percentile, not scipy's default BCa: BCa's jackknife gives NaN on
    constant data, and on a statistic that is infinite in some resamples (the effective stall ratio, when a
    resample's synchronous saves did not slow the loop down).

    Args:
        rounds: rounds measured (>= 1); a single round resamples only to itself: the interval is its figure.
        statistic: the figure from the rounds at the indices it is given.
        level: confidence level (0 < level < 1).
        resamples: bootstrap resamples.
        seed: seed of the resampling (``numpy.random.default_rng``), so a result can be reproduced exactly.

    Returns:
        ``(low, high)``.

    Raises:
        ValueError: if ``rounds < 1``.
    """
    if rounds < 1:
        raise ValueError(f"bootstrap_ci: need at least one round (got {rounds}).")
    if rounds == 1:  # scipy needs two observations; every resample of one round is that round
        point = float(statistic(np.zeros(1, dtype=int)))
        return point, point
    with np.errstate(invalid="ignore"):  # scipy's standard error of a distribution holding inf (unused here)
        result = scipy.stats.bootstrap((np.arange(rounds),), statistic, n_resamples=resamples, vectorized=False,
                                       confidence_level=level, method="percentile", rng=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def effective_stall_ci(none_s: Sequence[float], sync_s: Sequence[float], async_s: Sequence[float],
                       saves: Sequence[int], level: float = 0.95, resamples: int = 2000,
                       seed: int = 0) -> tuple[float, float, float]:
    """The async effective stall as a fraction of the sync one, and its bootstrap interval over rounds.

    Round ``i`` timed the same steps without saves (``none_s[i]``), with synchronous and with
    asynchronous saves, ``saves[i]`` of them; a writer's effective stall per save in that round is
    ``(its loop - none_s[i]) / saves[i]``. The ratio is of the sums over rounds; an async round may come
    out faster than the one without saves (noise), which the interval keeps.

    Returns:
        ``(ratio, low, high)``; all NaN when the synchronous saves did not slow the loop down at all
        (a state too small to measure): nothing to compare.

    Raises:
        ValueError: on unequal or empty rounds, or a round without saves.
    """
    n = len(none_s)
    if not n or not len(sync_s) == len(async_s) == len(saves) == n:
        raise ValueError(f"effective_stall_ci: need equal, non-empty rounds (got {n}, {len(sync_s)}, "
                         f"{len(async_s)}, {len(saves)}).")
    if min(saves) < 1:
        raise ValueError(f"effective_stall_ci: every round needs a save (got {list(saves)}).")
    none, per_save = np.asarray(none_s, dtype=float), np.asarray(saves, dtype=float)
    sync_stall = (np.asarray(sync_s, dtype=float) - none) / per_save
    async_stall = (np.asarray(async_s, dtype=float) - none) / per_save

    def ratio(picks: np.ndarray) -> float:
        sync = float(sync_stall[picks].sum())
        return float(async_stall[picks].sum()) / sync if sync > 0 else math.inf

    whole = ratio(np.arange(n))
    if not math.isfinite(whole):
        return math.nan, math.nan, math.nan
    low, high = bootstrap_ci(n, ratio, level, resamples, seed)
    return whole, low, high


def bootstrap_ratio_ci(numerator: Sequence[float], denominator: Sequence[float], level: float = 0.95,
                       resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Ratio of means of paired rounds and its percentile bootstrap confidence interval.

    Rounds are interleaved, so round ``i`` of both variants saw the same machine: the bootstrap
    resamples round indices (with replacement) and keeps the pairs together (:func:`bootstrap_ci`).

    Args:
        numerator: throughput of the variant on top of the ratio, one value per round.
        denominator: throughput of the reference variant, same rounds in the same order.
        level: confidence level (0 < level < 1).
        resamples: bootstrap resamples.
        seed: seed of the resampling (``numpy.random.default_rng``), so a result can be reproduced exactly.

    Returns:
        ``(ratio, low, high)`` with ``ratio = mean(numerator) / mean(denominator)``.

    Raises:
        ValueError: on unpaired or empty input, a throughput <= 0, or a level outside (0, 1).
    """
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(f"bootstrap_ratio_ci: need paired rounds (got {len(numerator)} and {len(denominator)}).")
    if not 0 < level < 1 or resamples < 1:
        raise ValueError(f"bootstrap_ratio_ci: level {level!r} must be in (0, 1), resamples {resamples!r} >= 1.")
    if min(*numerator, *denominator) <= 0:
        raise ValueError("bootstrap_ratio_ci: throughputs must be > 0.")
    top, bottom = np.asarray(numerator, dtype=float), np.asarray(denominator, dtype=float)
    low, high = bootstrap_ci(len(top), lambda picks: float(top[picks].sum() / bottom[picks].sum()),
                             level, resamples, seed)
    return sum(numerator) / sum(denominator), low, high


def verdict(low: float, high: float, goal: float, margin: float) -> str:
    """``met`` (the interval is at or above ``goal``), ``missed`` (below), else ``inconclusive``.

    Meeting the goal needs an interval narrower than ``margin`` too (a wide one cannot tell the goal from
    its margin); an interval wholly below the goal is missed however wide it is.
    """
    if high < goal:
        return "missed"
    if high - low >= margin:
        return "inconclusive"
    if low >= goal:
        return "met"
    return "inconclusive"


def verdict_with_floor(ratio: float, low: float, high: float, goal: float, floor: float) -> str:
    """For a ratio that must reach ``goal`` with its whole interval above ``floor``: ``met`` when both hold,
    ``missed`` when the whole interval lies below ``goal``, else ``inconclusive``."""
    if high < goal:
        return "missed"
    if ratio >= goal and low >= floor:
        return "met"
    return "inconclusive"


def verdict_at_most(low: float, high: float, goal: float) -> str:
    """For a figure that must stay at or below ``goal``: ``met`` when the whole interval does, ``missed``
    when it lies wholly above, else ``inconclusive`` (NaN bounds, from nothing to compare, are inconclusive)."""
    if high <= goal:
        return "met"
    if low > goal:
        return "missed"
    return "inconclusive"


def ci_settled(low: float, high: float, margin: float) -> bool:
    """Whether a ratio's confidence interval is narrower than the goal's margin (more rounds will not change it)."""
    return high - low < margin


def bracketed_order(pieces: Sequence[str], index: int) -> list[str]:
    """Round ``index``'s run order: the pieces shuffled (seeded by the round), two at a time between full runs.

    ``full, a, b, full, c, d, full, ...``: every piece runs beside a full run, so the machine's drift over a
    round cancels in a piece's cost instead of landing on whichever variant runs first or last.
    """
    order = list(pieces)
    random.Random(index).shuffle(order)
    runs = ["full"]
    for start in range(0, len(order), 2):
        runs += [*order[start:start + 2], "full"]
    return runs


def bracketing_fulls(order: Sequence[str]) -> dict[str, tuple[int, int]]:
    """For each piece in ``order``, the positions of the full runs just before and after it."""
    fulls = [i for i, v in enumerate(order) if v == "full"]
    return {v: (max(f for f in fulls if f < i), min(f for f in fulls if f > i))
            for i, v in enumerate(order) if v != "full"}


Figures = dict[str, float]


def bracketed_rounds(pieces: Sequence[str], rounds: int, run: Callable[[str, int], Figures],
                     ) -> tuple[dict[str, list[Figures]], dict[str, list[Figures]]]:
    """Run an ablation: ``rounds`` rounds in :func:`bracketed_order`, ``run(variant, round)`` measuring each run.

    ``variant`` is ``"full"`` or the piece turned off. Returns every run's figures per variant (in round
    order) and, per piece, the mean of the two full runs on either side of each of its runs: the reference
    its cost is measured against, paired with its runs round by round.
    """
    runs: dict[str, list[Figures]] = {v: [] for v in ["full", *pieces]}
    beside: dict[str, list[Figures]] = {p: [] for p in pieces}
    for index in range(rounds):
        order = bracketed_order(pieces, index)
        done = []
        for variant in order:
            done.append(run(variant, index))
            runs[variant].append(done[-1])
        for piece, (before, after) in bracketing_fulls(order).items():
            beside[piece].append({k: (done[before][k] + done[after][k]) / 2 for k in done[before]})
    return runs, beside


def time_ratio_ci(slower: Sequence[float], faster: Sequence[float]) -> tuple[float, float, float]:
    """``mean(slower) / mean(faster)`` of paired times (seconds) and its 95 % interval (:func:`bootstrap_ratio_ci`)."""
    speed, low, high = bootstrap_ratio_ci(faster, slower)  # a ratio of throughputs is the inverse of one of times
    return 1 / speed, 1 / high, 1 / low



def median_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """``median(numerator) / median(denominator)``: what the typical run pays, which the best rounds hide.

    Raises:
        ValueError: if either side is empty or the denominator's median is not positive.
    """
    if not numerator or not denominator:
        raise ValueError(f"median_ratio: needs rounds on both sides (got {len(numerator)} and {len(denominator)}).")
    below = float(np.median(denominator))
    if not below > 0:
        raise ValueError(f"median_ratio: the denominator's median {below!r} must be > 0.")
    return float(np.median(numerator)) / below


def spread(values: Sequence[float]) -> float:
    """``max / min`` of a variant's rounds: 1.0 when every round took the same time.

    Raises:
        ValueError: if there are no rounds or one is not positive.
    """
    if not values or min(values) <= 0:
        raise ValueError(f"spread: needs positive rounds, got {list(values)!r}.")
    return max(values) / min(values)
