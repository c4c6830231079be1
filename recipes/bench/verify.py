"""``python -m recipes.bench verify``: what checking each streamed chunk's SHA-256 costs its fetch.

The streamed datamodules fetch every file of a bucket through :class:`datamodules.verified_chunks.VerifiedFiles`,
which hashes the bytes as they stream into the local copy and publishes the file only when it matches
``atscale.json``. This bench fetches the same training chunks from moto's S3 server on loopback (a thread of this
process: :class:`recipes.soak.bucket.Bucket`, the fastest "network" a run meets, so the hash's share is at its
largest) two ways, into an empty folder each time, in interleaved rounds (the order alternates):

- ``plain``: fsspec's own copy, ``fs.get_file`` (what a fetch without a check costs);
- ``verified``: ``VerifiedFiles.path`` (fetch, hash, compare, publish), given ``atscale.json``'s hashes as the
  datamodule gives them (read once per launch, outside the timing).

Each way's figure is the median over the rounds of its whole-split fetch time; the cost is the ratio of the
medians. ``hash only`` is SHA-256 over the same bytes in memory (this machine's hashing speed). The fetch runs in
the loader workers (or, with none, in the batch's wait for its data), never in the step's compute. Figures need a
quiet machine (docs/benchmarks.md)::

    python -m recipes.bench verify --rounds 15 --chunk-items 512 --json
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from recipes.bench.output import emit
from recipes.run.common import UsageError

REPO = Path(__file__).resolve().parents[2]
WAYS = ("plain", "verified")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds of both ways")
    parser.add_argument("--chunk-items", dest="chunk_items", type=int, default=512, help="digits a chunk")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def _fetch_plain(url: str, names: list[str], into: Path, expected: dict[str, str]) -> float:
    from datamodules.verified_chunks import fresh_fs

    started = time.perf_counter()
    fs, root = fresh_fs(url)
    for name in names:
        fs.get_file(f"{root}/{name}", str(into / name))
    return time.perf_counter() - started


def _fetch_verified(url: str, names: list[str], into: Path, expected: dict[str, str]) -> float:
    from datamodules.verified_chunks import VerifiedFiles

    started = time.perf_counter()
    files = VerifiedFiles(url, expected, str(into), max_cache_bytes=1 << 40)  # as the datamodule: atscale.json read
    for name in names:
        files.path(name)
    return time.perf_counter() - started


def bench_verify(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Both ways' fetch times over the rounds, their medians and the hash-only time."""
    from datamodules.verified_chunks import VerifiedFiles
    from recipes.soak.bucket import Bucket

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        bucket = Bucket(root / "moto.log")
        bucket.start()
        saved = dict(os.environ)
        try:
            os.environ.update(bucket.env())
            url = bucket.url("digits")
            console.print(f"preparing {url} (chunks of {args.chunk_items})")
            subprocess.run([sys.executable, "-m", "recipes.prepare", "digits", "--output", url, "--chunk_items",
                            str(args.chunk_items), "--staging", str(root / "staging")], cwd=root, check=True,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True)
            split = f"{url}/train"
            files = VerifiedFiles(split, None, str(root / "peek"), max_cache_bytes=1 << 40)
            names = [str(c["filename"]) for c in files.index()["chunks"]]
            sizes = [files.path(n).stat().st_size for n in names]
            blobs = [files.path(n).read_bytes() for n in names]
            times: dict[str, list[float]] = {way: [] for way in WAYS}
            for round_index in range(args.rounds):
                for way in (WAYS if round_index % 2 == 0 else WAYS[::-1]):
                    into = root / f"{way}-{round_index}"
                    into.mkdir()
                    fetch = _fetch_plain if way == "plain" else _fetch_verified
                    times[way].append(fetch(split, names, into, files.expected))
                    shutil.rmtree(into)
                console.print(f"round {round_index + 1}/{args.rounds}: "
                              + ", ".join(f"{w} {times[w][-1] * 1e3:.1f} ms" for w in WAYS))
            hashing = []
            for _ in range(args.rounds):
                started = time.perf_counter()
                for blob in blobs:
                    hashlib.sha256(blob).hexdigest()
                hashing.append(time.perf_counter() - started)
        finally:
            os.environ.clear()
            os.environ.update(saved)
            bucket.stop()
    medians = {way: statistics.median(times[way]) for way in WAYS}
    return {"rounds": args.rounds, "chunk_items": args.chunk_items, "chunks": len(names), "bytes": sum(sizes),
            "median_s": medians, "hash_only_s": statistics.median(hashing),
            "cost": medians["verified"] / medians["plain"] - 1, "times_s": times,
            "command": "python -m recipes.bench verify " + " ".join(sys.argv[2:])}


def print_verify(figures: dict[str, Any], console: Console) -> None:
    megabytes = figures["bytes"] / 1e6
    table = Table(title=f"{figures['chunks']} chunks, {megabytes:.2f} MB, median of {figures['rounds']} rounds")
    for column in ("way", "fetch (ms)", "MB/s"):
        table.add_column(column)
    for way in WAYS:
        seconds = figures["median_s"][way]
        table.add_row(way, f"{seconds * 1e3:.1f}", f"{megabytes / seconds:.0f}")
    table.add_row("hash only", f"{figures['hash_only_s'] * 1e3:.1f}", f"{megabytes / figures['hash_only_s']:.0f}")
    console.print(table)
    console.print(f"verified vs plain: {figures['cost']:+.1%} (ratio of the medians)")


def run(args: argparse.Namespace) -> int:
    for name in ("rounds", "chunk_items"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    console = Console(stderr=args.json)
    figures = bench_verify(args, console)
    emit(figures, args.json, lambda: print_verify(figures, console))
    return 0
