"""``python -m recipes.bench fit``: the default digits recipe's ``trainer.fit`` against plain Lightning's.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch import Trainer
from rich.console import Console
from rich.table import Table

from recipes.bench.runs import PIECES, Stopwatch, from_spec, own_store, run_full_recipe
from recipes.bench.stats import bracketed_rounds, median_ratio, spread, time_ratio_ci

# ------------------------------------------------------------- default recipe's fit
DIGITS_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "digits.yaml"
#: Goal: the default digits recipe's median ``trainer.fit`` at most this many times plain Lightning's median.
GOAL_FIT_RATIO = 1.10


def plain_digits_fit(epochs: int, root: Path) -> float:
    """Seconds of ``trainer.fit`` for plain Lightning on the digits recipe's module, data and seed.

    The same ``ImageClassifier``, ``DigitsDataModule``, optimizer and schedule as ``configs/digits.yaml``, the same
    epochs with validation (and its sanity check), on one CPU; no logger, no checkpointing, no progress bar.
    """
    import yaml

    from datamodules.digits import DigitsDataModule
    from recipes.classifier import ImageClassifier

    cfg = yaml.safe_load(DIGITS_CONFIG.read_text())
    init = dict(cfg["model"]["init_args"])
    optimizer, scheduler = from_spec(init.pop("optimizer")), from_spec(init.pop("lr_scheduler"))
    pl.seed_everything(cfg["seed_everything"], verbose=False)
    model = ImageClassifier(**init, optimizer=optimizer, lr_scheduler=scheduler)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=root)
    with open(root / "plain.log", "a") as log_file, contextlib.redirect_stdout(log_file):
        started = time.perf_counter()
        trainer.fit(model, datamodule=DigitsDataModule(**cfg["data"]["init_args"]))
        return time.perf_counter() - started


def recipe_digits_fit(epochs: int, root: Path, index: int, without: frozenset[str] = frozenset(),
                      keep_files: bool = True) -> dict[str, float]:
    """The default digits recipe (less ``without``): ``trainer.fit`` seconds and the CLI's whole fit flow's."""
    watch = Stopwatch()
    recipe = ["--config", str(DIGITS_CONFIG), "--experiment", "bench-fit", "--trainer.max_epochs", str(epochs)]
    _, flow_s = run_full_recipe(recipe, root, index, without, watch=watch, keep_files=keep_files)
    assert watch.fit_s is not None
    return {"fit_s": watch.fit_s, "flow_s": flow_s}


def bench_fit(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """The recipe's and plain Lightning's ``trainer.fit``, ``args.rounds`` interleaved rounds; judged on the medians.

    The typical run pays the median round, not the best one: the verdict is the ratio of the two medians against
    :data:`GOAL_FIT_RATIO`, with the recipe's rounds spreading (max / min) no wider than plain Lightning's. The
    bootstrap CI of the mean ratio is reported beside them.
    """
    plain: list[float] = []
    recipe: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp, own_store(Path(args.out or tmp)) as root:
        for index in range(args.rounds):
            for key in ("plain", "recipe") if index % 2 == 0 else ("recipe", "plain"):
                if key == "plain":
                    plain.append(plain_digits_fit(args.epochs, root))
                else:
                    recipe.append(recipe_digits_fit(args.epochs, root, index, keep_files=args.out is not None))
            console.print(f"round {index + 1}: trainer.fit recipe {recipe[-1]['fit_s']:.2f} s (its whole fit flow "
                          f"{recipe[-1]['flow_s']:.2f} s), plain Lightning {plain[-1]:.2f} s", highlight=False)
    recipe_s = [r["fit_s"] for r in recipe]
    ratio, low, high = time_ratio_ci(recipe_s, plain) if len(plain) >= 2 else (math.nan, math.nan, math.nan)
    median = median_ratio(recipe_s, plain)
    spreads = {"plain": spread(plain), "recipe": spread(recipe_s)}
    met = median <= GOAL_FIT_RATIO and spreads["recipe"] <= spreads["plain"]
    return {"recipe_fit_s": recipe_s, "recipe_flow_s": [r["flow_s"] for r in recipe], "plain_fit_s": plain,
            "median_ratio": median, "spread": spreads, "ratio": ratio, "ci95": [low, high],
            "verdict": "met" if met else "missed", "goal": GOAL_FIT_RATIO, "rounds_run": len(plain),
            "load_average": list(os.getloadavg()),
            "settings": {k: getattr(args, k) for k in ("epochs", "rounds", "threads")}}


def print_fit(figures: dict[str, Any], console: Console) -> None:
    table = Table(title=f"Default digits recipe vs plain Lightning, trainer.fit of {figures['settings']['epochs']} "
                        f"epochs with validation ({figures['rounds_run']} interleaved rounds)")
    for column in ("variant", "median s", "spread (max/min)", "every round (s)"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for name, key in (("plain Lightning trainer.fit", "plain_fit_s"), ("recipe trainer.fit", "recipe_fit_s"),
                      ("recipe's whole fit flow (MLflow run, fit, flush, summary)", "recipe_flow_s")):
        table.add_row(name, f"{statistics.median(figures[key]):.2f}", f"{spread(figures[key]):.2f}x",
                      ", ".join(f"{v:.2f}" for v in figures[key]))
    console.print(table)
    low, high = figures["ci95"]
    console.print(f"recipe / plain trainer.fit, medians: {figures['median_ratio']:.3f} (goal <= {figures['goal']}, "
                  f"the recipe's spread {figures['spread']['recipe']:.2f}x at most plain's "
                  f"{figures['spread']['plain']:.2f}x): {figures['verdict']}; mean ratio {figures['ratio']:.3f}, "
                  f"95% CI {low:.3f} .. {high:.3f}; load average at the end "
                  f"{', '.join(f'{v:.2f}' for v in figures['load_average'])}", highlight=False)


def bench_fit_ablation(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """The digits recipe's trainer.fit with each default piece turned off in turn (see :data:`PIECES`), each
    between two full runs."""
    pieces = args.pieces or list(PIECES)
    with tempfile.TemporaryDirectory() as tmp, own_store(Path(args.out or tmp)) as root:
        def run(variant: str, index: int) -> dict[str, float]:
            without = frozenset() if variant == "full" else frozenset({variant})
            seconds = recipe_digits_fit(args.epochs, root, index, without, keep_files=args.out is not None)["fit_s"]
            name = "full" if variant == "full" else f"without {variant}"
            console.print(f"round {index + 1}/{args.rounds} ({name}): trainer.fit {seconds:.2f} s", highlight=False)
            return {"fit_s": seconds}

        runs, beside = bracketed_rounds(pieces, args.rounds, run)
    fit_s = {v: [r["fit_s"] for r in rs] for v, rs in runs.items()}
    cost_s, cost_ci95 = {}, {}
    for piece in pieces:
        near = [b["fit_s"] for b in beside[piece]]
        cost_s[piece] = statistics.median(b - r for b, r in zip(near, fit_s[piece], strict=True))
        _, low, high = time_ratio_ci(near, fit_s[piece])
        cost_ci95[piece] = [low - 1, high - 1]
    return {"full_fit_s": statistics.median(fit_s["full"]), "fit_s": fit_s, "load_average": list(os.getloadavg()),
            "cost_s": cost_s, "cost_ci95": cost_ci95,
            "settings": {k: getattr(args, k) for k in ("epochs", "rounds", "threads")}}


def print_fit_ablation(figures: dict[str, Any], console: Console) -> None:
    table = Table(title=f"What each piece adds to the digits recipe's trainer.fit ({figures['full_fit_s']:.2f} s, "
                        f"{figures['settings']['rounds']} rounds, each piece run between two full runs; "
                        "cost = those full runs minus the run without it)")
    for column in ("piece turned off", "trainer.fit without (s)", "cost (s)", "cost 95% CI"):
        table.add_column(column, justify="left" if column == "piece turned off" else "right")
    for piece, cost in figures["cost_s"].items():
        low, high = figures["cost_ci95"][piece]
        table.add_row(PIECES[piece], f"{statistics.median(figures['fit_s'][piece]):.2f}", f"{cost:+.2f}",
                      f"{low:+.1%} .. {high:+.1%}")
    console.print(table)
