"""Benchmarks of the recipe's own costs: framework overhead and checkpoint stalls.

What the full recipe costs over plain PyTorch and plain Lightning, on one model and data set
trained three ways in one process (rounds interleaved, median taken)::

    python -m recipes.bench overhead                     # MLP, ~50-100 ms steps on one CPU core
    python -m recipes.bench overhead --hidden 2048 --rounds 5
    python -m recipes.bench overhead --variants b,c --steps 70 --rounds 50 --max-rounds 50  # c/b, as the README

(a) a plain PyTorch loop, (b) plain Lightning with no extras (no logger, no checkpointing, no
progress bar), (c) the full recipe: :class:`recipes.cli.AtscaleCLI` with every default callback
(MLflow, spot safety, atomic async checkpoints, manifest, baselines, model logging, rich progress
bar) plus :class:`callbacks.timing.StepTiming`. A fourth variant, plain Lightning + StepTiming alone, isolates
that callback's cost (goal <= 1%). Throughput is measured between the end of the warm-up steps and
the end of the last step; variants are interleaved round by round, and the verdict compares mean
throughputs over the paired rounds with a bootstrap confidence interval (the best round and the medians
of each variant are printed too). Goals: c/b >= 0.98 with its 95 % CI above 0.97, c/a >= 0.95.

How long a periodic checkpoint stalls the training loop, synchronous versus asynchronous
(:class:`callbacks.checkpoint_io.BoundedAsyncCheckpointIO` around
:class:`~callbacks.checkpoint_io.AtomicCheckpointIO`), for a model with >= 100 MB of state, side by side::

    python -m recipes.bench checkpoint                   # 2 x Linear(4096, 4096): 134 MB
    python -m recipes.bench checkpoint --every 10 --steps 40

The *blocked* stall is how long ``trainer.save_checkpoint`` held the loop (StepTiming's
``time/checkpoint_s``); the *effective* stall adds what the background write cost the steps
around it: (loop time with checkpoints - loop time without) / checkpoints, paired round by round;
rounds are added until the bootstrap CI of async / sync lies wholly on one side of the goal or is
narrower than 5 points ("inconclusive" if neither by ``--max-rounds``). Goals: async
effective <= 10% of sync; an async save's staging (its blocked stall less any wait for the previous
write) <= 2x the memory-copy floor measured in the same run. Each run saves once after its first
step, before the window (the async writer allocates its staging buffer then, once, as a long run
does), and that first save is reported apart; the writers' order alternates from round to round.
Both commands print a table and ``--json`` prints the figures; on CPU the benchmarks run with one
torch thread (``--threads``) so repeated runs are comparable.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from callbacks.checkpoint_io import AtomicCheckpointIO, BoundedAsyncCheckpointIO
from callbacks.timing import StepTiming
from recipes import bench_compression, bench_lm, bench_startup
from recipes.bench_runs import PIECES, Stopwatch, from_spec, own_store, run_full_recipe, tensors_copy_floor
from recipes.bench_stats import (
    bootstrap_ratio_ci,
    ci_settled,
    effective_stall_ci,
    verdict,
    verdict_at_most,
    verdict_with_floor,
    window_throughput,
)
from recipes.common import ArgumentParser, HelpFormatter, UsageError
from recipes.shutdown import destroy_process_group, run_and_exit
from recipes.soak import cli as chaos

PROG = "python -m recipes.bench"
#: Goals: full recipe vs plain Lightning, full recipe vs plain PyTorch, async vs sync checkpoint stall
#: (effective: the loop time a save adds), an async save's staging vs the memory-copy floor.
GOAL_C_OVER_B = 0.98
#: ... and the 95 % CI of c/b must lie above this (the issue's "c/b >= 0.98 with its CI above 0.97").
C_OVER_B_CI_FLOOR = 0.97
GOAL_C_OVER_A = 0.95
GOAL_ASYNC_OVER_SYNC = 0.10
GOAL_STAGING_OVER_FLOOR = 2.0
#: Width of the effective async/sync ratio's 95 % CI below which the checkpoint benchmark stops adding rounds.
CHECKPOINT_MARGIN = 0.05
MIN_STEP_S = 0.050
#: The overhead benchmark's variants, in run order within each round.
VARIANTS = {"a": "(a) plain PyTorch loop", "b": "(b) plain Lightning", "b+timing": "(b) + StepTiming only",
            "c": "(c) full recipe + MLflow"}


# --------------------------------------------------------------------------- pure maths
def overhead_ratios(plain_torch: float | None, plain_lightning: float, full_recipe: float) -> dict[str, Any]:
    """Throughput ratios c/a and c/b and whether they reach the goals (>= 0.95, >= 0.98; no interval).

    Args:
        plain_torch: throughput of the plain PyTorch loop (a); ``None`` when (a) did not run: no c/a keys.
        plain_lightning: throughput of plain Lightning (b).
        full_recipe: throughput of the full recipe (c).

    Returns:
        ``{"c/a", "c/b", "c/a_ok", "c/b_ok", "overhead_vs_torch", "overhead_vs_lightning"}``
        (overheads as fractions of time: ``a/c - 1`` and ``b/c - 1``).

    Raises:
        ValueError: if a throughput is not > 0.
    """
    for name, value in (("plain_torch", plain_torch), ("plain_lightning", plain_lightning),
                        ("full_recipe", full_recipe)):
        if value is not None and not value > 0:
            raise ValueError(f"overhead_ratios: `{name}={value!r}` must be > 0.")
    c_b = full_recipe / plain_lightning
    ratios = {"c/b": c_b, "c/b_ok": c_b >= GOAL_C_OVER_B, "overhead_vs_lightning": plain_lightning / full_recipe - 1.0}
    if plain_torch is not None:
        c_a = full_recipe / plain_torch
        ratios |= {"c/a": c_a, "c/a_ok": c_a >= GOAL_C_OVER_A, "overhead_vs_torch": plain_torch / full_recipe - 1.0}
    return ratios


def checkpoint_stall(blocked_s: Sequence[float], loop_s: float, baseline_loop_s: float) -> dict[str, float]:
    """Stall per checkpoint: blocked (in ``save_checkpoint``) and effective (loop time added).

    Args:
        blocked_s: seconds each save held the training loop.
        loop_s: wall time of the measured steps with these saves.
        baseline_loop_s: wall time of the same steps without any save.

    Returns:
        ``{"checkpoints", "blocked_s" (mean), "blocked_max_s", "effective_s"}``, where
        ``effective_s = (loop_s - baseline_loop_s) / checkpoints``.

    Raises:
        ValueError: if there is no save or a time is negative.
    """
    if not blocked_s:
        raise ValueError("checkpoint_stall: no checkpoint was saved in the measured window.")
    if min(blocked_s) < 0 or loop_s < 0 or baseline_loop_s < 0:
        raise ValueError("checkpoint_stall: times must be >= 0.")
    n = len(blocked_s)
    return {"checkpoints": n, "blocked_s": sum(blocked_s) / n, "blocked_max_s": max(blocked_s),
            "effective_s": (loop_s - baseline_loop_s) / n}


def async_over_sync(sync: dict[str, float], async_: dict[str, float]) -> dict[str, Any]:
    """Async stall as a fraction of sync, blocked and effective; ``ok``: effective within the 10% goal."""
    out: dict[str, Any] = {}
    for key in ("blocked_s", "effective_s"):
        ratio = async_[key] / sync[key] if sync[key] > 0 else float("nan")
        out[key.replace("_s", "_ratio")] = ratio
    out["ok"] = out["effective_ratio"] <= GOAL_ASYNC_OVER_SYNC
    return out


# ------------------------------------------------------------------ model and data
def mlp(features: int, hidden: int, layers: int, classes: int) -> nn.Sequential:
    """``layers`` hidden Linear+ReLU blocks of width ``hidden``."""
    blocks: list[nn.Module] = []
    width = features
    for _ in range(layers):
        blocks += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*blocks, nn.Linear(width, classes))


class BenchModule(pl.LightningModule):
    """The benchmark's classifier: an MLP on random features, AdamW, as the recipes train.

    Args:
        features: input width.
        hidden: hidden width.
        layers: hidden layers.
        classes: output classes.
        lr: learning rate.
        optimizer: ``adamw`` (as the recipes) or ``sgd`` (no optimizer state: the checkpoint is the weights).
    """

    def __init__(self, features: int = 1024, hidden: int = 1024, layers: int = 2, classes: int = 10,
                 lr: float = 1e-3, optimizer: Literal["adamw", "sgd"] = "adamw") -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)  # the recipe's LogModel rebuilds the module from them
        self.net = mlp(features, hidden, layers, classes)
        self.lr = lr
        self.optimizer = optimizer

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val/acc", (self(x).argmax(-1) == y).float().mean())

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def random_set(samples: int, features: int, classes: int, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, features, generator=generator),
                         torch.randint(0, classes, (samples,), generator=generator))


class BenchData(pl.LightningDataModule):
    """Random features and labels, generated once (the same for every variant).

    Args:
        steps: training batches per epoch.
        batch_size: samples per batch.
        features: input width.
        classes: label count.
    """

    def __init__(self, steps: int = 40, batch_size: int = 256, features: int = 1024, classes: int = 10) -> None:
        super().__init__()
        self.steps, self.batch_size, self.features, self.classes = steps, batch_size, features, classes

    @override
    def setup(self, stage: str) -> None:
        self.train_set = random_set(self.steps * self.batch_size, self.features, self.classes)
        self.val_set = random_set(self.batch_size, self.features, self.classes, seed=1)

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size)

    @override
    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def example_input(self) -> torch.Tensor:
        return self.val_set.tensors[0][:2]


class FirstSave(Callback):
    """One save after the first step, written before the second: what a long run pays once, not at every save.

    The first save through :class:`BoundedAsyncCheckpointIO` allocates its staging buffer (and the first
    synchronous one creates the directory's first file); in a run of hundreds of saves that happens once, so
    the benchmark makes it here, before its timed window, and reports it apart (``seconds``).
    """

    def __init__(self, dirpath: Path) -> None:
        self.dirpath = dirpath
        #: How long the first save held the loop (the wait for its write excluded).
        self.seconds: float | None = None

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step != 1:
            return
        started = time.perf_counter()
        trainer.save_checkpoint(self.dirpath / "first.ckpt")
        self.seconds = time.perf_counter() - started
        io = trainer.strategy.checkpoint_io
        if isinstance(io, BoundedAsyncCheckpointIO):
            io.drain()  # written before the timed window opens


# --------------------------------------------------------------------- overhead runs
def run_plain_torch(args: argparse.Namespace) -> list[float]:
    torch.manual_seed(42)
    model = mlp(args.features, args.hidden, args.layers, 10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(random_set(args.steps * args.batch_size, args.features, 10), batch_size=args.batch_size)
    ends = []
    model.train()
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ends.append(time.perf_counter())
    return ends


def run_plain_lightning(args: argparse.Namespace, root: Path, timing: bool = False) -> list[float]:
    torch.manual_seed(42)
    watch = Stopwatch()
    callbacks: list[Callback] = [StepTiming(plot=False), watch] if timing else [watch]
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, max_steps=args.steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks, default_root_dir=root)
    trainer.fit(BenchModule(args.features, args.hidden, args.layers),
                datamodule=BenchData(args.steps, args.batch_size, args.features))
    return watch.ends


def mlp_recipe(args: argparse.Namespace) -> list[str]:
    """The full recipe's CLI arguments for the benchmark's MLP and random data on ``args``' sizes, on one CPU."""
    return ["--model", "recipes.bench.BenchModule", "--model.features", str(args.features),
            "--model.hidden", str(args.hidden), "--model.layers", str(args.layers),
            "--data", "recipes.bench.BenchData", "--data.steps", str(args.steps),
            "--data.batch_size", str(args.batch_size), "--data.features", str(args.features),
            "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.max_epochs", "1",
            "--trainer.max_steps", str(args.steps), "--trainer.limit_val_batches", "1",
            "--experiment", "bench-overhead"]


def step_timing_cost_us(root: Path, steps: int = 300, rounds: int = 3) -> float:
    """StepTiming's cost per step in microseconds: a trivial model's step time with it minus without (best of)."""
    def run(timing: bool) -> float:
        watch = Stopwatch()
        callbacks: list[Callback] = [StepTiming(plot=False), watch] if timing else [watch]
        trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, max_steps=steps, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks, default_root_dir=root)
        data = DataLoader(random_set(steps, 4, 2), batch_size=1)
        trainer.fit(BenchModule(features=4, hidden=4, layers=1, classes=2), train_dataloaders=data)
        return (watch.ends[-1] - watch.ends[9]) / (steps - 10)

    best = {False: math.inf, True: math.inf}
    for _ in range(rounds):
        for timing in (False, True):
            best[timing] = min(best[timing], run(timing))
    return (best[True] - best[False]) * 1e6


