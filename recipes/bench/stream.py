"""``python -m recipes.bench stream``: a recipe streamed from an S3 server a shaped network away vs in memory.

Each round trains the recipe as a user launches it, ``python -m recipes.fit`` in a fresh interpreter, at every
``--workers`` count in turn, each source once (interleaved rounds: a drift of the machine lands on every source):

- ``memory``: the in-memory config (``--recipe digits``: ``configs/digits.yaml``; ``gpt``: ``configs/gpt.yaml``);
- ``folder``: the streamed config over the same chunks in a local folder: the loader's own cost (verify, decode,
  fetch-ahead) without a store on this machine's cores (moto's and the S3 client's CPU per request share the cores
  the step computes on here, as a real store's do not);
- ``stream``: the streamed config (``configs/digits-stream.yaml``, ``configs/gpt-stream.yaml``) from moto's S3
  server (a thread of this process) through a loopback proxy that plays a store a network away
  (:class:`recipes.soak.bucket.Bucket`): each response waits ``--latency-ms`` after its request and each
  connection carries ``--bandwidth-mb-s`` at most (defaults 30 ms and 100 MB/s: same-region S3 answers a GET's
  first byte in tens of ms and streams about 100 MB/s per connection);
- ``stream-raw``: the same through the proxy unshaped: moto's own numbers (sub-millisecond, GB/s on loopback).
  It runs in every round rather than behind a flag, so the shaped figures always carry the raw ones measured
  beside them on the same machine (the issue: "keep the moto server's raw numbers beside them"); it is left out
  when the shaping is off (``--latency-ms 0 --bandwidth-mb-s 0``: then ``stream`` is the raw one).

The streamed runs start with an empty chunk cache, so every chunk crosses the (shaped) network once. The data is
prepared once per invocation with ``python -m recipes.prepare`` (``--chunk-items`` items a chunk), written straight
to moto (the upload is not what is measured). From each run's MLflow record (``StepTiming``, :mod:`callbacks.timing`):

- ``samples/s`` (digits): ``time/mean/samples_per_s``; ``tokens/s`` (gpt): the same times ``block_size`` (128
  windows' targets a sample), on the clock the data wait is measured on (not TokenThroughput's last window);
- ``vs memory``: the run's throughput over the memory run's of its round and worker count (paired);
- ``data wait``: ``time/mean/data_s / time/mean/step_s``, the share of the step spent waiting for the batch;
- for the streamed runs, the cache's disk use at the end (``du`` of ``--data.cache_dir``) against its budget.

The summary gives each figure's median over the rounds and its spread (min-max), not a mean: one round that met a
busy neighbour moves a mean, not a median, and the spread says how much to trust the median.

``--recipe gpt`` compares ``configs/gpt.yaml`` in memory against ``configs/gpt-stream.yaml`` streamed on the same
data: a snapshot of this repository's own sources (``*.py`` of recipes/, callbacks/, datamodules/, copied once, so
an edit made during the bench changes neither side), capped at ``--corpus-bytes`` (``recipes.prepare text
--max_bytes`` and the in-memory run's ``--data.max_bytes``: the same split, the same bytes, checked against
``atscale.json`` before any run), ``block_size`` 128, 16 windows a batch, ``--steps`` optimizer steps each. The
in-memory set draws its windows at random starts, the streamed one tiles them (stride ``block_size``): the same
bytes, as many windows an epoch.

``--anchor``: each round also draws one epoch of the training split through two loaders alone, no model
(:mod:`recipes.bench.stream_anchor`): litdata's own ``StreamingDataLoader`` and the project's training loader, the
same chunks through the same shaped proxy, the recipe's batch size, each worker count, an empty cache each, each in
a fresh interpreter; samples/s of each and ours/litdata's per round (median, spread).

``--large-mb N``: instead of the rounds, an epoch over a set larger than the cache. A synthetic image set whose
training split is about N MB (random 3x32x32 images, prepared with ``recipes.prepare images``; at least 10x
``--max-cache-size``, whose default is then a tenth of it) is streamed through the project's loader alone at each
worker count, while a thread samples the cache folder's bytes and the resident memory (process and workers) every
0.2 s: the cache's peak against its budget, and the memory's peak after the first 10% of the epoch against its
peak over the whole epoch.

Figures need a quiet machine (docs/benchmarks.md)::

    python -m recipes.bench stream --rounds 5 --epochs 5 --workers 0,2 --anchor --json
    python -m recipes.bench stream --recipe gpt --rounds 3 --steps 20 --workers 0,2
    python -m recipes.bench stream --latency-ms 0 --bandwidth-mb-s 0        # moto's raw numbers alone
    python -m recipes.bench stream --large-mb 300 --workers 2               # cache budget 30MB
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from callbacks.analysis.keys import DATA_WAIT_KEY, STEP_KEY, THROUGHPUT_KEY
from recipes.bench.output import emit
from recipes.bench.stream_anchor import (
    LOADERS,
    disk_use,
    large_chunk_items,
    loader_epoch,
    write_image_folder,
)
from recipes.run.common import UsageError, find_run

REPO = Path(__file__).resolve().parents[2]
#: What ``--recipe`` compares: the in-memory config, the streamed config, and what the streamed data holds.
RECIPES = {
    "digits": {"memory": "configs/digits.yaml", "stream": "configs/digits-stream.yaml", "kind": "images"},
    "gpt": {"memory": "configs/gpt.yaml", "stream": "configs/gpt-stream.yaml", "kind": "tokens"},
}
#: The GPT configs' context (model.block_size = data.block_size in both): tokens a sample.
BLOCK_SIZE = 128
#: The folders of this repository whose ``*.py`` files are the GPT corpus.
CORPUS_FOLDERS = ("recipes", "callbacks", "datamodules")
#: The cache budget when ``--max-cache-size`` is not given (``--large-mb``'s: a tenth of its training split).
DEFAULT_CACHE = "25GB"  # the streamed configs' own: every chunk fetched once, cold at the start
#: How often the large epoch samples the cache and the memory (seconds).
SAMPLE_S = 0.2
#: The fewest ``--steps``: StepTiming leaves out each run's first 3 (its ``warmup_steps``), and times the rest.
MIN_STEPS = 5
#: The share of the large set ``recipes.prepare images`` holds out for validation (its ``--val_fraction``).
VAL_FRACTION = 0.2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", choices=tuple(RECIPES), default="digits",
                        help="digits: the CNN on 8x8 digits (samples/s); gpt: the byte-level GPT on this "
                             "repository's sources (tokens/s)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every source and worker count, interleaved")
    parser.add_argument("--epochs", type=int, default=5, help="digits: epochs of each run")
    parser.add_argument("--steps", type=int, default=20, help="gpt: optimizer steps of each run (>= 5)")
    parser.add_argument("--workers", default="0,2", help="loader worker counts, comma-separated")
    parser.add_argument("--latency-ms", dest="latency_ms", type=float, default=30.0,
                        help="the store's first-byte latency: each response waits this long after its request "
                             "(0: none)")
    parser.add_argument("--bandwidth-mb-s", dest="bandwidth_mb_s", type=float, default=100.0,
                        help="the store's bandwidth per connection, in MB/s (10^6 bytes a second; 0: unlimited)")
    parser.add_argument("--chunk-items", dest="chunk_items", type=int, default=64,
                        help="items a chunk (--large-mb sizes its own)")
    parser.add_argument("--corpus-bytes", dest="corpus_bytes", type=int, default=1_000_000,
                        help="gpt: cap on the corpus's bytes, both splits (the figures give what each split holds)")
    parser.add_argument("--max-cache-size", dest="max_cache_size", default=None,
                        help=f"the streamed runs' cache budget (litdata's spelling; default {DEFAULT_CACHE}, with "
                             "--large-mb a tenth of its training split)")
    parser.add_argument("--anchor", action="store_true",
                        help="each round also draws an epoch through litdata's StreamingDataLoader and through the "
                             "project's loader alone (no model): samples/s and ours/litdata")
    parser.add_argument("--large-mb", dest="large_mb", type=float, default=None,
                        help="instead: one epoch of the project's loader over a synthetic image set whose training "
                             "split is this many MB (>= 10x the cache budget): the cache's and the memory's peaks")
    parser.add_argument("--out", default=None, help="keep run files here (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def parse_workers(text: str) -> list[int]:
    """``"0,2"`` -> ``[0, 2]``.

    Raises:
        UsageError: naming a part that is not an integer >= 0.
    """
    counts = []
    for part in text.split(","):
        if not part.strip().isdigit():
            raise UsageError(f"--workers: {part.strip()!r} is not an integer >= 0 (expected e.g. 0,2)")
        counts.append(int(part))
    return counts


def budget_bytes(size: str) -> int:
    """``--max-cache-size`` in bytes (decimal units, as litdata reads them).

    Raises:
        UsageError: naming a size that is not bytes or a number with a unit (B, KB, MB, GB, TB).
    """
    text = str(size).strip().upper()
    for unit, factor in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        number = text[: -len(unit)] if text.endswith(unit) else None
        if number is not None:
            try:
                value = float(number)
            except ValueError:
                break
            if value > 0:
                return int(value * factor)
            break
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise UsageError(f"--max-cache-size {size!r}: expected a size such as 200KB or 30MB (bytes if no unit), > 0")


def shaping(latency_ms: float, bandwidth_mb_s: float) -> tuple[float, float | None]:
    """The proxy's ``(latency_s, bytes_per_s)`` for the options (0 is none / unlimited)."""
    return latency_ms / 1e3, (bandwidth_mb_s * 1e6 if bandwidth_mb_s > 0 else None)


