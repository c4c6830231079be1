"""recipes.bench: overhead ratios and stalls by hand, the models' sizes, and bad input (no benchmark runs)."""

from __future__ import annotations

import argparse
import math
import os
import statistics

import pytest

from recipes.bench.checkpoint import async_over_sync, checkpoint_stall
from recipes.bench.mlp import BenchModule, mlp
from recipes.bench.overhead import overhead_ratios
from recipes.bench.subcommands import build_parser, main


def test_overhead_ratios_and_goals() -> None:
    r = overhead_ratios(plain_torch=2000.0, plain_lightning=1960.0, full_recipe=1950.0)
    assert r["c/a"] == pytest.approx(0.975, rel=1e-12)
    assert r["c/b"] == pytest.approx(1950 / 1960, rel=1e-12)  # 0.99490
    assert (r["c/a_ok"], r["c/b_ok"]) == (True, True)
    assert r["overhead_vs_torch"] == pytest.approx(2000 / 1950 - 1, rel=1e-12)  # +2.56% time
    slow = overhead_ratios(2000.0, 1960.0, 1800.0)
    assert slow["c/a"] == pytest.approx(0.9, rel=1e-12) and not slow["c/a_ok"]
    assert slow["c/b"] == pytest.approx(1800 / 1960, rel=1e-12) and not slow["c/b_ok"]
    # exactly on the goals counts as met
    edge = overhead_ratios(100.0, 96.0, 95.04)
    assert edge["c/a"] == pytest.approx(0.9504) and edge["c/a_ok"] and edge["c/b_ok"]
    with pytest.raises(ValueError, match="full_recipe=0"):
        overhead_ratios(1.0, 1.0, 0)
    # without (a) (`--variants b,c`) only the c/b figures
    assert overhead_ratios(None, 1960.0, 1950.0) == {"c/b": 1950 / 1960, "c/b_ok": True,
                                                     "overhead_vs_lightning": 1960 / 1950 - 1.0}
    with pytest.raises(ValueError, match=r"plain_lightning=-1\.0"):
        overhead_ratios(None, -1.0, 1.0)


def test_checkpoint_stall_and_async_ratio_by_hand() -> None:
    # sync: three saves hold the loop 0.30, 0.40, 0.20 s; the loop took 6.0 s vs 5.1 s without saving
    sync = checkpoint_stall([0.30, 0.40, 0.20], loop_s=6.0, baseline_loop_s=5.1)
    assert sync["checkpoints"] == 3
    assert sync["blocked_s"] == pytest.approx(0.30, abs=1e-12)
    assert sync["blocked_max_s"] == 0.40
    assert sync["effective_s"] == pytest.approx(0.30, abs=1e-12)
    # async: 45 ms clones, plus 15 ms per save of interference from the writer thread
    async_ = checkpoint_stall([0.05, 0.04, 0.045], loop_s=5.28, baseline_loop_s=5.1)
    assert async_["blocked_s"] == pytest.approx(0.045, abs=1e-12)
    assert async_["effective_s"] == pytest.approx(0.06, abs=1e-12)
    ratio = async_over_sync(sync, async_)
    assert ratio["blocked_ratio"] == pytest.approx(0.15, abs=1e-12)
    assert ratio["effective_ratio"] == pytest.approx(0.20, abs=1e-12)
    assert ratio["ok"] is False  # effective 20% > 10%
    assert async_over_sync(sync, {"blocked_s": 0.09, "effective_s": 0.03})["ok"] is True  # effective 10%
    assert math.isnan(async_over_sync({"blocked_s": 0.0, "effective_s": 0.0}, async_)["blocked_ratio"])
    with pytest.raises(ValueError, match="no checkpoint"):
        checkpoint_stall([], 1.0, 1.0)


def test_benchmark_models_have_the_sizes_the_docs_claim() -> None:
    # overhead: 1024 -> 1024 -> 1024 -> 10
    overhead = mlp(1024, 1024, 2, 10)
    assert sum(p.numel() for p in overhead.parameters()) == 1024 * 1024 + 1024 + 1024 * 1024 + 1024 + 10250
    # checkpoint: 2 x Linear(4096, 4096) + head, fp32, SGD (no optimizer state) -> >= 100 MB
    args = build_parser().parse_args(["checkpoint"])
    params = sum(p.numel() for p in mlp(args.features, args.hidden, args.layers, 10).parameters())
    assert params == 2 * (4096 * 4096 + 4096) + 4096 * 10 + 10
    assert params * 4 >= 100e6  # 134.4 MB
    assert BenchModule(optimizer="sgd").configure_optimizers().__class__.__name__ == "SGD"


