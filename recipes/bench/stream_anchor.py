"""Loader-only epochs for ``python -m recipes.bench stream``: litdata's loader as the anchor, a set past the cache.

The bench starts each epoch in a fresh interpreter (an empty chunk cache, no warm client, no page cache of the
parent's), ``python -m recipes.bench.stream_anchor --loader ours|litdata --url ... --cache-dir ...``, which prints
one JSON line. It is not a command of its own.

- ``--loader ours``: the project's training loader, built as a Trainer builds it but without one: the streaming
  datamodule's public constructor (``url``, ``batch_size``, ``num_workers``, ``cache_dir``, ``max_cache_size``,
  and ``block_size`` for tokens), ``prepare_data()``, ``setup("fit")``, ``train_dataloader()``; its ``trainer`` is
  ``None``, which the datamodules read as one process.
- ``--loader litdata``: ``StreamingDataLoader(StreamingDataset(<url>/train, shuffle=True, cache_dir, max_cache_size,
  storage_options={"endpoint_url": $AWS_ENDPOINT_URL}), batch_size, num_workers)``, litdata's default collate (a
  dict of stacked tensors). litdata 0.2.76 fetches chunks with obstore, which refuses an ``http://`` endpoint unless
  its client allows http (``BadScheme``); the child wraps the public ``obstore.store.S3Store`` so every store it
  makes adds ``allow_http`` (a real bucket is ``https://``, where nothing changes): litdata's own fetch path, not a
  fallback.

Both read the same chunks in the same bucket through the same proxy, one epoch of the training split with the same
batch size and workers. The clock runs from the loader's creation (the dataset's index read included, imports
excluded) to the last batch; the figure is samples per second of that span.

With ``--sample S`` a thread samples every ``S`` seconds the cache folder's bytes on disk and the resident memory
of the process and its loader workers (psutil), and once more when 10% of the batches are out and at the end:
the peaks then say whether the cache kept its budget and whether memory stayed flat over an epoch larger than the
cache (:func:`write_image_folder` makes such a set). The memory is summed over the processes, so pages the workers
share with their parent count once a process: compare an epoch's peak with its own first 10%, not worker counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
#: The loaders an anchor epoch compares, in the order a round runs them (reversed every other round).
LOADERS = ("ours", "litdata")
#: The synthetic set's images: 3 x 32 x 32 float32 once prepared (what ``recipes.prepare images`` stores).
IMAGE_SHAPE = (3, 32, 32)
ITEM_BYTES = 4 * IMAGE_SHAPE[0] * IMAGE_SHAPE[1] * IMAGE_SHAPE[2]
CLASSES = 10


def disk_use(folder: Path) -> int:
    """Bytes of the files under ``folder`` (0 when it does not exist; a file deleted while walking counts 0)."""
    total = 0
    if folder.exists():
        for path in folder.rglob("*"):
            try:
                total += path.stat().st_size if path.is_file() else 0
            except OSError:
                continue
    return total


def write_image_folder(root: Path, total_bytes: int, seed: int = 0) -> int:
    """An ImageFolder of random RGB PNGs, ``<root>/<class>/<n>.png``, that prepares to about ``total_bytes``.

    Each image becomes ``ITEM_BYTES`` (12,288) bytes of float32 once ``recipes.prepare images`` has read it; the
    PNGs on disk are a quarter of that. Returns the number of images (at least two per class).
    """
    import numpy as np
    from PIL import Image

    count = max(2 * CLASSES, total_bytes // ITEM_BYTES)
    rng = np.random.default_rng(seed)
    channels, height, width = IMAGE_SHAPE
    for index in range(count):
        folder = root / f"class{index % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
        Image.fromarray(pixels, "RGB").save(folder / f"{index:07d}.png", compress_level=1)
    return count


def large_chunk_items(total_bytes: int, budget: int) -> int:
    """Items a chunk of the large set: a chunk of at most a hundredth of the set and an eighth of the budget
    (a window of 4 chunks and the next one fetched ahead stay inside it), at least one item."""
    return max(1, min(total_bytes // 100, budget // 8) // ITEM_BYTES)


def loader_epoch(loader: str, url: str, kind: str, batch_size: int, workers: int, cache_dir: Path,
                 max_cache_size: str, env: dict[str, str], block_size: int = 128, sample_s: float = 0.0,
                 timeout: float = 3600) -> dict[str, Any]:
    """One epoch of ``loader`` in a fresh interpreter (this module as ``__main__``); its figures.

    Returns:
        ``{"samples", "batches", "seconds", "samples_per_s"}``, and with ``sample_s > 0`` ``"cache_peak_bytes"``,
        ``"rss_early_peak_bytes"`` (the peak until 10% of the batches were out) and ``"rss_peak_bytes"``.

    Raises:
        RuntimeError: when the epoch's process fails (the tail of its stderr).
    """
    argv = [sys.executable, "-m", "recipes.bench.stream_anchor", "--loader", loader, "--url", url, "--kind", kind,
            "--batch-size", str(batch_size), "--workers", str(workers), "--cache-dir", str(cache_dir),
            "--max-cache-size", max_cache_size, "--block-size", str(block_size), "--sample", str(sample_s)]
    result = subprocess.run(argv, cwd=cache_dir.parent, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True,
                            text=True, timeout=timeout)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"the {loader} loader's epoch exited {result.returncode}: {result.stderr[-2000:]}")
    return json.loads(lines[-1])


# ------------------------------------------------------------------------------------------- the child process
def _allow_http_endpoints() -> None:
    """Make every obstore S3 store litdata builds accept an ``http://`` endpoint (the local proxy)."""
    import obstore.store

    plain = obstore.store.S3Store

    def store(*args: Any, client_options: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        return plain(*args, client_options={**(client_options or {}), "allow_http": True}, **kwargs)

    obstore.store.S3Store = store


def _litdata_loader(url: str, batch_size: int, workers: int, cache_dir: str, max_cache_size: str) -> Any:
    from litdata import StreamingDataLoader, StreamingDataset

    options = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]} if os.environ.get("AWS_ENDPOINT_URL") else None
    dataset = StreamingDataset(f"{url.rstrip('/')}/train", shuffle=True, cache_dir=cache_dir,
                               max_cache_size=max_cache_size, storage_options=options)
    return StreamingDataLoader(dataset, batch_size=batch_size, num_workers=workers)