def sources(latency_ms: float, bandwidth_mb_s: float) -> tuple[str, ...]:
    """The sources a round trains: ``folder`` (the same chunks streamed from a local folder: the loader's own cost,
    no store on this machine's cores), ``stream`` and ``stream-raw`` (only when the proxy is shaped, else
    ``stream`` is raw)."""
    shaped = latency_ms > 0 or bandwidth_mb_s > 0
    return ("memory", "folder", "stream", "stream-raw") if shaped else ("memory", "folder", "stream")


def spread(values: Sequence[float]) -> dict[str, float]:
    """``{"median", "min", "max"}`` of a figure's rounds."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def config_batch_size(config: str) -> int:
    """The batch size a config file sets (``data.init_args.batch_size``): the loader-only epochs use the recipe's."""
    import yaml

    return int(yaml.safe_load((REPO / config).read_text())["data"]["init_args"]["batch_size"])


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


def snapshot_corpus(into: Path) -> Path:
    """Copy the ``*.py`` files of :data:`CORPUS_FOLDERS` under ``into`` (their relative paths kept); ``into``.

    Empty files are left out: they hold no text, and under a byte cap ``datamodules.text.plan_splits`` stops
    taking files at the first empty one (a split of 46 files of 134 when an empty ``__init__.py`` came early).
    """
    for folder in CORPUS_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if "__pycache__" in path.parts or path.stat().st_size == 0:
                continue
            target = into / path.relative_to(REPO)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    return into