def bench_overhead(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """The variants in ``args.variants`` (default all of :data:`VARIANTS`), interleaved round by round.

    With only ``b,c`` the two runs a ratio compares stand next to each other in every round and a round takes
    half the time: the machine's drift between them is smaller and more rounds fit in the same hour.
    """
    samples = args.batch_size
    keys = [key for key in VARIANTS if key in (args.variants or VARIANTS)]
    results: dict[str, list[float]] = {key: [] for key in keys}
    fit_s: list[float] = []
    max_rounds = max(args.rounds, args.max_rounds)
    ci: dict[str, tuple[float, float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        for index in range(max_rounds):
            runs = {"a": lambda: (run_plain_torch(args), 0.0), "b": lambda: (run_plain_lightning(args, root), 0.0),
                    "b+timing": lambda: (run_plain_lightning(args, root, timing=True), 0.0),
                    "c": lambda i=index: run_full_recipe(mlp_recipe(args), root, i)}
            for key in keys if index % 2 == 0 else keys[::-1]:  # no variant always follows another
                ends, seconds = runs[key]()
                if len(ends) != args.steps:
                    raise RuntimeError(f"variant {key} ran {len(ends)} steps, expected {args.steps}")
                results[key].append(window_throughput(ends, samples, args.warmup))
                if key == "c":
                    fit_s.append(seconds)
                console.print(f"round {index + 1} ({key}): {results[key][-1]:,.1f} samples/s, "
                              f"{samples / results[key][-1] * 1e3:.1f} ms/step", highlight=False)
            if index + 1 >= max(2, args.rounds):
                ci = {"c/b": bootstrap_ratio_ci(results["c"], results["b"])}
                if "a" in results:
                    ci["c/a"] = bootstrap_ratio_ci(results["c"], results["a"])
                if (verdict_with_floor(*ci["c/b"], GOAL_C_OVER_B, C_OVER_B_CI_FLOOR) != "inconclusive"
                        and ("c/a" not in ci or ci_settled(*ci["c/a"][1:], 1 - GOAL_C_OVER_A))):
                    break
        cost_us = step_timing_cost_us(root)
    best = {key: max(values) for key, values in results.items()}
    median = {key: statistics.median(values) for key, values in results.items()}
    verdicts = {"c/b": verdict_with_floor(*ci["c/b"], GOAL_C_OVER_B, C_OVER_B_CI_FLOOR) if ci else "inconclusive"}
    if "a" in results:
        verdicts["c/a"] = verdict(*ci["c/a"][1:], GOAL_C_OVER_A, 1 - GOAL_C_OVER_A) if ci else "inconclusive"

    return {"throughput": best, "median": median, "all": results, "rounds_run": len(results["c"]),
            "step_ms": {k: samples / v * 1e3 for k, v in best.items()},
            "ratios": overhead_ratios(best.get("a"), best["b"], best["c"]),
            "median_ratios": overhead_ratios(median.get("a"), median["b"], median["c"]),
            "ci95": {k: {"ratio": r, "low": lo, "high": hi} for k, (r, lo, hi) in ci.items()},
            "verdict": verdicts, "full_recipe_fit_s": fit_s,
            "timing_cost": best["b"] / best["b+timing"] - 1.0 if "b+timing" in best else None,
            "timing_cost_us": cost_us,
            "params": sum(p.numel() for p in mlp(args.features, args.hidden, args.layers, 10).parameters()),
            "settings": {**{k: getattr(args, k) for k in ("steps", "warmup", "rounds", "max_rounds", "batch_size",
                                                          "hidden", "layers", "features", "threads")},
                         "variants": keys}}


def bench_ablation(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """The full recipe with each default piece turned off in turn, rounds interleaved: what each piece costs."""
    samples = args.batch_size
    variants = ["full", *PIECES]
    throughput: dict[str, list[float]] = {v: [] for v in variants}
    fit_s: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        for index in range(args.rounds):
            order = variants if index % 2 == 0 else variants[::-1]  # no piece always runs first or last
            for variant in order:
                without = frozenset() if variant == "full" else frozenset({variant})
                ends, seconds = run_full_recipe(mlp_recipe(args), root, index, without)
                throughput[variant].append(window_throughput(ends, samples, args.warmup))
                fit_s[variant].append(seconds)
                console.print(f"round {index + 1}/{args.rounds} (without {variant}): "
                              f"{samples / throughput[variant][-1] * 1e3:.1f} ms/step, fit {seconds:.2f} s",
                              highlight=False)
    full_ms = samples / statistics.median(throughput["full"]) * 1e3
    full_fit = statistics.median(fit_s["full"])
    pieces = {}
    for piece in PIECES:
        ratio, low, high = bootstrap_ratio_ci(throughput[piece], throughput["full"])  # > 1: the piece costs
        ms = samples / statistics.median(throughput[piece]) * 1e3
        pieces[piece] = {"step_ms_without": ms, "step_cost_ms": full_ms - ms, "step_cost_frac": ratio - 1,
                         "ci95": [low - 1, high - 1], "fit_cost_s": full_fit - statistics.median(fit_s[piece])}
    return {"full_step_ms": full_ms, "full_fit_s": full_fit, "pieces": pieces,
            "all": throughput, "fit_s": fit_s,
            "settings": {k: getattr(args, k) for k in ("steps", "warmup", "rounds", "batch_size", "hidden",
                                                       "layers", "features", "threads")}}


def print_ablation(figures: dict[str, Any], console: Console) -> None:
    table = Table(title=f"What each piece of the full recipe costs — full recipe "
                        f"{figures['full_step_ms']:.1f} ms/step, "
                        f"fit {figures['full_fit_s']:.2f} s (medians of {figures['settings']['rounds']} interleaved "
                        "rounds; cost = full minus without)")
    for column in ("piece turned off", "ms/step without", "step cost", "step cost 95% CI", "fit wall cost"):
        table.add_column(column, justify="left" if column == "piece turned off" else "right")
    for piece, f in figures["pieces"].items():
        low, high = f["ci95"]
        table.add_row(PIECES[piece], f"{f['step_ms_without']:.1f}", f"{f['step_cost_ms']:+.2f} ms",
                      f"{low:+.1%} .. {high:+.1%}", f"{f['fit_cost_s']:+.2f} s")
    console.print(table)
    console.print("A step cost whose interval spans 0 is not distinguishable from noise at this many rounds.",
                  highlight=False)


def print_overhead(figures: dict[str, Any], console: Console) -> None:
    table = Table(title=f"Framework overhead — MLP with {figures['params'] / 1e6:.2f} M params, best of "
                        f"{figures.get('rounds_run', figures['settings']['rounds'])} interleaved rounds")
    for column in ("variant", "samples/s", "ms/step", "every round (samples/s)"):
        table.add_column(column, justify="right" if column != "variant" else "left")
    for key in figures["all"]:
        table.add_row(VARIANTS[key], f"{figures['throughput'][key]:,.1f}", f"{figures['step_ms'][key]:.2f}",
                      ", ".join(f"{v:,.0f}" for v in figures["all"][key]))
    console.print(table)
    r, m = figures["ratios"], figures["median_ratios"]
    names = [name for name in ("c/a", "c/b") if name in r]
    console.print(f"best rounds: {', '.join(f'{n} = {r[n]:.4f}' for n in names)}   "
                  f"[medians: {', '.join(f'{n} {m[n]:.4f}' for n in names)}]", highlight=False)
    goals = {"c/b": f"goal >= {GOAL_C_OVER_B} with the CI above {C_OVER_B_CI_FLOOR}", "c/a": f"goal >= {GOAL_C_OVER_A}"}
    for name, c in figures.get("ci95", {}).items():
        console.print(f"{name} (ratio of mean throughputs over {figures['rounds_run']} rounds) = {c['ratio']:.4f}, "
                      f"95% CI {c['low']:.4f} .. {c['high']:.4f} ({goals[name]}): {figures['verdict'][name]}",
                      highlight=False)
    step_us = figures["step_ms"]["b"] * 1e3
    cost = figures["timing_cost"]
    here = "" if cost is None else f"{cost:+.2%} of plain Lightning's step time here; "
    console.print(f"StepTiming alone: {here}measured on a trivial model it costs {figures['timing_cost_us']:.0f} us "
                  f"per step = {figures['timing_cost_us'] / step_us:.2%} of this {step_us / 1e3:.0f} ms step "
                  "(goal <= 1%).", highlight=False)
    spread = max(max(v) / min(v) - 1 for v in figures["all"].values())
    if spread > 0.02:
        console.print(f"[yellow]note: rounds of one variant differ by up to {spread:.1%}: the machine is busy; "
                      "ratios finer than that are noise (run with more --rounds on an idle machine)[/]")
    if min(figures["step_ms"].values()) < MIN_STEP_S * 1e3:
        console.print(f"[yellow]warning: steps under {MIN_STEP_S * 1e3:.0f} ms exaggerate fixed per-step costs; "
                      "raise --hidden or --batch-size[/]")


# ------------------------------------------------------------------- checkpoint runs
def run_checkpointing(args: argparse.Namespace, root: Path, mode: str) -> dict[str, Any]:
    """Train ``args.steps`` steps saving every ``args.every`` (``mode``: none, sync or async)."""
    torch.manual_seed(42)
    watch = Stopwatch()
    timer = StepTiming(warmup_steps=args.warmup, plot=False, log_every_n_steps=args.steps)
    callbacks: list[Callback] = [timer, watch]
    plugins: list[Any] = []
    dirpath = root / mode
    first = FirstSave(root / f"{mode}-first") if mode != "none" and args.warmup >= 2 else None
    if mode != "none":
        if first is not None:  # the first save falls in the warm-up, and its write ends there
            callbacks.insert(0, first)
        callbacks.append(ModelCheckpoint(dirpath=dirpath, every_n_train_steps=args.every, save_top_k=1,
                                         monitor=None, save_on_train_epoch_end=False, save_last=False))
        plugins.append(BoundedAsyncCheckpointIO(AtomicCheckpointIO()) if mode == "async" else AtomicCheckpointIO())
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, max_steps=args.steps, logger=False,
                      enable_checkpointing=mode != "none", enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks, plugins=plugins or None,
                      default_root_dir=root)
    model = BenchModule(args.features, args.hidden, args.layers, optimizer="sgd")  # SGD: no optimizer state
    trainer.fit(model, datamodule=BenchData(args.steps, args.batch_size, args.features))
    # saves inside the measured window (after the warm-up, before the last step's end)
    window = [i for i, (step, _) in enumerate(timer.checkpoint_log) if args.warmup < step < args.steps]
    events = [timer.checkpoint_log[i][1] for i in window]
    io = next((p for p in plugins if isinstance(p, BoundedAsyncCheckpointIO)), None)
    # each async save's wait for the previous write (the IO's record, one per save, in order)
    waits = [io.save_waits_s[i] for i in window] if io is not None else []
    staging = [blocked - waited for blocked, waited in zip(events, waits, strict=True)] if waits else []
    files = sorted(dirpath.glob("*.ckpt")) if mode != "none" else []
    state_bytes = files[-1].stat().st_size if files else sum(
        p.numel() * p.element_size() for p in model.parameters())
    loop_s = watch.ends[-1] - watch.ends[args.warmup - 1]
    return {"mode": mode, "loop_s": loop_s, "blocked": events, "waits": waits, "staging": staging,
            "state_bytes": state_bytes, "first_save_s": first.seconds if first else None,
            "step_ms": loop_s / (args.steps - args.warmup) * 1e3}


def copy_floor_s(args: argparse.Namespace, repeats: int = 5) -> dict[str, float]:
    """The memory-copy floor of the benchmark's state (see :func:`tensors_copy_floor`)."""
    state = [p.detach() for p in BenchModule(args.features, args.hidden, args.layers, optimizer="sgd").parameters()]
    return tensors_copy_floor(state, repeats)


def bench_checkpoint(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """No saves, sync and async saves, interleaved rounds until the effective ratio's CI settles."""
    runs: dict[str, list[dict[str, Any]]] = {"none": [], "sync": [], "async": []}
    max_rounds = max(args.rounds, args.max_rounds)
    ci = (math.nan, math.nan, math.nan)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        for index in range(max_rounds):
            for mode in list(runs) if index % 2 == 0 else list(runs)[::-1]:  # no writer always follows another
                run = run_checkpointing(args, root / f"round{index}", mode)
                runs[mode].append(run)
                extra = f", saves held the loop {', '.join(f'{b:.3f}' for b in run['blocked'])} s" \
                    if run["blocked"] else ""
                console.print(f"round {index + 1} ({mode}): {run['step_ms']:.1f} ms/step{extra}", highlight=False)
            if index + 1 >= max(2, args.rounds):
                ci = effective_stall_ci(*([r["loop_s"] for r in runs[mode]] for mode in runs),
                                        [len(r["blocked"]) for r in runs["sync"]])
                console.print(f"  async / sync effective stall so far: {ci[0]:.1%} (95% CI {ci[1]:.1%} .. "
                              f"{ci[2]:.1%})", highlight=False)
                if ci_settled(ci[1], ci[2], CHECKPOINT_MARGIN) or verdict_at_most(
                        ci[1], ci[2], GOAL_ASYNC_OVER_SYNC) != "inconclusive":
                    break
    stalls = {}
    for mode in ("sync", "async"):
        blocked = [b for r in runs[mode] for b in r["blocked"]]
        # every round's loop against the same round's loop without saves (as the CI pairs them)
        stalls[mode] = checkpoint_stall(blocked, sum(r["loop_s"] for r in runs[mode]),
                                        sum(r["loop_s"] for r in runs["none"]))
    floor = copy_floor_s(args)
    staging = [s for r in runs["async"] for s in r["staging"]]
    stalls["async"]["staging_s"] = statistics.median(staging) if staging else float("nan")
    stalls["async"]["waited_saves"] = sum(1 for r in runs["async"] for w in r["waits"] if w > 0)
    for mode in ("sync", "async"):
        firsts = [r["first_save_s"] for r in runs[mode] if r["first_save_s"] is not None]
        stalls[mode]["first_save_s"] = statistics.median(firsts) if firsts else float("nan")
    ratio = async_over_sync(stalls["sync"], stalls["async"])
    ratio["effective_ratio"], low, high = ci
    ratio["verdict"] = verdict_at_most(low, high, GOAL_ASYNC_OVER_SYNC)
    ratio["ok"] = ratio["verdict"] == "met"
    ratio["effective_ci95"] = [low, high]
    baseline = statistics.median(r["loop_s"] for r in runs["none"])
    return {"stalls": stalls, "ratio": ratio, "floor": floor, "rounds_run": len(runs["none"]),
            "state_mb": runs["sync"][0]["state_bytes"] / 1e6, "baseline_step_ms": baseline /
            (args.steps - args.warmup) * 1e3, "load_average": list(os.getloadavg()),
            "settings": {k: getattr(args, k) for k in ("steps", "warmup", "every", "rounds", "max_rounds",
                                                       "batch_size", "hidden", "layers", "features", "threads")}}


def print_checkpoint(figures: dict[str, Any], console: Console) -> None:
    table = Table(title=f"Checkpoint stall — {figures['state_mb']:.0f} MB checkpoint, "
                        f"{figures['baseline_step_ms']:.1f} ms steps without saving")
    for column in ("writer", "saves", "blocked per save", "max blocked", "effective per save"):
        table.add_column(column, justify="right" if column != "writer" else "left")
    for mode, name in (("sync", "sync (AtomicCheckpointIO)"), ("async", "async (BoundedAsyncCheckpointIO)")):
        s = figures["stalls"][mode]
        table.add_row(name, str(s["checkpoints"]), f"{s['blocked_s'] * 1e3:.1f} ms",
                      f"{s['blocked_max_s'] * 1e3:.1f} ms", f"{s['effective_s'] * 1e3:.1f} ms")
    console.print(table)
    r = figures["ratio"]
    f = figures.get("floor")
    if f:
        console.print(f"memory-copy floor (same state, same run): copy_ into a preallocated buffer "
                      f"{f['copy_s'] * 1e3:.1f} ms ({f['bytes'] / f['copy_s'] / 1e9:.1f} GB/s), clone() "
                      f"{f['clone_s'] * 1e3:.1f} ms; async blocked stall / floor = "
                      f"{figures['stalls']['async']['blocked_s'] / f['copy_s']:.2f}x", highlight=False)
    low, high = r["effective_ci95"]
    console.print(f"async / sync: blocked {r['blocked_ratio']:.1%}, effective {r['effective_ratio']:.1%} (95% CI "
                  f"{low:.1%} .. {high:.1%}, {figures['rounds_run']} rounds; goal <= {GOAL_ASYNC_OVER_SYNC:.0%}): "
                  f"{r['verdict']}; load average at the end "
                  f"{', '.join(f'{v:.2f}' for v in figures['load_average'])}", highlight=False)
    a = figures["stalls"]["async"]
    if f:
        console.print(f"async staging (the copy, without waiting for the previous write): median "
                      f"{a['staging_s'] * 1e3:.1f} ms = {a['staging_s'] / f['copy_s']:.2f}x the floor (goal <= "
                      f"{GOAL_STAGING_OVER_FLOOR:g}x: "
                      f"{'met' if a['staging_s'] <= GOAL_STAGING_OVER_FLOOR * f['copy_s'] else 'MISSED'}); "
                      f"{a['waited_saves']} of {a['checkpoints']} saves first waited for the previous one "
                      "(storage slower than the save interval)", highlight=False)
    s = figures["stalls"]["sync"]
    if not math.isnan(a.get("first_save_s", math.nan)):
        console.print(f"each run's first save, after its first step (outside the timed window; the async one "
                      f"allocates the staging buffer): sync {s['first_save_s'] * 1e3:.1f} ms, async "
                      f"{a['first_save_s'] * 1e3:.1f} ms (medians)", highlight=False)



# ------------------------------------------------------------- default recipe's fit
DIGITS_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "digits.yaml"
#: Goal: the default digits recipe's ``trainer.fit`` at most this many times plain Lightning's.
GOAL_FIT_RATIO = 1.15
#: Width of the fit ratio's 95 % CI below which more rounds stop.
FIT_MARGIN = 0.05


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


def recipe_digits_fit(epochs: int, root: Path, index: int,
                      without: frozenset[str] = frozenset()) -> dict[str, float]:
    """The default digits recipe (less ``without``): ``trainer.fit`` seconds and the CLI's whole fit flow's."""
    watch = Stopwatch()
    recipe = ["--config", str(DIGITS_CONFIG), "--experiment", "bench-fit", "--trainer.max_epochs", str(epochs)]
    _, flow_s = run_full_recipe(recipe, root, index, without, watch=watch)
    assert watch.fit_s is not None
    return {"fit_s": watch.fit_s, "flow_s": flow_s}


def bench_fit(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """The recipe's and plain Lightning's ``trainer.fit``, interleaved rounds until the ratio's CI settles."""
    plain: list[float] = []
    recipe: list[dict[str, float]] = []
    max_rounds = max(args.rounds, args.max_rounds)
    ci = (math.nan, math.nan, math.nan)
    with tempfile.TemporaryDirectory() as tmp, own_store(Path(args.out or tmp)) as root:
        for index in range(max_rounds):
            for key in ("plain", "recipe") if index % 2 == 0 else ("recipe", "plain"):
                if key == "plain":
                    plain.append(plain_digits_fit(args.epochs, root))
                else:
                    recipe.append(recipe_digits_fit(args.epochs, root, index))
            console.print(f"round {index + 1}: trainer.fit recipe {recipe[-1]['fit_s']:.2f} s (its whole fit flow "
                          f"{recipe[-1]['flow_s']:.2f} s), plain Lightning {plain[-1]:.2f} s", highlight=False)
            if index + 1 >= max(2, args.rounds):
                # plain / recipe >= 1 / goal  <=>  recipe / plain <= goal
                speed, low, high = bootstrap_ratio_ci(plain, [r["fit_s"] for r in recipe])
                ci = (1 / speed, 1 / high, 1 / low)
                if ci_settled(ci[1], ci[2], FIT_MARGIN):
                    break
    ratio, low, high = ci
    result = verdict(1 / high, 1 / low, 1 / GOAL_FIT_RATIO, FIT_MARGIN / GOAL_FIT_RATIO) if not math.isnan(ratio) \
        else "inconclusive"
    return {"recipe_fit_s": [r["fit_s"] for r in recipe], "recipe_flow_s": [r["flow_s"] for r in recipe],
            "plain_fit_s": plain, "ratio": ratio, "ci95": [low, high], "verdict": result, "goal": GOAL_FIT_RATIO,
            "rounds_run": len(plain), "load_average": list(os.getloadavg()),
            "settings": {k: getattr(args, k) for k in ("epochs", "rounds", "max_rounds", "threads")}}


def print_fit(figures: dict[str, Any], console: Console) -> None:
    table = Table(title=f"Default digits recipe vs plain Lightning, trainer.fit of {figures['settings']['epochs']} "
                        f"epochs with validation ({figures['rounds_run']} interleaved rounds)")
    for column in ("variant", "median s", "every round (s)"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for name, key in (("plain Lightning trainer.fit", "plain_fit_s"), ("recipe trainer.fit", "recipe_fit_s"),
                      ("recipe's whole fit flow (MLflow run, fit, flush, summary)", "recipe_flow_s")):
        table.add_row(name, f"{statistics.median(figures[key]):.2f}", ", ".join(f"{v:.2f}" for v in figures[key]))
    console.print(table)
    low, high = figures["ci95"]
    console.print(f"recipe / plain trainer.fit = {figures['ratio']:.3f}, 95% CI {low:.3f} .. {high:.3f} (goal <= "
                  f"{figures['goal']}): {figures['verdict']}; load average at the end "
                  f"{', '.join(f'{v:.2f}' for v in figures['load_average'])}", highlight=False)


def bench_fit_ablation(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """The digits recipe's trainer.fit with each default piece turned off in turn (see :data:`PIECES`)."""
    pieces = args.pieces or list(PIECES)
    variants = ["full", *pieces]
    fit_s: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp, own_store(Path(args.out or tmp)) as root:
        for index in range(args.rounds):
            for variant in variants if index % 2 == 0 else variants[::-1]:
                without = frozenset() if variant == "full" else frozenset({variant})
                fit_s[variant].append(recipe_digits_fit(args.epochs, root, index, without)["fit_s"])
                console.print(f"round {index + 1}/{args.rounds} (without {variant}): trainer.fit "
                              f"{fit_s[variant][-1]:.2f} s", highlight=False)
    full = statistics.median(fit_s["full"])
    return {"full_fit_s": full, "fit_s": fit_s, "load_average": list(os.getloadavg()),
            "cost_s": {piece: full - statistics.median(fit_s[piece]) for piece in pieces},
            "settings": {k: getattr(args, k) for k in ("epochs", "rounds", "threads")}}


def print_fit_ablation(figures: dict[str, Any], console: Console) -> None:
    table = Table(title=f"What each piece adds to the digits recipe's trainer.fit ({figures['full_fit_s']:.2f} s, "
                        f"medians of {figures['settings']['rounds']} interleaved rounds; cost = full minus without)")
    for column in ("piece turned off", "trainer.fit without (s)", "cost (s)"):
        table.add_column(column, justify="left" if column == "piece turned off" else "right")
    for piece, cost in figures["cost_s"].items():
        table.add_row(PIECES[piece], f"{statistics.median(figures['fit_s'][piece]):.2f}", f"{cost:+.2f}")
    console.print(table)


# ------------------------------------------------------------------- CPU contention
#: A thread setting compared by ``contention``: its name, the worker's arguments, and the OpenMP environment.
#: GNU OpenMP (torch's on Linux) spins ``GOMP_SPINCOUNT`` times (300,000 by default) before a waiting thread
#: sleeps; ``OMP_WAIT_POLICY=PASSIVE`` makes it sleep at once.
CONTENTION_SETTINGS: tuple[tuple[str, list[str], dict[str, str]], ...] = (
    ("auto (torch's count, held; threads spin: the default)", [], {}),
    ("passive", [], {"OMP_WAIT_POLICY": "PASSIVE"}),
    ("spin10k (GOMP_SPINCOUNT=10000)", [], {"GOMP_SPINCOUNT": "10000"}),
    ("1 thread", ["--worker-threads", "1"], {}),
    ("adaptive (AdaptiveCpuThreads: not bitwise resumable)", ["--worker-adaptive"], {}),
    ("DDP-2 (Lightning: 1 thread each)", ["--worker-devices", "2"], {}))
#: The setting the quiet-speed goal compares with: the default, torch's spinning threads.
CONTENTION_REFERENCE = CONTENTION_SETTINGS[0][0]
#: OpenMP variables the benchmark sets per setting (and so clears from the inherited environment).
_OPENMP_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_BUSY_LOOP = "while True:\n    pass\n"


def contention_worker(steps: int, warmup: int, threads: int | None, adaptive: bool = False,
                      devices: int = 1) -> float | None:
    """Mean ms per step (wall time of the timed window) of the default digits recipe's model and data.

    Plain Lightning in this process (with ``devices`` > 1, Lightning's DDP launcher starts the others);
    ``adaptive`` adds :class:`~callbacks.cpu_threads.AdaptiveCpuThreads`, as ``--cpu_threads adaptive`` does.
    ``None`` on every rank but 0.
    """
    from callbacks.cpu_threads import AdaptiveCpuThreads
    from datamodules.digits import DigitsDataModule
    from recipes.classifier import ImageClassifier

    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(42)
    watch = Stopwatch()
    callbacks: list[Callback] = [watch] + ([AdaptiveCpuThreads()] if adaptive else [])
    trainer = Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                      max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks)
    trainer.fit(ImageClassifier(num_classes=10, in_channels=1, width=32, dropout=0.1),
                datamodule=DigitsDataModule(batch_size=32))
    destroy_process_group()  # and main's run_and_exit ends the process (recipes.shutdown says why)
    if trainer.global_rank != 0:
        return None
    # the mean, not the median: the steps a setting loses to a busy neighbour (or to probing) all count
    return (watch.ends[-1] - watch.ends[warmup - 1]) / (len(watch.ends) - warmup) * 1e3


def _run_worker(args: argparse.Namespace, worker_args: list[str], openmp: dict[str, str]) -> float:
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in _OPENMP_ENV}
    env.update(openmp)  # read by OpenMP when torch starts: a fresh process per setting
    command = [sys.executable, "-m", "recipes.bench", "_contention_worker", "--steps", str(args.steps),
               "--warmup", str(args.warmup), *worker_args]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=600)
    return float(out.stdout.strip().splitlines()[-1])


def bench_contention(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Each thread setting quiet and beside one busy-loop process, rounds interleaved (medians of the rounds)."""
    import subprocess

    settings = [s for s in CONTENTION_SETTINGS if args.settings is None or s[0].split()[0].rstrip(",") in args.settings]
    figures: dict[str, dict[str, list[float]]] = {name: {"quiet": [], "contended": []} for name, _, _ in settings}
    for index in range(args.rounds):
        for name, worker_args, openmp in settings:
            figures[name]["quiet"].append(_run_worker(args, worker_args, openmp))
            hog = subprocess.Popen([sys.executable, "-c", _BUSY_LOOP])
            try:
                figures[name]["contended"].append(_run_worker(args, worker_args, openmp))
            finally:
                hog.kill()
                hog.wait()
            console.print(f"round {index + 1}/{args.rounds} ({name}): quiet {figures[name]['quiet'][-1]:.1f} ms/step, "
                          f"contended {figures[name]['contended'][-1]:.1f} ms/step", highlight=False)
    reference = figures.get(CONTENTION_REFERENCE)
    today = statistics.median(reference["quiet"]) if reference else None
    rows = {}
    for name, f in figures.items():
        quiet, contended = statistics.median(f["quiet"]), statistics.median(f["contended"])
        # a DDP step is another step (half the batch per process, plus the all-reduce): busy/quiet only
        vs_today = quiet / today if today and not name.startswith("DDP") else None
        rows[name] = {"quiet_ms": quiet, "contended_ms": contended, "ratio": contended / quiet,
                      "quiet_vs_today": vs_today, "all": f,
                      "ok": contended / quiet <= 2.0 and (vs_today is None or vs_today <= 1.10)}
    return {"settings": rows, "cores": os.cpu_count(), "steps": args.steps, "rounds": args.rounds}


def print_contention(figures: dict[str, Any], console: Console) -> None:
    table = Table(title=f"Digits recipe, mean ms per step quiet and beside one busy-loop process (busy), "
                        f"{figures['cores']} cores, {figures['steps']} steps; medians of {figures['rounds']} rounds")
    for column in ("setting", "quiet ms", "busy ms", "busy/quiet", "quiet/spin", "goal"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for name, r in figures["settings"].items():
        vs_today = f"{r['quiet_vs_today']:.2f}x" if r["quiet_vs_today"] is not None else "-"
        table.add_row(name, f"{r['quiet_ms']:.1f}", f"{r['contended_ms']:.1f}", f"{r['ratio']:.2f}x",
                      vs_today, "met" if r["ok"] else "missed")
    console.print(table)
    console.print("Goal: busy <= 2x quiet, and quiet within 10% of torch's default (spinning threads).",
                  highlight=False)


# --------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0] if __doc__ else None,
                            formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    over = sub.add_parser("overhead", help="plain PyTorch vs plain Lightning vs the full recipe",
                          description="Throughput of one MLP trained as (a) a plain PyTorch loop, (b) plain "
                                      f"Lightning, (c) the full recipe; goals c/b >= {GOAL_C_OVER_B} with its 95% CI "
                                      f"above {C_OVER_B_CI_FLOOR}, c/a >= {GOAL_C_OVER_A}.",
                          formatter_class=HelpFormatter)
    over.add_argument("--steps", type=int, default=40, help="optimizer steps per variant and round, warm-up included")
    over.add_argument("--warmup", type=int, default=10, help="steps before the throughput window opens")
    over.add_argument("--rounds", type=int, default=3,
                      help="rounds of all variants, interleaved (at least this many; the best round of each is "
                           "shown, the bootstrap CI of the mean ratio decides)")
    over.add_argument("--max-rounds", dest="max_rounds", type=int, default=15,
                      help="keep adding rounds until both verdicts are decided (c/b met or missed, c/a's CI narrower "
                           f"than {(1 - GOAL_C_OVER_A) * 100:.0f}%%), or this many rounds: then the verdict may say "
                           "'inconclusive'")
    over.add_argument("--variants", type=lambda text: [p for p in text.split(",") if p], default=None,
                      help=f"only these variants, comma-separated, b and c among them ({','.join(VARIANTS)}; "
                           "default all): 'b,c' puts the two runs c/b compares side by side in every round")
    over.add_argument("--ablate", action="store_true",
                      help="instead: the full recipe with each default piece (MLflow, system metrics, progress "
                           "bar, spot, cost, checkpointing, baselines, manifest, model logging, StepTiming) "
                           "turned off in turn, --rounds interleaved rounds; prints what each costs")
    over.add_argument("--batch-size", dest="batch_size", type=int, default=256, help="samples per step")
    over.add_argument("--features", type=int, default=1024, help="input features of the MLP")
    over.add_argument("--hidden", type=int, default=1536, help="width of the MLP's hidden layers")
    over.add_argument("--layers", type=int, default=2, help="hidden layers of the MLP")
    ckpt = sub.add_parser("checkpoint", help="periodic checkpoint stall, sync vs async",
                          description="How long periodic checkpoints stall the training loop, synchronous vs "
                                      "asynchronous writer; goals: async effective <= 10% of sync, staging <= 2x the "
                                      "memory-copy floor.",
                          formatter_class=HelpFormatter)
    ckpt.add_argument("--steps", type=int, default=40, help="optimizer steps per writer and round, warm-up included")
    ckpt.add_argument("--warmup", type=int, default=5, help="steps before the timed window (their saves not counted)")
    ckpt.add_argument("--every", type=int, default=10, help="save a checkpoint every this many steps")
    ckpt.add_argument("--rounds", type=int, default=3,
                      help="rounds of each writer (none, sync, async), interleaved (at least this many)")
    ckpt.add_argument("--max-rounds", dest="max_rounds", type=int, default=12,
                      help="add rounds until the 95%% CI of the async/sync effective stall lies wholly below or "
                           f"above the goal or is narrower than {CHECKPOINT_MARGIN:g}, or this many rounds")
    ckpt.add_argument("--batch-size", dest="batch_size", type=int, default=8, help="samples per step")
    ckpt.add_argument("--features", type=int, default=4096, help="input features of the MLP")
    ckpt.add_argument("--hidden", type=int, default=4096,
                      help="width of the hidden layers: 2 x Linear(4096, 4096) is 134 MB of fp32 state")
    ckpt.add_argument("--layers", type=int, default=2, help="hidden layers of the MLP (the checkpointed state)")
    chaos.add_arguments(sub.add_parser("chaos", help="seeded random faults on one digits run, relaunched after "
                                                     "each, then checked (see recipes/soak/)"))
    cont = sub.add_parser("contention", help="the digits recipe's step quiet and beside a busy process, per "
                                             "CPU thread setting", formatter_class=HelpFormatter,
                          description="Step time of the default digits recipe's model and data, quiet and beside one "
                                      "CPU-bound busy loop, for torch's default threads (spinning waits: the "
                                      "default --cpu_threads auto), OMP_WAIT_POLICY=PASSIVE, a short spin "
                                      "(GOMP_SPINCOUNT=10000), one thread, --cpu_threads adaptive, and DDP on 2 "
                                      "processes.")
    cont.add_argument("--steps", type=int, default=400, help="optimizer steps per run, warm-up included")
    cont.add_argument("--settings", type=lambda text: [p for p in text.split(",") if p], default=None,
                      help="only these settings, by first word (auto,passive,spin10k,1,adaptive,DDP-2)")
    cont.add_argument("--warmup", type=int, default=10, help="steps before the timed window")
    cont.add_argument("--rounds", type=int, default=3, help="rounds of every setting, interleaved; medians shown")
    cont.add_argument("--json", action="store_true", help="print the figures as JSON")
    bench_compression.add_arguments(sub.add_parser(
        "compression", help="dense, fp16, PowerSGD and top-k on the digits recipe, 2 processes: bytes, step, accuracy",
        formatter_class=HelpFormatter, description=(bench_compression.__doc__ or "").splitlines()[0]))
    from recipes import bench_gpu

    bench_gpu.add_arguments(sub.add_parser(
        "gpu", help="the GPU check: gpt-124m tokens/s and MFU, recipe overhead, StepTiming's CUDA clock, "
                    "checkpoint stall vs a pinned copy (a cpu reduced mode without a GPU)",
        description=bench_gpu.__doc__.splitlines()[0] if bench_gpu.__doc__ else None, formatter_class=HelpFormatter))
    bench_lm.add_arguments(sub.add_parser(
        "lm", help="the GPT recipe's step and trainer.fit vs plain Lightning's and a plain PyTorch loop's",
        description=bench_lm.__doc__.splitlines()[0] if bench_lm.__doc__ else None, formatter_class=HelpFormatter))
    bench_startup.add_arguments(sub.add_parser(
        "startup", help="a launch's time to its first step and to exit, phase by phase (fresh and relaunch)",
        description=bench_startup.__doc__.splitlines()[0] if bench_startup.__doc__ else None,
        formatter_class=HelpFormatter))
    fit = sub.add_parser("fit", help="the default digits recipe's trainer.fit vs plain Lightning's, side by side",
                         formatter_class=HelpFormatter,
                         description="trainer.fit of `python -m recipes.fit --config configs/digits.yaml` (in this "
                                     "process) and of plain Lightning on the same ImageClassifier, DigitsDataModule, "
                                     "epochs and validation (no logger, checkpointing or progress bar), interleaved "
                                     f"rounds; goal recipe <= {GOAL_FIT_RATIO}x plain.")
    fit.add_argument("--epochs", type=int, default=20, help="epochs of both fits (the recipe's default)")
    fit.add_argument("--rounds", type=int, default=3, help="rounds of both, interleaved (at least this many)")
    fit.add_argument("--max-rounds", dest="max_rounds", type=int, default=9,
                     help=f"add rounds until the 95%% CI of the ratio is narrower than {FIT_MARGIN}, or this many")
    fit.add_argument("--ablate", action="store_true",
                     help="instead: the recipe's trainer.fit with each default piece turned off in turn")
    fit.add_argument("--pieces", type=lambda text: [p for p in text.split(",") if p], default=None,
                     help=f"with --ablate: only these pieces, comma-separated ({', '.join(PIECES)})")
    worker = sub.add_parser("_contention_worker")  # one setting in a fresh process (internal)
    worker.add_argument("--steps", type=int, default=60)
    worker.add_argument("--warmup", type=int, default=10)
    worker.add_argument("--worker-threads", dest="worker_threads", type=int, default=None)
    worker.add_argument("--worker-adaptive", dest="worker_adaptive", action="store_true")
    worker.add_argument("--worker-devices", dest="worker_devices", type=int, default=1)
    for p in (over, ckpt, fit):
        p.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
        p.add_argument("--out", default=None, help="keep run files here (default: a temporary directory)")
        p.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command == "chaos":
            return chaos.main(args)
        if args.command == "compression":
            return bench_compression.run(args)
        if args.command == "lm":
            return bench_lm.run(args)
        if args.command == "startup":
            return bench_startup.run(args)
        if args.command == "_contention_worker":
            logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
            warnings.filterwarnings("ignore")
            mean_ms = contention_worker(args.steps, args.warmup, args.worker_threads, args.worker_adaptive,
                                        args.worker_devices)
            if mean_ms is not None:
                print(mean_ms)
            return 0
        if args.command == "gpu":
            from recipes import bench_gpu

            logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
            warnings.filterwarnings("ignore")
            return bench_gpu.main(args, Console(stderr=True))
        if args.command == "contention":
            if args.steps <= args.warmup + 1 or args.rounds < 1 or args.warmup < 1:
                raise UsageError("contention needs --rounds >= 1, --warmup >= 1 and --steps > --warmup + 1")
            console = Console(stderr=args.json)
            figures = bench_contention(args, console)
            if args.json:
                print(json.dumps(figures, indent=2, default=float))
            else:
                print_contention(figures, console)
            return 0
        if args.command == "fit":
            unknown = [p for p in args.pieces or [] if p not in PIECES]
            if unknown:
                raise UsageError(f"--pieces {','.join(unknown)}: not one of {', '.join(PIECES)}")
            for name in ("epochs", "rounds", "max_rounds", "threads"):
                if getattr(args, name) < 1:
                    raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
        if args.command == "overhead" and args.variants is not None:
            unknown = [v for v in args.variants if v not in VARIANTS]
            if unknown or not {"b", "c"} <= set(args.variants):
                raise UsageError(f"--variants {','.join(args.variants)}: each one of {', '.join(VARIANTS)}, "
                                 "with b and c among them")
        for name in ("steps", "rounds", "batch_size", "hidden", "layers", "features", "threads", "warmup"):
            if args.command != "fit" and getattr(args, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
        if args.command != "fit" and args.steps <= args.warmup:
            raise UsageError(f"--steps {args.steps} must exceed --warmup {args.warmup}")
        if args.command == "checkpoint" and not 1 <= args.every < args.steps - args.warmup:
            raise UsageError(f"--every {args.every}: needs at least one save after the {args.warmup} warm-up "
                             f"steps of {args.steps}")
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    console = Console(stderr=args.json)
    if args.command == "fit" and args.ablate:
        figures = bench_fit_ablation(args, console)
        printer = print_fit_ablation
    elif args.command == "fit":
        figures = bench_fit(args, console)
        printer = print_fit
    elif args.command == "overhead" and args.ablate:
        figures = bench_ablation(args, console)
        printer = print_ablation
    elif args.command == "overhead":
        figures = bench_overhead(args, console)
        printer = print_overhead
    else:
        figures = bench_checkpoint(args, console)
        printer = print_checkpoint
    if args.json:
        print(json.dumps(figures, indent=2, default=float))
    else:
        printer(figures, console)
    return 0


if __name__ == "__main__":
    run_and_exit(main)