@pytest.mark.parametrize(("argv", "message"), [
    (["overhead", "--steps", "5", "--warmup", "10"], "--steps 5 must exceed --warmup 10"),
    (["checkpoint", "--every", "40"], "--every 40: needs at least one save"),
    (["overhead", "--rounds", "0"], "--rounds 0 must be >= 1"),
    (["overhead", "--variants", "a,c"], "--variants a,c: each one of a, b, b+timing, c, with b and c among them"),
    (["overhead", "--variants", "b,c,d"], "--variants b,c,d: each one of"),
    (["nonsense"], "invalid choice"),
])
def test_bad_input_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


@pytest.mark.parametrize(("command", "expected"), [
    ("overhead", ["--steps STEPS optimizer steps per variant and round, warm-up included (default: 40)",
                  "--batch-size BATCH_SIZE samples per step (default: 256)",
                  "--rounds ROUNDS rounds of all variants, interleaved (at least this many; the best round of "
                  "each is shown, the bootstrap CI of the mean ratio decides) (default: 3)",
                  "--max-rounds MAX_ROUNDS keep adding rounds until both verdicts are decided (c/b met or missed, "
                  "c/a's CI narrower than 5%), or this many rounds: then the verdict may say 'inconclusive' "
                  "(default: 15)",
                  "--threads THREADS torch threads (CPU) (default: 1)"]),
    ("checkpoint", ["--every EVERY save a checkpoint every this many steps (default: 10)",
                    "--hidden HIDDEN width of the hidden layers: 2 x Linear(4096, 4096) is 134 MB of fp32 state "
                    "(default: 4096)",
                    "--out OUT keep run files here (default: a temporary directory)"]),
])
def test_help_gives_every_option_a_meaning_and_its_default(command: str, expected: list[str],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit) as exited:
        parser.parse_args([command, "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for line in expected:
        assert line in text
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices[command]._actions:
        assert action.help, f"{command} {action.option_strings} has no help"
        if action.default is not None and action.default is not False and action.default != argparse.SUPPRESS:
            assert f"(default: {action.default})" in text, action.option_strings
    assert "(default: None)" not in text and "(default: False)" not in text


def test_c_over_b_must_reach_the_goal_with_its_interval_above_the_floor() -> None:
    from recipes.bench.overhead import C_OVER_B_CI_FLOOR, GOAL_C_OVER_B
    from recipes.bench.stats import verdict_with_floor

    assert (GOAL_C_OVER_B, C_OVER_B_CI_FLOOR) == (0.98, 0.97)  # the "c/b >= 0.98 with its CI above 0.97"
    assert verdict_with_floor(0.985, 0.972, 0.998, 0.98, 0.97) == "met"
    assert verdict_with_floor(0.980, 0.970, 0.990, 0.98, 0.97) == "met"  # on both bounds counts
    assert verdict_with_floor(0.9801, 0.950, 1.017, 0.98, 0.97) == "inconclusive"  # the interval dips below 0.97
    assert verdict_with_floor(0.979, 0.972, 0.990, 0.98, 0.97) == "inconclusive"  # short of 0.98, within noise
    assert verdict_with_floor(0.969, 0.950, 0.979, 0.98, 0.97) == "missed"  # the whole interval below 0.98


def test_ablation_pieces_and_flags() -> None:
    from recipes.bench.runs import PIECES

    assert set(PIECES) == {"mlflow", "system_metrics", "progress_bar", "spot", "cost", "checkpointing",
                           "baselines", "manifest", "log_model", "timing", "timing_plot"}
    args = build_parser().parse_args(["overhead", "--ablate", "--rounds", "2", "--max-rounds", "4"])
    assert (args.ablate, args.rounds, args.max_rounds) == (True, 2, 4)


def test_fit_mode_flags_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["fit", "--ablate", "--pieces", "log_model,timing_plot", "--rounds", "2"])
    assert (args.command, args.ablate, args.pieces, args.rounds, args.epochs) == (
        "fit", True, ["log_model", "timing_plot"], 2, 20)
    assert main(["fit", "--pieces", "log_model,nope"]) == 2
    assert "--pieces nope: not one of mlflow" in capsys.readouterr().err
    assert main(["fit", "--epochs", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --epochs 0 must be >= 1"


def test_contention_figures_and_table_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """Medians over rounds, busy/quiet, the goals, and the table, with each worker's ms per step given."""
    import subprocess

    from rich.console import Console

    from recipes.bench import contention

    measured = iter([10.0, 30.0, 12.0, 20.0,    # round 1: 1 thread quiet, busy; adaptive quiet, busy
                     14.0, 24.0, 12.0, 26.0])   # round 2
    started: list[list[str]] = []
    monkeypatch.setattr(contention, "_run_worker", lambda args, worker_args, openmp: next(measured))

    class Hog:  # the busy process beside each contended run
        def __init__(self, command: list[str]) -> None:
            started.append(command)

        def kill(self) -> None: ...

        def wait(self) -> None: ...

    monkeypatch.setattr(subprocess, "Popen", Hog)
    args = argparse.Namespace(settings=["1", "adaptive"], rounds=2, steps=30, warmup=5)
    figures = contention.bench_contention(args, Console(quiet=True))
    assert len(started) == 4 and (figures["steps"], figures["rounds"]) == (30, 2)
    one, adaptive = figures["settings"]["1 thread"], figures["settings"][contention.CONTENTION_SETTINGS[4][0]]
    assert (one["quiet_ms"], one["contended_ms"], one["ratio"], one["ok"]) == (12.0, 27.0, 2.25, False)
    assert (adaptive["quiet_ms"], adaptive["contended_ms"], adaptive["ok"]) == (12.0, 23.0, True)
    assert one["quiet_vs_today"] is None and one["all"] == {"quiet": [10.0, 14.0], "contended": [30.0, 24.0]}
    console = Console(width=250, record=True, force_terminal=False)
    contention.print_contention(figures, console)
    text = console.export_text()
    for cell in ("quiet ms", "busy ms", "busy/quiet", "1 thread", "2.25x", "missed", "met",
                 "Goal: busy <= 2x quiet"):
        assert cell in text, cell


@pytest.mark.parametrize(("recipe", "plain", "verdict"), [
    ([6.6, 6.7, 6.8, 6.7], [6.2, 6.1, 6.3, 6.2], "met"),     # medians 6.7 / 6.2 = 1.081, spreads 1.030 <= 1.033
    ([6.6, 9.2, 6.8, 6.7], [6.2, 6.1, 6.3, 6.2], "missed"),  # median 1.089, but a round 1.39x the fastest
    ([7.0, 7.0, 6.9, 7.0], [6.2, 6.1, 6.3, 6.2], "missed"),  # median 7.0 / 6.2 = 1.129 > 1.10
])
def test_bench_fit_judges_the_medians_and_the_spread(monkeypatch: pytest.MonkeyPatch, recipe: list[float],
                                                     plain: list[float], verdict: str) -> None:
    from rich.console import Console

    from recipes.bench import fit

    plain_rounds, recipe_rounds = iter(plain), iter(recipe)
    monkeypatch.setattr(fit, "plain_digits_fit", lambda epochs, root: next(plain_rounds))
    monkeypatch.setattr(fit, "recipe_digits_fit", lambda epochs, root, index, keep_files: {
        "fit_s": (s := next(recipe_rounds)), "flow_s": s + 1.0})
    args = build_parser().parse_args(["fit", "--rounds", "4"])
    with open(os.devnull, "w") as devnull:
        figures = fit.bench_fit(args, Console(file=devnull))
    assert figures["median_ratio"] == pytest.approx(statistics.median(recipe) / statistics.median(plain))
    assert figures["spread"] == pytest.approx({"plain": max(plain) / min(plain), "recipe": max(recipe) / min(recipe)})
    assert figures["verdict"] == verdict and figures["rounds_run"] == 4 and figures["goal"] == 1.10