def _our_loader(url: str, kind: str, batch_size: int, workers: int, cache_dir: str, max_cache_size: str,
                block_size: int) -> Any:
    from datamodules.streaming import StreamingImageDataModule, StreamingTextDataModule

    settings: dict[str, Any] = {"batch_size": batch_size, "num_workers": workers, "cache_dir": cache_dir,
                                "max_cache_size": max_cache_size}
    if kind == "tokens":
        dm: Any = StreamingTextDataModule(url, block_size=block_size, **settings)
    else:
        dm = StreamingImageDataModule(url, **settings)
    dm.prepare_data()
    dm.setup("fit")
    return dm.train_dataloader()


def _batch_len(batch: Any) -> int:
    """Samples in a batch: a dict of tensors (litdata's collate) or a tuple ``(x, y)`` (ours)."""
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return len(first)


class _Sampler(threading.Thread):
    """Every ``every`` seconds: the bytes under ``cache_dir`` and the resident memory of this process and its
    children (the loader workers)."""

    def __init__(self, cache_dir: Path, every: float) -> None:
        super().__init__(name="stream-sampler", daemon=True)
        import psutil

        self.cache_dir = cache_dir
        self.every = every
        self.process = psutil.Process()
        self.samples: list[tuple[float, int, int]] = []  # (time, cache bytes, rss bytes)
        self.stopped = threading.Event()

    def rss(self) -> int:
        import psutil

        total = self.process.memory_info().rss
        for child in self.process.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:  # a worker that just ended
                continue
        return total

    def sample(self) -> float:
        now = time.perf_counter()
        self.samples.append((now, disk_use(self.cache_dir), self.rss()))
        return now

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            self.sample()


def epoch(batches: Iterable[Any], total: int, sampler: _Sampler | None) -> tuple[int, int, float | None]:
    """Draw every batch; ``(samples, batches, when 10% of them were out)`` (that time only with a sampler)."""
    samples = count = 0
    early = None
    for batch in batches:
        samples += _batch_len(batch)
        count += 1
        if sampler is not None and early is None and count >= max(1, total // 10):
            early = sampler.sample()
    return samples, count, early


def main(argv: Sequence[str] | None = None) -> int:
    from recipes.run.common import ArgumentParser

    parser = ArgumentParser(prog="python -m recipes.bench.stream_anchor", description=__doc__.splitlines()[0])
    parser.add_argument("--loader", choices=LOADERS, required=True, help="whose loader draws the epoch")
    parser.add_argument("--url", required=True, help="the prepared dataset's bucket URL")
    parser.add_argument("--kind", choices=("images", "tokens"), default="images", help="what the data holds")
    parser.add_argument("--batch-size", dest="batch_size", type=int, default=32, help="samples per batch")
    parser.add_argument("--workers", type=int, default=0, help="loader worker processes")
    parser.add_argument("--cache-dir", dest="cache_dir", required=True, help="the (empty) chunk cache")
    parser.add_argument("--max-cache-size", dest="max_cache_size", default="200KB", help="the cache's budget")
    parser.add_argument("--block-size", dest="block_size", type=int, default=128, help="tokens: the context")
    parser.add_argument("--sample", type=float, default=0.0, help="sample cache and memory every this many s (0: no)")
    args = parser.parse_args(argv)
    import litdata  # noqa: F401 - both sides' imports before the clock

    import datamodules.streaming  # noqa: F401

    if args.loader == "litdata":
        _allow_http_endpoints()
    sampler = _Sampler(Path(args.cache_dir), args.sample) if args.sample > 0 else None
    if sampler is not None:
        sampler.sample()
        sampler.start()
    started = time.perf_counter()
    if args.loader == "litdata":
        loader = _litdata_loader(args.url, args.batch_size, args.workers, args.cache_dir, args.max_cache_size)
    else:
        loader = _our_loader(args.url, args.kind, args.batch_size, args.workers, args.cache_dir, args.max_cache_size,
                             args.block_size)
    samples, batches, early = epoch(loader, len(loader), sampler)
    seconds = time.perf_counter() - started
    figures: dict[str, Any] = {"loader": args.loader, "samples": samples, "batches": batches, "seconds": seconds,
                               "samples_per_s": samples / seconds}
    if sampler is not None:
        sampler.stopped.set()
        sampler.join()
        end = sampler.sample()
        early = end if early is None else early
        figures.update(cache_peak_bytes=max(c for _, c, _ in sampler.samples),
                       rss_early_peak_bytes=max(r for t, _, r in sampler.samples if t <= early),
                       rss_peak_bytes=max(r for _, _, r in sampler.samples), samples_taken=len(sampler.samples))
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
