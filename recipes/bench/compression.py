"""Gradient compression measured: the digits recipe on 2 processes (DDP) with each method, side by side.

For each method (dense all-reduce, fp16, PowerSGD, top-k) the default digits recipe trains with the
method's strategy fragment from ``configs/strategy/``; the methods run interleaved, ``--rounds`` times,
each run its own ``recipes.fit`` process. Reported per method, from the runs' MLflow records: bytes on
the wire per step (``comm/bytes_per_step``), the mean step time (``time/mean/step_s``, medians over the
rounds), the communication in flight per step, and the final ``val/acc`` and ``val/loss``.

    python -m recipes.bench compression --rounds 1 --epochs 20

On one machine's loopback the link is fast and the step time mostly compute: the bytes column is
what carries over to a real network (``python -m recipes.comm`` turns bytes into time for a given
bandwidth). Imports no torch or Lightning itself; each run does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from callbacks.analysis import keys
from recipes.bench.output import emit
from recipes.run.common import ENV_FROM_PARENT, UsageError, find_run

__all__ = ["METHODS", "add_arguments", "bench_compression", "run"]

REPO = Path(__file__).resolve().parents[2]
#: Method -> its strategy fragment (all DDP on 2 processes).
METHODS = {"dense": "ddp.yaml", "fp16": "ddp-fp16-compress.yaml", "powersgd": "ddp-powersgd.yaml",
           "topk": "ddp-topk.yaml"}
EXPERIMENT = "bench-compression"
_KEYS = {"bytes_per_step": keys.COMM_BYTES_KEY, "step_s": keys.STEP_KEY, "comm_s": keys.COMM_MEASURED_KEY,
         "val_acc": keys.VAL_ACC_KEY, "val_loss": keys.VAL_LOSS_KEY}


def _run(method: str, round_: int, workdir: Path, epochs: int, timeout: float) -> dict[str, float]:
    """One ``recipes.fit`` run of ``method``; its metrics from MLflow."""
    import mlflow

    name = f"{method}-{round_}"
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    env = {k: v for k, v in os.environ.items() if k not in ENV_FROM_PARENT}
    env.update({"MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    cmd = [sys.executable, "-m", "recipes.fit", "--config", str(REPO / "configs/digits.yaml"),
           "--config", str(REPO / "configs/strategy" / METHODS[method]), "--experiment", EXPERIMENT,
           "--run_name", name, "--runs_root", str(workdir / "runs"), "--trainer.max_epochs", str(epochs),
           "--log_model", "false", "--trainer.enable_progress_bar", "false"]
    out = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{method}: recipes.fit exited {out.returncode}:\n{out.stderr[-2000:]}")
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    run = find_run(client, [experiment.experiment_id], name) if experiment else None
    if run is None:
        raise RuntimeError(f"{method}: no MLflow run named {name}")
    metrics = run.data.metrics
    return {field: float(metrics[key]) for field, key in _KEYS.items() if key in metrics}


def bench_compression(methods: list[str], rounds: int, epochs: int, workdir: Path,
                      timeout: float = 900) -> dict[str, Any]:
    """Every method ``rounds`` times, interleaved; per method the medians of its runs' figures."""
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    for round_ in range(rounds):
        for method in methods:
            runs[method].append(_run(method, round_, workdir, epochs, timeout))
            print(f"round {round_ + 1}/{rounds} {method}: {runs[method][-1]}", file=sys.stderr)
    table = {}
    for method, results in runs.items():
        fields = set().union(*results)
        table[method] = {f: statistics.median(r[f] for r in results if f in r) for f in sorted(fields)}
    dense = table.get("dense", {}).get("bytes_per_step")
    for row in table.values():
        if dense and row.get("bytes_per_step"):
            row["bytes_vs_dense"] = row["bytes_per_step"] / dense
    return {"epochs": epochs, "rounds": rounds, "processes": 2, "methods": table}


def print_table(figures: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Gradient compression, digits on 2 processes, {figures['epochs']} epochs "
                        f"(medians of {figures['rounds']} round(s))")
    for column in ("method", "bytes/step", "vs dense", "step", "comm in flight", keys.VAL_ACC_KEY, keys.VAL_LOSS_KEY):
        table.add_column(column, justify="left" if column == "method" else "right")
    for method, row in figures["methods"].items():
        nan = float("nan")
        table.add_row(method, f"{row.get('bytes_per_step', nan):,.0f}", f"{row.get('bytes_vs_dense', nan):.3f}",
                      f"{row.get('step_s', nan) * 1e3:.2f} ms", f"{row.get('comm_s', nan) * 1e3:.2f} ms",
                      f"{row.get('val_acc', nan):.4f}", f"{row.get('val_loss', nan):.4f}")
    Console(width=120).print(table)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of " + ", ".join(METHODS))
    parser.add_argument("--rounds", type=int, default=1, help="runs of each method, interleaved (medians shown)")
    parser.add_argument("--epochs", type=int, default=20, help="trainer.max_epochs of every run")
    parser.add_argument("--out", default=None, help="keep the runs and MLflow store here (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def run(args: argparse.Namespace) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise UsageError(f"--methods {args.methods}: unknown {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(METHODS)}")
    if args.rounds < 1 or args.epochs < 1:
        raise UsageError(f"--rounds {args.rounds} and --epochs {args.epochs} must be >= 1")
    with tempfile.TemporaryDirectory(prefix="bench-compression-") as tmp:
        workdir = Path(args.out or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        figures = bench_compression(methods, args.rounds, args.epochs, workdir)
    emit(figures, args.json, lambda: print_table(figures))
    return 0