def _same_corpus(root: Path, corpus: Path, max_bytes: int, prepared: dict[str, Any]) -> dict[str, int]:
    """The in-memory run's split sizes, checked against what ``recipes.prepare text`` recorded in atscale.json."""
    from datamodules.text import TextDataModule

    dm = TextDataModule(root=str(corpus), max_bytes=max_bytes, block_size=BLOCK_SIZE,
                        cache_dir=str(root / "data/cache/text"))  # the in-memory runs' cache (cwd = root)
    sizes = {"train_bytes": int(dm.meta["train"]["bytes"]), "val_bytes": int(dm.meta["val"]["bytes"])}
    recorded = prepared.get("corpus") or {}
    for key, value in sizes.items():
        if key in recorded and int(recorded[key]) != value:
            raise RuntimeError(f"gpt: the streamed corpus has {recorded[key]} {key}, the in-memory one {value}: the "
                               "two runs would not train on the same data")
    return sizes


def _prepare(args: argparse.Namespace, root: Path, env: dict[str, str], url: str, console: Console) -> list[str]:
    """Prepare the recipe's data at ``url`` (straight to moto) and at ``root/folder`` (the same chunks: one staging
    folder); the in-memory runs' extra options."""
    staging = ("--chunk_items", str(args.chunk_items), "--staging", str(root / "staging"))
    corpus = snapshot_corpus(root / "corpus") if args.recipe == "gpt" else None
    for output in (url, str(root / "folder")):
        console.print(f"preparing {output} ({args.recipe}, chunks of {args.chunk_items})")
        if corpus is None:
            _launch(root, env, "recipes.prepare", "digits", "--output", output, *staging)
        else:
            _launch(root, env, "recipes.prepare", "text", "--output", output, "--root", str(corpus), "--max_bytes",
                    str(args.corpus_bytes), "--block_size", str(BLOCK_SIZE), *staging)
    return [] if corpus is None else ["--data.root", str(corpus), "--data.max_bytes", str(args.corpus_bytes)]


