"""``python -m recipes.bench stream``: samples/s of the digits recipe streamed from a local S3 server vs in memory.

Each round trains the digits recipe as a user launches it, ``python -m recipes.fit`` in a fresh interpreter, four
ways, in turn: in memory (``configs/digits.yaml``) and streamed (``configs/digits-stream.yaml``) from moto's S3
server (a thread of this process, behind a loopback proxy: :class:`recipes.soak.bucket.Bucket`), each at every
``--workers`` count. The streamed runs start with an empty chunk cache, so every chunk crosses the (local)
network once. From each run's MLflow record (``StepTiming``, :mod:`callbacks.timing`):

- ``samples/s``: ``time/mean/samples_per_s``, the run's global samples per second of step time;
- ``data wait``: ``time/mean/data_s / time/mean/step_s``, the share of the step spent waiting for the batch;
- for the streamed runs, the cache's disk use at the end (``du`` of ``--data.cache_dir``) against its
  ``--max-cache-size``.

The data is prepared once per invocation with ``python -m recipes.prepare digits`` (``--chunk-items`` items a
chunk). Figures need a quiet machine (docs/benchmarks.md)::

    python -m recipes.bench stream --rounds 3 --epochs 5 --workers 0,2 --max-cache-size 200KB --json
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

from rich.console import Console
from rich.table import Table

from callbacks.analysis.keys import DATA_WAIT_KEY, STEP_KEY, THROUGHPUT_KEY
from recipes.bench.output import emit
from recipes.run.common import UsageError, find_run

REPO = Path(__file__).resolve().parents[2]
#: The ways one round trains, in the order it trains them (at each worker count).
SOURCES = ("memory", "stream")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every source and worker count")
    parser.add_argument("--epochs", type=int, default=5, help="epochs of each run")
    parser.add_argument("--workers", default="0,2", help="loader worker counts, comma-separated")
    parser.add_argument("--chunk-items", dest="chunk_items", type=int, default=64, help="digits a chunk")
    parser.add_argument("--max-cache-size", dest="max_cache_size", default="200KB",
                        help="the streamed runs' cache budget (litdata's max_cache_size)")
    parser.add_argument("--out", default=None, help="keep run files here (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def disk_use(folder: Path) -> int:
    """Bytes of the files under ``folder`` (0 when it does not exist)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def _launch(root: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", *args], cwd=root, env=env, capture_output=True, text=True,
                            timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:2])} exited {result.returncode}: {result.stderr[-2000:]}")
    return result


def _metrics(tracking_uri: str, experiment: str, run_name: str) -> dict[str, float]:
    """The metrics of the newest run named ``run_name`` (the name quoted, the search ordered: :func:`find_run`)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    run = None if exp is None else find_run(client, [exp.experiment_id], run_name)
    if run is None:
        raise RuntimeError(f"no MLflow run named {run_name!r} in experiment {experiment!r} at {tracking_uri}")
    return dict(run.data.metrics)


def bench_stream(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Every round's runs; the figures by source and worker count (means over the rounds, and each round's)."""
    from recipes.soak.bucket import Bucket

    workers = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.out or scratch).resolve()
        root.mkdir(parents=True, exist_ok=True)
        bucket = Bucket(root / "moto.log")
        bucket.start()
        try:
            url = bucket.url("digits")
            tracking = f"sqlite:///{root / 'mlflow.db'}"
            env = {**os.environ, **bucket.env(), "PYTHONPATH": str(REPO), "MLFLOW_TRACKING_URI": tracking}
            console.print(f"preparing {url} (chunks of {args.chunk_items})")
            _launch(root, env, "recipes.prepare", "digits", "--output", url, "--chunk_items", str(args.chunk_items),
                    "--staging", str(root / "staging"))
            rows: list[dict[str, Any]] = []
            for round_index in range(args.rounds):
                for count in workers:
                    for source in SOURCES:
                        name = f"{source}-w{count}-r{round_index}"
                        cache = root / "cache" / name
                        extra = (("--config", str(REPO / "configs/digits.yaml")) if source == "memory" else
                                 ("--config", str(REPO / "configs/digits-stream.yaml"), "--data.url", url,
                                  "--data.cache_dir", str(cache), "--data.max_cache_size", args.max_cache_size))
                        console.print(f"round {round_index + 1}/{args.rounds}: {source}, {count} workers")
                        _launch(root, env, "recipes.fit", *extra, "--trainer.max_epochs", str(args.epochs),
                                "--data.num_workers", str(count), "--trainer.enable_progress_bar", "false",
                                "--log_model", "false", "--run_name", name)
                        metrics = _metrics(tracking, "digits" if source == "memory" else "digits-stream", name)
                        step = metrics[STEP_KEY]
                        rows.append({"round": round_index, "source": source, "workers": count,
                                     "samples_per_s": metrics[THROUGHPUT_KEY],
                                     "data_wait_share": metrics[DATA_WAIT_KEY] / step,
                                     "step_s": step,
                                     "cache_bytes": disk_use(cache) if source == "stream" else None})
        finally:
            bucket.stop()
    summary = []
    for count in workers:
        for source in SOURCES:
            mine = [r for r in rows if r["workers"] == count and r["source"] == source]
            summary.append({"source": source, "workers": count,
                            "samples_per_s": statistics.fmean(r["samples_per_s"] for r in mine),
                            "data_wait_share": statistics.fmean(r["data_wait_share"] for r in mine),
                            "cache_bytes": max((r["cache_bytes"] or 0) for r in mine) if source == "stream"
                            else None})
    return {"epochs": args.epochs, "rounds": args.rounds, "chunk_items": args.chunk_items,
            "max_cache_size": args.max_cache_size, "summary": summary, "runs": rows,
            "command": "python -m recipes.bench stream " + " ".join(sys.argv[2:])}


def print_stream(figures: dict[str, Any], console: Console) -> None:
    table = Table(title=f"digits, {figures['epochs']} epochs, mean of {figures['rounds']} round(s)")
    for column in ("source", "workers", "samples/s", "data wait", "cache on disk (limit)"):
        table.add_column(column)
    for row in figures["summary"]:
        limit = figures["max_cache_size"]
        cache = "-" if row["cache_bytes"] is None else f"{row['cache_bytes'] / 1e3:,.0f} kB ({limit})"
        table.add_row(row["source"], str(row["workers"]), f"{row['samples_per_s']:,.0f}",
                      f"{row['data_wait_share']:.1%}", cache)
    console.print(table)


def run(args: argparse.Namespace) -> int:
    for name in ("rounds", "epochs", "chunk_items"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    for part in args.workers.split(","):
        if not part.strip().isdigit():
            raise UsageError(f"--workers: {part.strip()!r} is not an integer >= 0 (expected e.g. 0,2)")
    console = Console(stderr=args.json)
    figures = bench_stream(args, console)
    emit(figures, args.json, lambda: print_stream(figures, console))
    return 0
