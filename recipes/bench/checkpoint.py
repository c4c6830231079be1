"""``python -m recipes.bench checkpoint``: how long periodic checkpoints stall the loop, sync versus async.

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
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from rich.console import Console
from rich.table import Table
from typing_extensions import override

from callbacks.checkpoint_io import AtomicCheckpointIO, BoundedAsyncCheckpointIO
from callbacks.timing import StepTiming
from recipes.bench.mlp import BenchData, BenchModule
from recipes.bench.runs import Stopwatch, tensors_copy_floor
from recipes.bench.stats import (
    ci_settled,
    effective_stall_ci,
    verdict_at_most,
)

GOAL_ASYNC_OVER_SYNC = 0.10
GOAL_STAGING_OVER_FLOOR = 2.0
#: Width of the effective async/sync ratio's 95 % CI below which the checkpoint benchmark stops adding rounds.
CHECKPOINT_MARGIN = 0.05


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