def _fit_run(args: argparse.Namespace, root: Path, env: dict[str, str], tracking: str, url: str, source: str,
             count: int, name: str, memory_extra: list[str], budget: str) -> dict[str, Any]:
    """Train one run of ``source`` at ``count`` workers; its figures from MLflow."""
    recipe = RECIPES[args.recipe]
    cache = root / "cache" / name
    if source == "memory":
        extra = ["--config", str(REPO / recipe["memory"]), *memory_extra]
    else:
        extra = ["--config", str(REPO / recipe["stream"]), "--data.url",
                 str(root / "folder") if source == "folder" else url, "--data.cache_dir", str(cache),
                 "--data.max_cache_size", budget]
    length = (["--trainer.max_epochs", str(args.epochs)] if args.recipe == "digits"
              else ["--trainer.max_steps", str(args.steps)])
    _launch(root, env, "recipes.fit", *extra, *length, "--data.num_workers", str(count),
            "--trainer.enable_progress_bar", "false", "--log_model", "false", "--run_name", name)
    experiment = f"{args.recipe}-stream" if source != "memory" else args.recipe
    metrics = _metrics(tracking, experiment, name)
    if STEP_KEY not in metrics:
        raise RuntimeError(f"run {name!r} logged no {STEP_KEY}: no step was timed after StepTiming's warm-up")
    step = metrics[STEP_KEY]
    row: dict[str, Any] = {"source": source, "workers": count, "samples_per_s": metrics[THROUGHPUT_KEY],
                           "data_wait_share": metrics[DATA_WAIT_KEY] / step, "step_s": step,
                           "cache_bytes": disk_use(cache) if source != "memory" else None}
    row["throughput"] = row["samples_per_s"] * (BLOCK_SIZE if args.recipe == "gpt" else 1)
    return row


