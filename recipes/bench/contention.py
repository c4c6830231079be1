"""``python -m recipes.bench contention``: the digits step quiet and beside a busy process, per CPU thread setting.

Each setting runs in a fresh process (OpenMP reads its environment once, when torch starts):
``python -m recipes.bench.contention --steps N --warmup W [--threads T] [--adaptive] [--devices D]`` prints
that process's mean ms per step. The benchmark starts it; it is not a command of its own.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from rich.console import Console
from rich.table import Table

from recipes.bench.runs import Stopwatch
from recipes.run.shutdown import destroy_process_group

# ------------------------------------------------------------------- CPU contention
#: A thread setting compared by ``contention``: its name, the worker's arguments, and the OpenMP environment.
#: GNU OpenMP (torch's on Linux) spins ``GOMP_SPINCOUNT`` times (300,000 by default) before a waiting thread
#: sleeps; ``OMP_WAIT_POLICY=PASSIVE`` makes it sleep at once.
CONTENTION_SETTINGS: tuple[tuple[str, list[str], dict[str, str]], ...] = (
    ("auto (torch's count, held; threads spin: the default)", [], {}),
    ("passive", [], {"OMP_WAIT_POLICY": "PASSIVE"}),
    ("spin10k (GOMP_SPINCOUNT=10000)", [], {"GOMP_SPINCOUNT": "10000"}),
    ("1 thread", ["--threads", "1"], {}),
    ("adaptive (AdaptiveCpuThreads: not bitwise resumable)", ["--adaptive"], {}),
    ("DDP-2 (Lightning: 1 thread each)", ["--devices", "2"], {}))
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
    destroy_process_group()  # and main's run_and_exit ends the process (recipes.run.shutdown says why)
    if trainer.global_rank != 0:
        return None
    # the mean, not the median: the steps a setting loses to a busy neighbour (or to probing) all count
    return (watch.ends[-1] - watch.ends[warmup - 1]) / (len(watch.ends) - warmup) * 1e3


def _run_worker(args: argparse.Namespace, worker_args: list[str], openmp: dict[str, str]) -> float:
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in _OPENMP_ENV}
    env.update(openmp)  # read by OpenMP when torch starts: a fresh process per setting
    command = [sys.executable, "-m", "recipes.bench.contention", "--steps", str(args.steps),
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


def worker_main(argv: list[str] | None = None) -> int:
    """One setting's run in this process (the benchmark's worker): its mean ms per step on stdout."""
    import warnings

    from recipes.run.common import ArgumentParser, parse_or_exit
    from recipes.run.process import quiet_lightning_info

    parser = ArgumentParser(prog="python -m recipes.bench.contention",
                            description="One thread setting of `python -m recipes.bench contention`.")
    parser.add_argument("--steps", type=int, default=60, help="training steps")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the mean")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default torch's count)")
    parser.add_argument("--adaptive", action="store_true", help="with AdaptiveCpuThreads")
    parser.add_argument("--devices", type=int, default=1, help="processes (DDP when more than one)")
    args = parse_or_exit(parser, argv)
    quiet_lightning_info()
    warnings.filterwarnings("ignore")
    mean_ms = contention_worker(args.steps, args.warmup, args.threads, args.adaptive, args.devices)
    if mean_ms is not None:
        print(mean_ms)
    return 0


if __name__ == "__main__":
    from recipes.run.shutdown import run_and_exit

    run_and_exit(worker_main)
