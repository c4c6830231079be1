"""``python -m recipes.bench chunks``: how fast a split arrives by chunk size, through a store a network away.

What ``recipes.prepare --chunk_bytes`` should default to. Each request to an object store pays a first-byte latency
before its bytes flow at a per-connection bandwidth, so small chunks spend their time waiting and large ones hold
memory: the decoded chunks of the cursor's window, the one before it and the one fetched ahead stay in memory (in
each loader worker too). This bench puts the same bytes (``--split-mb`` of random data) in moto's S3 server behind
the loopback proxy shaped as a same-region bucket (:class:`recipes.soak.bucket.Bucket`: ``--latency-ms`` a
request, ``--bandwidth-mb-s`` a connection) as chunks of each ``--sizes``, and reads each split through the
project's own fetch-ahead (:class:`datamodules.fetch_ahead.FetchAhead` over
:class:`datamodules.verified_chunks.VerifiedFiles`: windows of 4 chunks, one window ahead, its threads, every file
verified), a consumer taking the chunks in order as fast as they come. Rounds are interleaved over the sizes (the
order alternates); each size's figure is the median of its rounds' MB/s, with the min-max beside it, and the memory
a window of 4 chunks times 3 holds::

    python -m recipes.bench chunks --rounds 5 --split-mb 64 --sizes 256KB,1MB,4MB,16MB,64MB --json

moto serves from this process (a thread): its own CPU per request is part of what the figures include, as a real
store's service time is; the proxy's shaping is the larger cost at the default settings.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from recipes.bench.output import emit
from recipes.run.common import UsageError

WINDOW = 4  # chunks a window (the datamodules' default shuffle_window)
AHEAD = 1  # windows fetched ahead (the datamodules' default fetch_ahead)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every size")
    parser.add_argument("--split-mb", dest="split_mb", type=float, default=64.0,
                        help="the split's size in MB (10^6 bytes), the same bytes cut at every chunk size")
    parser.add_argument("--sizes", default="256KB,1MB,4MB,16MB,64MB", help="chunk sizes, comma-separated")
    parser.add_argument("--latency-ms", dest="latency_ms", type=float, default=30.0,
                        help="the store's first-byte latency a request (0: none)")
    parser.add_argument("--bandwidth-mb-s", dest="bandwidth_mb_s", type=float, default=100.0,
                        help="the store's bandwidth a connection, MB/s (0: unlimited)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def _sizes(text: str) -> list[int]:
    from datamodules.verified_chunks import cache_bytes

    sizes = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            size = cache_bytes(int(part) if part.isdigit() else part)
        except ValueError:
            size = 0
        if size < 1:
            raise UsageError(f"--sizes: {part!r} is not a size such as 1MB or 256KB")
        sizes.append(size)
    if not sizes:
        raise UsageError("--sizes: no size given (expected e.g. 1MB,16MB)")
    return sizes


def _upload(fs: Any, root: str, data: bytes, size: int) -> dict[str, str]:
    """``data`` cut into files of ``size`` bytes under ``root``; their SHA-256 by name."""
    expected = {}
    for k, start in enumerate(range(0, len(data), size)):
        name = f"chunk-{k}.bin"
        blob = data[start:start + size]
        fs.pipe_file(f"{root}/{name}", blob)
        expected[name] = hashlib.sha256(blob).hexdigest()
    return expected


def _read_split(url: str, expected: dict[str, str], cache: Path, size: int) -> float:
    """Seconds to take every chunk of the split in order through the fetch-ahead (an empty cache)."""
    from datamodules.fetch_ahead import FetchAhead
    from datamodules.verified_chunks import VerifiedFiles

    names = sorted(expected, key=lambda n: int(n.split("-")[1].split(".")[0]))
    files = VerifiedFiles(url, expected, str(cache), max_cache_bytes=1 << 62)
    windows = [list(range(i, min(i + WINDOW, len(names)))) for i in range(0, len(names), WINDOW)]
    ahead = FetchAhead(lambda c: files.read(names[c]), lambda seed: windows, lambda index: index, [1] * len(names),
                       [size] * len(names), ahead=AHEAD, threads=max(2, min(8, WINDOW)))
    started = time.perf_counter()
    try:
        for chunk in range(len(names)):
            ahead.reached(0, chunk, chunk)
            if ahead.take(chunk) is None:
                files.read(names[chunk])
    finally:
        ahead.close()
    return time.perf_counter() - started


def bench_chunks(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    from recipes.soak.bucket import Bucket

    sizes = _sizes(args.sizes)
    total = int(args.split_mb * 1e6)
    data = os.urandom(total)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        bucket = Bucket(root / "moto.log")
        bucket.start()
        try:
            expected = {size: _upload(bucket.fs(), f"{Bucket.NAME}/chunks-{size}", data, size) for size in sizes}
            bucket.shape(args.latency_ms / 1e3, args.bandwidth_mb_s * 1e6 if args.bandwidth_mb_s else None)
            for key, value in bucket.env().items():
                os.environ[key] = value
            times: dict[int, list[float]] = {size: [] for size in sizes}
            for round_index in range(args.rounds):
                order = sizes if round_index % 2 == 0 else sizes[::-1]
                for size in order:
                    console.print(f"round {round_index + 1}/{args.rounds}: chunks of {size:,} bytes")
                    cache = root / "cache" / f"{size}-{round_index}"
                    times[size].append(_read_split(bucket.url(f"chunks-{size}"), expected[size], cache, size))
        finally:
            bucket.stop()
    rows = []
    for size in sizes:
        speeds = [total / 1e6 / t for t in times[size]]
        rows.append({"chunk_bytes": size, "chunks": len(expected[size]), "mb_per_s": statistics.median(speeds),
                     "min_mb_per_s": min(speeds), "max_mb_per_s": max(speeds),
                     "held_mb": size * WINDOW * (2 + AHEAD) / 1e6, "seconds": times[size]})
    return {"rounds": args.rounds, "split_mb": args.split_mb, "latency_ms": args.latency_ms,
            "bandwidth_mb_s": args.bandwidth_mb_s, "window": WINDOW, "ahead": AHEAD, "rows": rows,
            "command": "python -m recipes.bench chunks " + " ".join(sys.argv[2:])}


def print_chunks(figures: dict[str, Any], console: Console) -> None:
    link = (f"{figures['latency_ms']:g} ms a request, "
            + (f"{figures['bandwidth_mb_s']:g} MB/s a connection" if figures["bandwidth_mb_s"] else "unlimited"))
    table = Table(title=f"a {figures['split_mb']:g} MB split through the fetch-ahead ({link}), "
                        f"median of {figures['rounds']} round(s)")
    for column in ("chunk", "chunks", "MB/s (min-max)", "decoded held (3 windows of 4)"):
        table.add_column(column)
    for row in figures["rows"]:
        table.add_row(f"{row['chunk_bytes'] / 1e6:g} MB", str(row["chunks"]),
                      f"{row['mb_per_s']:,.1f} ({row['min_mb_per_s']:,.1f}-{row['max_mb_per_s']:,.1f})",
                      f"{row['held_mb']:,.1f} MB")
    console.print(table)


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise UsageError(f"--rounds {args.rounds} must be >= 1")
    if not args.split_mb > 0:
        raise UsageError(f"--split-mb {args.split_mb} must be > 0")
    if args.latency_ms < 0 or args.bandwidth_mb_s < 0:
        raise UsageError(f"--latency-ms {args.latency_ms:g} / --bandwidth-mb-s {args.bandwidth_mb_s:g} must be >= 0")
    sizes = _sizes(args.sizes)
    if max(sizes) > args.split_mb * 1e6:
        raise UsageError(f"--sizes: a chunk of {max(sizes):,} bytes is larger than the split (--split-mb "
                         f"{args.split_mb:g})")
    console = Console(stderr=args.json)
    figures = bench_chunks(args, console)
    emit(figures, args.json, lambda: print_chunks(figures, console))
    return 0