def bench_stream(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Every round's runs (and loader epochs with ``--anchor``); the figures by source and worker count."""
    from recipes.soak.bucket import Bucket

    workers = parse_workers(args.workers)
    budget = args.max_cache_size or DEFAULT_CACHE
    latency_s, bytes_per_s = shaping(args.latency_ms, args.bandwidth_mb_s)
    kinds = sources(args.latency_ms, args.bandwidth_mb_s)
    recipe = RECIPES[args.recipe]
    rows: list[dict[str, Any]] = []
    anchor: list[dict[str, Any]] = []
    corpus: dict[str, int] | None = None
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.out or scratch).resolve()
        root.mkdir(parents=True, exist_ok=True)
        bucket = Bucket(root / "moto.log")
        bucket.start()
        try:
            url = bucket.url(args.recipe)
            tracking = f"sqlite:///{root / 'mlflow.db'}"
            env = {**os.environ, **bucket.env(), "PYTHONPATH": str(REPO), "MLFLOW_TRACKING_URI": tracking}
            memory_extra = _prepare(args, root, {**env, "AWS_ENDPOINT_URL": bucket.direct}, url, console)
            if args.recipe == "gpt":
                prepared = json.loads(bucket.fs().cat_file(f"{url[len('s3://'):]}/atscale.json"))
                corpus = _same_corpus(root, root / "corpus", args.corpus_bytes, prepared)
            for round_index in range(args.rounds):
                for count in workers:
                    for source in kinds:
                        console.print(f"round {round_index + 1}/{args.rounds}: {source}, {count} workers")
                        bucket.shape(*((0.0, None) if source == "stream-raw" else (latency_s, bytes_per_s)))
                        name = f"{source}-w{count}-r{round_index}"
                        rows.append({"round": round_index, **_fit_run(args, root, env, tracking, url, source, count,
                                                                      name, memory_extra, budget)})
                    if args.anchor:
                        bucket.shape(latency_s, bytes_per_s)
                        for loader in (LOADERS if round_index % 2 == 0 else LOADERS[::-1]):
                            console.print(f"round {round_index + 1}/{args.rounds}: {loader} loader, {count} workers")
                            cache = root / "cache" / f"anchor-{loader}-w{count}-r{round_index}"
                            cache.mkdir(parents=True)
                            figures = loader_epoch(loader, url, recipe["kind"], config_batch_size(recipe["stream"]),
                                                   count, cache, budget, env, BLOCK_SIZE)
                            anchor.append({"round": round_index, "workers": count, **figures})
        finally:
            bucket.stop()
    return {"recipe": args.recipe, "unit": "tokens/s" if args.recipe == "gpt" else "samples/s",
            "epochs": args.epochs if args.recipe == "digits" else None,
            "steps": args.steps if args.recipe == "gpt" else None, "rounds": args.rounds,
            "latency_ms": args.latency_ms, "bandwidth_mb_s": args.bandwidth_mb_s, "chunk_items": args.chunk_items,
            "max_cache_size": budget, "corpus": corpus, "sources": list(kinds),
            "summary": summarize(rows, workers, kinds), "runs": rows,
            "anchor": {"summary": summarize_anchor(anchor, workers), "epochs": anchor} if args.anchor else None,
            "command": "python -m recipes.bench stream " + " ".join(sys.argv[2:])}


def summarize(rows: list[dict[str, Any]], workers: Sequence[int], kinds: Sequence[str]) -> list[dict[str, Any]]:
    """Per worker count and source: median and spread of throughput, its ratio to memory's, and data wait."""
    summary = []
    for count in workers:
        memory = {r["round"]: r["throughput"] for r in rows if r["workers"] == count and r["source"] == "memory"}
        for source in kinds:
            mine = [r for r in rows if r["workers"] == count and r["source"] == source]
            summary.append({"source": source, "workers": count,
                            "throughput": spread([r["throughput"] for r in mine]),
                            "vs_memory": spread([r["throughput"] / memory[r["round"]] for r in mine]),
                            "data_wait_share": spread([r["data_wait_share"] for r in mine]),
                            "cache_bytes": max((r["cache_bytes"] or 0) for r in mine) if source != "memory"
                            else None})
    return summary


def summarize_anchor(epochs: list[dict[str, Any]], workers: Sequence[int]) -> list[dict[str, Any]]:
    """Per worker count: each loader's samples/s and ours/litdata's (per round, paired), median and spread."""
    summary = []
    for count in workers:
        by = {loader: {e["round"]: e["samples_per_s"] for e in epochs if e["workers"] == count
                       and e["loader"] == loader} for loader in LOADERS}
        summary.append({"workers": count, **{loader: spread(list(by[loader].values())) for loader in LOADERS},
                        "ours_over_litdata": spread([by["ours"][r] / by["litdata"][r] for r in by["ours"]])})
    return summary


