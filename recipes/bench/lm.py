"""``python -m recipes.bench lm``: what the language-model recipe costs over plain Lightning and a plain loop.

The same ``recipes.gpt.GPT``, ``TextDataModule``, optimizer, steps, validation interval and gradient
clipping as ``configs/gpt.yaml``, three ways, interleaved round by round in this process:

- ``torch``: a plain PyTorch loop (forward, backward, clip, AdamW, the warm-up schedule; validation on
  the same interval);
- ``lightning``: plain Lightning (no logger, checkpoints, progress bar or callbacks);
- ``recipe``: ``python -m recipes.fit --config configs/gpt.yaml`` (every default piece: MLflow, LM
  baselines, token throughput, step timing, spot, cost, checkpoints, progress bar).

The variants run in every order in turn (with three: six orders), so none is always first, last or
between the same two while the machine's speed drifts. Each round gives the median step interval (the
time per step, validation steps aside by the median) and the whole ``trainer.fit``; the ratios' 95 %
intervals come from a bootstrap over paired rounds. Each run also reads its threads' CPU time over the
step window (:mod:`recipes.bench.threads`): what runs beside the step, which no ablation resolves.
Goals: the recipe's step at most ``GOAL_STEP_RATIO`` of plain Lightning's, its ``trainer.fit`` at most
``GOAL_FIT_RATIO``. ``--ablate`` instead turns the recipe's pieces off one at a time::

    python -m recipes.bench lm --steps 300 --rounds 5 --max-rounds 9
    python -m recipes.bench lm --variants lightning,recipe --steps 100 --rounds 90 --max-rounds 90
    python -m recipes.bench lm --steps 300 --rounds 3 --ablate
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import yaml
from lightning.pytorch import Trainer
from rich.console import Console
from rich.table import Table

from recipes.bench.output import emit
from recipes.bench.runs import PIECES, Stopwatch, from_spec, own_store, run_full_recipe
from recipes.bench.stats import bracketed_rounds, ci_settled, median_ratio, time_ratio_ci, verdict_at_most
from recipes.bench.threads import NATIVE, ThreadCpuWindow
from recipes.run.common import UsageError

GPT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gpt.yaml"
#: Goal: the full recipe's time per step at most this many times plain Lightning's.
GOAL_STEP_RATIO = 1.03
#: Goal: the full recipe's ``trainer.fit`` at most this many times plain Lightning's.
GOAL_FIT_RATIO = 1.10
#: Width of the step ratio's 95 % CI below which more rounds stop (narrower than the 3 % goal's margin).
STEP_MARGIN = 0.02
#: Steps at the start of a run left out of its median step (first-call allocations, the sanity check).
WARMUP_STEPS = 5
VARIANTS = ("torch", "lightning", "recipe")
#: The pieces ``--ablate`` turns off by default: the LM recipe's own and the ones every recipe has.
LM_PIECES = ("lm_baselines", "token_throughput", "timing", "spot", "cost", "mlflow", "system_metrics",
             "checkpointing", "progress_bar", "manifest", "log_model")


def _gpt_parts(steps: int) -> tuple[pl.LightningModule, pl.LightningDataModule, dict[str, Any]]:
    """The GPT module and text data of ``configs/gpt.yaml``, seeded as the recipe seeds them."""
    from datamodules.text import TextDataModule
    from recipes.gpt import GPT

    cfg = yaml.safe_load(GPT_CONFIG.read_text())
    init = dict(cfg["model"]["init_args"])
    optimizer = from_spec(init.pop("optimizer"))
    pl.seed_everything(cfg["seed_everything"], verbose=False)
    model = GPT(**init, optimizer=optimizer)
    trainer_cfg = {"max_steps": steps, "val_check_interval": min(cfg["trainer"]["val_check_interval"], steps),
                   "gradient_clip_val": cfg["trainer"]["gradient_clip_val"]}
    return model, TextDataModule(**cfg["data"]["init_args"]), trainer_cfg


def _median_step_s(ends: list[float]) -> float:
    intervals = [b - a for a, b in zip(ends[WARMUP_STEPS:], ends[WARMUP_STEPS + 1:], strict=False)]
    return statistics.median(intervals) if intervals else math.nan


def plain_lightning(steps: int, root: Path) -> dict[str, float]:
    """Plain Lightning on the recipe's module and data: ``trainer.fit`` seconds and the median step."""
    model, data, trainer_cfg = _gpt_parts(steps)
    watch = Stopwatch()  # one perf_counter a step, and the threads' CPU read twice: the only callbacks
    threads = ThreadCpuWindow(WARMUP_STEPS + 1, steps)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[watch, threads],
                      default_root_dir=root, **trainer_cfg)
    with open(root / "lightning.log", "a") as log_file, contextlib.redirect_stdout(log_file):
        started = time.perf_counter()
        trainer.fit(model, datamodule=data)
        fit_s = time.perf_counter() - started
    return {"fit_s": fit_s, "step_s": _median_step_s(watch.ends), "threads": threads.shares}