def _cell(figure: dict[str, float], form: str) -> str:
    return f"{figure['median']:{form}} ({figure['min']:{form}}-{figure['max']:{form}})"


def store_line(figures: dict[str, Any]) -> str:
    """The shaping the figures were taken under, as the table titles say it."""
    latency = f"{figures['latency_ms']:g} ms" if figures["latency_ms"] else "no latency"
    bandwidth = f"{figures['bandwidth_mb_s']:g} MB/s a stream" if figures["bandwidth_mb_s"] else "unlimited"
    return f"store {latency}, {bandwidth}"


def print_stream(figures: dict[str, Any], console: Console) -> None:
    length = (f"{figures['epochs']} epochs" if figures["recipe"] == "digits" else f"{figures['steps']} steps")
    raw = " (stream-raw: moto unshaped)" if "stream-raw" in figures.get("sources", ()) else ""
    table = Table(title=f"{figures['recipe']}, {length}, median (min-max) of {figures['rounds']} round(s); "
                        f"{store_line(figures)}{raw}")
    for column in ("source", "workers", figures["unit"], "vs memory", "data wait", "cache (limit)"):
        table.add_column(column, overflow="fold")
    for row in figures["summary"]:
        cache = ("-" if row["cache_bytes"] is None
                 else f"{row['cache_bytes'] / 1e3:,.0f} kB ({figures['max_cache_size']})")
        table.add_row(row["source"], str(row["workers"]), _cell(row["throughput"], ",.0f"),
                      _cell(row["vs_memory"], ".2f"), _cell(row["data_wait_share"], ".1%"), cache)
    console.print(table)
    if figures.get("anchor"):
        anchor = Table(title=f"loaders alone, one epoch each, empty cache; {store_line(figures)}: samples/s, "
                             f"median (min-max) of {figures['rounds']} round(s)")
        for column in ("workers", "ours", "litdata", "ours / litdata"):
            anchor.add_column(column, overflow="fold")
        for row in figures["anchor"]["summary"]:
            anchor.add_row(str(row["workers"]), _cell(row["ours"], ",.0f"), _cell(row["litdata"], ",.0f"),
                           _cell(row["ours_over_litdata"], ".2f"))
        console.print(anchor)


# ---------------------------------------------------------------------------------- larger than the cache
def bench_large(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """One epoch of the project's loader over a synthetic set past the cache, at each worker count."""
    from recipes.soak.bucket import Bucket

    total = int(args.large_mb * 1e6)
    budget = args.max_cache_size or f"{total // 10}B"
    limit = budget_bytes(budget)
    chunk_items = large_chunk_items(total, limit)
    epochs = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.out or scratch).resolve()
        root.mkdir(parents=True, exist_ok=True)
        console.print(f"writing a synthetic image set whose training split is about {total / 1e6:,.1f} MB")
        images = write_image_folder(root / "images", int(total / (1 - VAL_FRACTION)))
        bucket = Bucket(root / "moto.log", *shaping(args.latency_ms, args.bandwidth_mb_s))
        bucket.start()
        try:
            url = bucket.url("large")
            env = {**os.environ, **bucket.env(), "PYTHONPATH": str(REPO)}
            console.print(f"preparing {url} ({images:,} images, chunks of {chunk_items})")
            _launch(root, {**env, "AWS_ENDPOINT_URL": bucket.direct}, "recipes.prepare", "images", "--root",
                    str(root / "images"), "--output", url, "--chunk_items", str(chunk_items), "--val_fraction",
                    str(VAL_FRACTION), "--staging", str(root / "staging"))
            shutil.rmtree(root / "images")
            prepared = sum(info["size"] for info in bucket.fs().ls(f"{url[len('s3://'):]}/train", detail=True))
            for count in parse_workers(args.workers):
                console.print(f"one epoch past the cache, {count} workers")
                cache = root / "cache" / f"large-w{count}"
                cache.mkdir(parents=True)
                figures = loader_epoch("ours", url, "images", config_batch_size(RECIPES["digits"]["stream"]), count,
                                       cache, budget, env, sample_s=SAMPLE_S)
                epochs.append({"workers": count, **figures,
                               "cache_peak_over_budget": figures["cache_peak_bytes"] / limit,
                               "rss_end_over_early": figures["rss_peak_bytes"] / figures["rss_early_peak_bytes"]})
        finally:
            bucket.stop()
    return {"large_mb": args.large_mb, "images": images, "train_bytes": prepared, "chunk_items": chunk_items,
            "max_cache_size": budget, "budget_bytes": limit, "latency_ms": args.latency_ms,
            "bandwidth_mb_s": args.bandwidth_mb_s, "epochs": epochs,
            "command": "python -m recipes.bench stream " + " ".join(sys.argv[2:])}