def plain_torch(steps: int, root: Path) -> dict[str, float]:
    """A plain PyTorch loop on the recipe's module, data, optimizer, schedule, clipping and validation."""
    model, data, trainer_cfg = _gpt_parts(steps)
    model.configure_model()
    data.setup("fit")
    decay = [p for n, p in model.transformer.named_parameters() if p.dim() >= 2 and not n.startswith("wpe.")]
    no_decay = [p for n, p in model.transformer.named_parameters() if not (p.dim() >= 2 and not n.startswith("wpe."))]
    optimizer = model.optimizer_factory([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
    from functools import partial

    from recipes.gpt import lr_factor

    hp = model.hparams
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(
        lr_factor, warmup_steps=hp.warmup_steps, decay_steps=steps, min_ratio=hp.min_lr_ratio))
    ends: list[float] = []
    every = trainer_cfg["val_check_interval"]
    started = time.perf_counter()
    model.train()
    for step, batch in enumerate(data.train_dataloader(), start=1):
        loss = model.loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), trainer_cfg["gradient_clip_val"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
        if step % every == 0:
            model.eval()
            with torch.no_grad():
                for val_batch in data.val_dataloader():
                    model.loss(val_batch)
            model.train()
        if step >= steps:
            break
    return {"fit_s": time.perf_counter() - started, "step_s": _median_step_s(ends)}


def full_recipe(steps: int, root: Path, index: int, without: frozenset[str] = frozenset(),
                keep_files: bool = True) -> dict[str, float]:
    """``python -m recipes.fit --config configs/gpt.yaml`` in this process (less ``without``)."""
    watch = Stopwatch()
    threads = ThreadCpuWindow(WARMUP_STEPS + 1, steps)
    recipe = ["--config", str(GPT_CONFIG), "--experiment", "bench-lm", "--trainer.max_steps", str(steps),
              "--trainer.val_check_interval", str(min(100, steps))]
    ends, flow_s = run_full_recipe(recipe, root, index, without, watch=watch, also=[threads], keep_files=keep_files)
    assert watch.fit_s is not None
    return {"fit_s": watch.fit_s, "step_s": _median_step_s(ends), "flow_s": flow_s, "threads": threads.shares}


def round_order(variants: list[str], index: int) -> tuple[str, ...]:
    """Round ``index``'s order of ``variants``: every order in turn, so each variant stands in every place
    (first, last, between any two others) equally often over ``len(variants)!`` rounds."""
    orders = list(itertools.permutations(variants))
    return orders[index % len(orders)]


def bench_lm(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """The three variants, interleaved, until the step ratio's CI is narrower than ``STEP_MARGIN``."""
    variants = [v for v in VARIANTS if v in (args.variants or VARIANTS)]
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    step_ci = fit_ci = (math.nan, math.nan, math.nan)
    with tempfile.TemporaryDirectory() as tmp, own_store(Path(args.out or tmp)) as root:
        for index in range(max(args.rounds, args.max_rounds)):
            for variant in round_order(variants, index):
                if variant == "torch":
                    runs[variant].append(plain_torch(args.steps, root))
                elif variant == "lightning":
                    runs[variant].append(plain_lightning(args.steps, root))
                else:
                    runs[variant].append(full_recipe(args.steps, root, index, keep_files=args.out is not None))
            last = {v: runs[v][-1] for v in variants}
            console.print(f"round {index + 1}: ms/step "
                          + ", ".join(f"{v} {last[v]['step_s'] * 1e3:.1f}" for v in variants)
                          + f"; trainer.fit s lightning {last['lightning']['fit_s']:.1f}, recipe "
                          f"{last['recipe']['fit_s']:.1f}", highlight=False)
            if index + 1 >= max(2, args.rounds):
                step_ci = time_ratio_ci([r["step_s"] for r in runs["recipe"]], [r["step_s"] for r in runs["lightning"]])
                fit_ci = time_ratio_ci([r["fit_s"] for r in runs["recipe"]], [r["fit_s"] for r in runs["lightning"]])
                if ci_settled(step_ci[1], step_ci[2], STEP_MARGIN):
                    break
    tokens = _tokens_per_step()
    medians = {what: median_ratio([r[f"{what}_s"] for r in runs["recipe"]], [r[f"{what}_s"] for r in runs["lightning"]])
               for what in ("step", "fit")}
    return {"runs": runs, "tokens_per_step": tokens,
            "step_median_ratio": medians["step"], "fit_median_ratio": medians["fit"],
            "step_ratio": step_ci[0], "step_ci95": list(step_ci[1:]),
            "step_verdict": verdict_at_most(step_ci[1], step_ci[2], GOAL_STEP_RATIO),
            "fit_ratio": fit_ci[0], "fit_ci95": list(fit_ci[1:]),
            "fit_verdict": verdict_at_most(fit_ci[1], fit_ci[2], GOAL_FIT_RATIO),
            "rounds_run": len(runs["recipe"]), "load_average": list(os.getloadavg()),
            "settings": {k: getattr(args, k) for k in ("steps", "rounds", "max_rounds", "variants")}}


def _tokens_per_step() -> int:
    data = yaml.safe_load(GPT_CONFIG.read_text())["data"]["init_args"]
    return int(data["batch_size"]) * int(data["block_size"])


def print_lm(figures: dict[str, Any], console: Console) -> None:
    tokens = figures["tokens_per_step"]
    table = Table(title=f"The GPT recipe ({figures['settings']['steps']} steps, {figures['rounds_run']} "
                        "interleaved rounds, medians)")
    for column in ("variant", "ms / step", "tokens/s", "trainer.fit s"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    names = {"torch": "plain PyTorch loop", "lightning": "plain Lightning", "recipe": "full recipe"}
    for variant in figures["runs"]:
        step = statistics.median(r["step_s"] for r in figures["runs"][variant])
        fit = statistics.median(r["fit_s"] for r in figures["runs"][variant])
        table.add_row(names[variant], f"{step * 1e3:.1f}", f"{tokens / step:,.0f}", f"{fit:.1f}")
    console.print(table)
    for what, goal in (("step", GOAL_STEP_RATIO), ("fit", GOAL_FIT_RATIO)):
        low, high = figures[f"{what}_ci95"]
        console.print(f"recipe / plain Lightning {'time per step' if what == 'step' else 'trainer.fit'}: medians "
                      f"{figures[f'{what}_median_ratio']:.3f}; mean {figures[f'{what}_ratio']:.3f}, 95% CI {low:.3f} "
                      f".. {high:.3f} (goal <= {goal}): {figures[f'{what}_verdict']}", highlight=False)
    print_threads(figures, console)
    console.print(f"load average at the end {', '.join(f'{v:.2f}' for v in figures['load_average'])}",
                  highlight=False)


def thread_shares(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Each thread role's median share of one core over the runs' step windows (0 in a run without it)."""
    roles = sorted({role for run in runs for role in run.get("threads", {})})
    return {role: statistics.median(run.get("threads", {}).get(role, 0.0) for run in runs) for role in roles}


def print_threads(figures: dict[str, Any], console: Console) -> None:
    """The CPU each variant's threads used over the step window: what runs beside the step, and how much
    ("-": the variant had no such thread)."""
    shares = {variant: thread_shares(runs) for variant, runs in figures["runs"].items() if variant != "torch"}
    roles = sorted({role for by_role in shares.values() for role in by_role},
                   key=lambda role: (role not in ("training thread", NATIVE), role))
    table = Table(title="CPU of each thread over the step window (share of one core, medians)")
    table.add_column("thread")
    for variant in shares:
        table.add_column(variant, justify="right")
    for role in roles:
        table.add_row(role, *(f"{by_role[role]:.2%}" if role in by_role else "-" for by_role in shares.values()))
    table.add_row("all beside the step", *(
        f"{sum(v for role, v in by_role.items() if role not in ('training thread', NATIVE)):.2%}"
        for by_role in shares.values()))
    console.print(table)


def bench_lm_ablation(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """The recipe with each piece turned off in turn; a piece's cost is the full runs beside it over its run."""
    pieces = args.pieces or list(LM_PIECES)
    with tempfile.TemporaryDirectory() as tmp, own_store(Path(args.out or tmp)) as root:
        def run(variant: str, index: int) -> dict[str, float]:
            without = frozenset() if variant == "full" else frozenset({variant})
            figures = full_recipe(args.steps, root, index, without, keep_files=args.out is not None)
            name = "full" if variant == "full" else f"without {variant}"
            console.print(f"round {index + 1}/{args.rounds} ({name}): {figures['step_s'] * 1e3:.1f} ms/step, "
                          f"trainer.fit {figures['fit_s']:.1f} s", highlight=False)
            return {k: figures[k] for k in ("step_s", "fit_s")}

        runs, beside = bracketed_rounds(pieces, args.rounds, run)
    median = {v: {k: statistics.median(r[k] for r in runs[v]) for k in ("step_s", "fit_s")} for v in runs}
    cost = {}
    for piece in pieces:
        step, low, high = time_ratio_ci([r["step_s"] for r in beside[piece]], [r["step_s"] for r in runs[piece]])
        fit = [b["fit_s"] - r["fit_s"] for b, r in zip(beside[piece], runs[piece], strict=True)]
        cost[piece] = {"step_frac": step - 1, "step_ci95": [low - 1, high - 1],
                       "step_s": statistics.mean(b["step_s"] for b in beside[piece])
                       - statistics.mean(r["step_s"] for r in runs[piece]),
                       "fit_s": statistics.median(fit)}
    return {"runs": runs, "beside": beside, "median": median, "load_average": list(os.getloadavg()),
            "cost": cost, "settings": {k: getattr(args, k) for k in ("steps", "rounds")}}


def print_lm_ablation(figures: dict[str, Any], console: Console) -> None:
    full = figures["median"]["full"]
    table = Table(title=f"What each piece adds to the GPT recipe ({full['step_s'] * 1e3:.1f} ms/step, trainer.fit "
                        f"{full['fit_s']:.1f} s; {figures['settings']['rounds']} rounds, each piece run between "
                        "two full runs; cost = those full runs over the run without it)")
    for column in ("piece turned off", "ms / step without", "step cost", "step cost 95% CI", "trainer.fit cost (s)"):
        table.add_column(column, justify="left" if column == "piece turned off" else "right")
    for piece, cost in figures["cost"].items():
        low, high = cost["step_ci95"]
        table.add_row(_PIECE_NAMES.get(piece, piece), f"{figures['median'][piece]['step_s'] * 1e3:.1f}",
                      f"{cost['step_frac']:+.1%}", f"{low:+.1%} .. {high:+.1%}", f"{cost['fit_s']:+.2f}")
    console.print(table)
    console.print("A cost whose interval spans 0 cannot be told from the machine's noise.", highlight=False)


_PIECE_NAMES = {**PIECES, "lm_baselines": "LM baselines (unigram, bigram; at fit start)",
                "token_throughput": "token throughput (TokenThroughput)"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=300, help="training steps of every run (the recipe's)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of all variants, interleaved (at least)")
    parser.add_argument("--max-rounds", dest="max_rounds", type=int, default=9,
                        help=f"add rounds until the step ratio's 95%% CI is narrower than {STEP_MARGIN}, or this many")
    parser.add_argument("--variants", type=lambda text: [p for p in text.split(",") if p], default=None,
                        help=f"only these variants, comma-separated, lightning and recipe among them "
                             f"({','.join(VARIANTS)}; default all): two make a round take two thirds the time")
    parser.add_argument("--ablate", action="store_true", help="instead: the recipe with each piece turned off")
    parser.add_argument("--pieces", type=lambda text: [p for p in text.split(",") if p], default=None,
                        help=f"with --ablate: only these, comma-separated ({', '.join(LM_PIECES)})")
    parser.add_argument("--out", default=None,
                        help="keep every round's run files here (default: a temporary directory, where each "
                             "round's checkpoints and artifacts are dropped once it is over)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def run(args: argparse.Namespace) -> int:
    if args.variants is not None and (any(v not in VARIANTS for v in args.variants)
                                      or not {"lightning", "recipe"} <= set(args.variants)):
        raise UsageError(f"--variants {','.join(args.variants)}: each one of {', '.join(VARIANTS)}, "
                         "lightning and recipe among them")
    unknown = [p for p in args.pieces or [] if p not in LM_PIECES]
    if unknown:
        raise UsageError(f"--pieces {','.join(unknown)}: not one of {', '.join(LM_PIECES)}")
    for name in ("steps", "rounds", "max_rounds"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.steps <= WARMUP_STEPS + 1:
        raise UsageError(f"--steps {args.steps} must exceed {WARMUP_STEPS + 1} (the warm-up steps left out)")
    from recipes.run.process import quiet_known_noise, quiet_lightning_info

    quiet_known_noise()
    quiet_lightning_info()  # each fit's device lines, once per fit and variant
    warnings.filterwarnings("ignore")
    console = Console(stderr=args.json)
    figures = bench_lm_ablation(args, console) if args.ablate else bench_lm(args, console)
    emit(figures, args.json, lambda: (print_lm_ablation if args.ablate else print_lm)(figures, console))
    return 0