def print_large(figures: dict[str, Any], console: Console) -> None:
    table = Table(title=f"one epoch of {figures['train_bytes'] / 1e6:,.1f} MB of training chunks through a "
                        f"{figures['budget_bytes'] / 1e6:,.2f} MB cache; {store_line(figures)}")
    for column in ("workers", "samples/s", "cache peak (x budget)", "RSS peak: first 10%", "RSS peak: epoch",
                   "epoch / first 10%"):
        table.add_column(column)
    for row in figures["epochs"]:
        table.add_row(str(row["workers"]), f"{row['samples_per_s']:,.0f}",
                      f"{row['cache_peak_bytes'] / 1e6:,.2f} MB ({row['cache_peak_over_budget']:.2f}x)",
                      f"{row['rss_early_peak_bytes'] / 1e6:,.0f} MB", f"{row['rss_peak_bytes'] / 1e6:,.0f} MB",
                      f"{row['rss_end_over_early']:.2f}")
    console.print(table)


def check(args: argparse.Namespace) -> None:
    """Refuse bad options before anything starts (one :class:`UsageError` naming the value)."""
    for name in ("rounds", "epochs", "chunk_items", "corpus_bytes"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.steps < MIN_STEPS:
        raise UsageError(f"--steps {args.steps} must be >= {MIN_STEPS}: StepTiming times no run's first 3 steps")
    parse_workers(args.workers)
    for name, unit in (("latency_ms", "0: none"), ("bandwidth_mb_s", "0: unlimited")):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name):g} must be >= 0 ({unit})")
    if args.recipe == "gpt" and args.corpus_bytes < 10 * (BLOCK_SIZE + 1):
        raise UsageError(f"--corpus-bytes {args.corpus_bytes}: its validation tenth must hold a window of "
                         f"{BLOCK_SIZE + 1} bytes (at least {10 * (BLOCK_SIZE + 1)})")
    budget = budget_bytes(args.max_cache_size) if args.max_cache_size is not None else None
    if args.large_mb is not None:
        if not args.large_mb > 0:
            raise UsageError(f"--large-mb {args.large_mb:g} must be > 0")
        if args.anchor or args.recipe != "digits":
            raise UsageError("--large-mb runs instead of the rounds: leave out --anchor and --recipe")
        if budget is not None and args.large_mb * 1e6 < 10 * budget:
            raise UsageError(f"--large-mb {args.large_mb:g} is less than 10x --max-cache-size {args.max_cache_size} "
                             f"({10 * budget / 1e6:g} MB): the set must not fit the cache")


def run(args: argparse.Namespace) -> int:
    check(args)
    console = Console(stderr=args.json)
    if args.large_mb is not None:
        large = bench_large(args, console)
        emit(large, args.json, lambda: print_large(large, console))
        return 0
    figures = bench_stream(args, console)
    emit(figures, args.json, lambda: print_stream(figures, console))
    return 0
