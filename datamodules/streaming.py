"""Data that does not fit in memory: litdata chunks streamed from a bucket or a folder, exact and elastic on resume.

``python -m recipes.prepare`` writes a dataset once, as litdata chunks (``litdata.optimize``), to a folder or a
bucket URL (``s3://``, ``gs://``)::

    <url>/atscale.json            what the data is: kind, shapes, the source's digest, every chunk's SHA-256
    <url>/train/index.json        litdata's chunk index of the training split, and its chunk-*.bin files
    <url>/val/index.json          the same for the validation split

The datamodules below fetch each file once into a local cache (deleted past ``max_cache_size``), verified against
``atscale.json``'s SHA-256 on the way and decoded only in the formats ``recipes.prepare`` writes
(:mod:`datamodules.verified_chunks`), decode each chunk whole into tensors (:mod:`datamodules.streamed_items`),
fetch and decode the next window of chunks while the current one trains (:mod:`datamodules.fetch_ahead`), and
train it through the project's own resumable loader (:func:`datamodules.loaders.stateful_train_loader`), not
litdata's ``StreamingDataLoader``.

Why not litdata's own loader state: it is per rank and counts batches of the world that saved it. litdata 0.2.76
re-stripes it when the world changes, but rounds the skipped prefix down to the *new* world's global batch (a
1 -> 2 resume after an odd number of steps trains a batch twice) and, with loader workers, skipped samples it had
never served (measured in ``docs/guides/streaming.md``). The project's global sample cursor
(:class:`datamodules.loaders.PassSampler`) already gives each sample once across world sizes and bitwise resume at
the same one, workers included; here it walks a *chunk-aware* order (:class:`ChunkOrder`): pass ``p`` shuffles the
chunks with seed ``seed + p``, then shuffles the items of each window of ``shuffle_window`` consecutive chunks
together. The order depends on the seed alone, never on the world or the workers, and the ranks walk it side by
side, so the local cache holds about one window of chunks at a time.

A read that keeps failing (the bucket is gone, the credentials were revoked) is retried for ``read_timeout_s``,
then ends the run with one line, ``atscale: the streamed data at <url> cannot be read ...``, and exit code 75: the
relaunch resumes from the newest checkpoint, as after a spot interruption. What a relaunch cannot fix ends the run at
once, with a line of its own and no requeue: damaged data (exit 65), a cache that cannot be written (exit 74), an
index that asks for a decoder that runs code (exit 2, before any item is read). A resumed run reads the data it
began with: the checkpoint holds the index digest, and other data at the URL is refused with both digests named.

Copy with it (paths under ``datamodules/``): ``loaders.py``, ``compat.py``, ``worker_signals.py``,
``verified_chunks.py``, ``stream_stops.py``, ``urls.py``, ``streamed_items.py``, ``fetch_ahead.py``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from .fetch_ahead import FetchAhead
from .loaders import ResumableLoader, stateful_train_loader
from .stream_stops import (
    UNAVAILABLE_EXIT_CODE,
    StopOnFault,
    StreamStopped,
    StreamUnavailable,
    _reason,  # noqa: F401 - where the tests and callers have read it
    stop,
)
from .streamed_items import StreamedItems
from .urls import check_data_url, redact
from .verified_chunks import StreamFault, fresh_fs, fsspec_path

__all__ = [
    "STREAM_FORMAT",
    "UNAVAILABLE_EXIT_CODE",
    "ChunkOrder",
    "StreamStopped",
    "StreamUnavailable",
    "StreamedItems",
    "StreamingImageDataModule",
    "StreamingTextDataModule",
    "index_digest",
    "read_text",
]

log = logging.getLogger(__name__)

#: Version of the layout ``recipes.prepare`` writes (``atscale.json``'s ``format``).
STREAM_FORMAT = 1
#: Where the MLflow dataset input and the manifest read the dataset's URL.
SPLITS = ("train", "val")


def join(url: str, *parts: str) -> str:
    """``url`` with ``parts`` appended by ``/`` (a bucket URL and a folder alike)."""
    return "/".join([url.rstrip("/"), *parts])


def read_text(url: str, fs: Any = None) -> str | None:
    """The text of the file at ``url`` (a path or a bucket URL), ``None`` when there is none; ``fs``: the filesystem
    object to read it with (default: one made for this call)."""
    fs, path = fresh_fs(url) if fs is None else (fs, fsspec_path(url))
    try:
        with fs.open(path, "rb") as handle:
            return handle.read().decode()
    except FileNotFoundError:
        return None


def index_digest(url: str, fs: Any = None) -> str:
    """SHA-256 of the dataset's chunk index: ``atscale.json`` (every chunk's SHA-256) and each split's index.json.

    What the data *is*, not when it was written: litdata stamps each index.json with its write time
    (``updated_at``), which is left out, and so are the index files' own hashes in ``atscale.json`` (they hash
    that stamp). The same source prepared twice has one digest; any changed chunk or layout changes it. ``fs``: the
    filesystem object to read with (default: one made for each file).

    Raises:
        FileNotFoundError: when ``url`` holds no complete prepared dataset.
    """
    texts = {}
    for name in DIGESTED:
        text = read_text(join(url, name), fs)
        if text is None:
            raise _unprepared(url, name)
        texts[name] = text
    return digest_of(texts)


#: The files the index digest is made of.
DIGESTED = ("atscale.json", *(f"{split}/index.json" for split in SPLITS))


def digest_of(texts: dict[str, str | bytes]) -> str:
    """:func:`index_digest` of the files' texts already read (each of :data:`DIGESTED`)."""
    digest = hashlib.sha256()
    for name in DIGESTED:
        content = _without_write_times(json.loads(texts[name]))
        digest.update(name.encode() + b"\0" + json.dumps(content, sort_keys=True).encode() + b"\0")
    return digest.hexdigest()


def _unprepared(url: str, name: str) -> FileNotFoundError:
    return FileNotFoundError(redact(f"{join(url, name)}: no such file; prepare the data first "
                                    f"(python -m recipes.prepare ... --output {url})"))


def _without_write_times(value: Any) -> Any:
    """``value`` less litdata's ``updated_at`` stamps and the hashes of the files that hold them."""
    if isinstance(value, dict):
        return {key: _without_write_times(item) for key, item in value.items()
                if key != "updated_at" and not key.endswith("index.json")}
    if isinstance(value, list):
        return [_without_write_times(item) for item in value]
    return value


class ChunkOrder:
    """The chunk-aware permutation of a pass, from its seed alone (never the world or the workers).

    The chunks are shuffled (``torch.randperm`` seeded ``seed``), cut into windows of ``window`` consecutive
    chunks, and each window's items are shuffled together with the same generator. Ranks that stride over this
    order read the same window of chunks at a time.

    Args:
        chunk_sizes: items in each chunk, in index order.
        window: chunks whose items are mixed together (1: chunk by chunk).
    """

    def __init__(self, chunk_sizes: Sequence[int], window: int = 4) -> None:
        if window < 1:
            raise ValueError(f"ChunkOrder(window={window!r}) must be >= 1.")
        self.sizes = [int(s) for s in chunk_sizes]
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64).tolist()
        self.window = window

    def windows(self, seed: int) -> list[list[int]]:
        """The chunks of each window of pass ``seed``, in the order the pass reads them."""
        chunks = torch.randperm(len(self.sizes), generator=torch.Generator().manual_seed(seed)).tolist()
        return [chunks[first:first + self.window] for first in range(0, len(chunks), self.window)]

    def __call__(self, seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        chunks = torch.randperm(len(self.sizes), generator=generator).tolist()
        out: list[int] = []
        for first in range(0, len(chunks), self.window):
            items = [i for c in chunks[first:first + self.window]
                     for i in range(self.starts[c], self.starts[c] + self.sizes[c])]
            out.extend(items[p] for p in torch.randperm(len(items), generator=generator).tolist())
        return out


class StreamingLoader(ResumableLoader):
    """The resumable loader whose iteration ends the run in one line when the data stays unreadable."""

    @override
    def __iter__(self) -> Iterator:
        trainer = self.trainer_ref
        return StopOnFault(super().__iter__(), loud=trainer is None or trainer.is_global_zero)


class _EvalLoader(DataLoader):
    """The validation loader: ends the run in one line when the data stays unreadable (as StreamingLoader)."""

    def __init__(self, *args: Any, loud: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loud = loud

    @override
    def __iter__(self) -> Iterator:
        return StopOnFault(super().__iter__(), loud=self.loud)


class _StreamingDataModule(pl.LightningDataModule):
    """What the image and token datamodules share: the URL, its description, the cache, the loaders."""

    kind = ""
    items_cls: type[StreamedItems] = StreamedItems

    def __init__(self, url: str, batch_size: int, shuffle_seed: int = 0, shuffle_window: int = 4,
                 num_workers: int = 0, cache_dir: str = "data/cache/stream", max_cache_size: str = "25GB",
                 read_timeout_s: float = 120.0, index_digest: str | None = None, fetch_ahead: int = 1) -> None:
        super().__init__()
        name = type(self).__name__
        if fetch_ahead < 0:
            raise ValueError(f"{name}(fetch_ahead={fetch_ahead!r}) must be >= 0 (0: no fetching ahead).")
        if batch_size < 1:
            raise ValueError(f"{name}(batch_size={batch_size!r}) must be >= 1.")
        if shuffle_window < 1:
            raise ValueError(f"{name}(shuffle_window={shuffle_window!r}) must be >= 1.")
        if read_timeout_s < 0:
            raise ValueError(f"{name}(read_timeout_s={read_timeout_s!r}) must be >= 0.")
        self.url = check_data_url(url, f"{name}(url={{url!r}})").rstrip("/") or "/"
        self.batch_size = batch_size
        self.shuffle_seed = shuffle_seed
        self.shuffle_window = shuffle_window
        self.num_workers = num_workers
        self.cache_dir = cache_dir
        self.max_cache_size = max_cache_size
        self.read_timeout_s = read_timeout_s
        self.index_digest = index_digest
        self.fetch_ahead = fetch_ahead
        self.shown_url = redact(self.url)
        self._fs: Any = None  # this process's filesystem object for the URL (a client's set-up: ~0.1-0.2 s)
        self._fs_pid = 0
        self._meta: dict[str, Any] | None = None
        self._meta_text = ""
        self._digest: str | None = None
        self._splits: dict[str, StreamedItems] = {}

    @property
    def meta(self) -> dict[str, Any]:
        """``atscale.json``: the dataset's kind, shapes and source (read once)."""
        if self._meta is None:
            name = type(self).__name__
            text = read_text(join(self.url, "atscale.json"), self.filesystem())
            if text is None:
                raise FileNotFoundError(f"{name}(url={self.url!r}): no prepared dataset there (no atscale.json); "
                                        f"run python -m recipes.prepare ... --output {self.url}")
            meta = json.loads(text)
            self._meta_text = text
            if not meta.get("complete"):
                raise FileNotFoundError(f"{name}(url={self.url!r}): the dataset there is not completely prepared; "
                                        "run the same python -m recipes.prepare command again to finish it.")
            if meta.get("kind") != self.kind:
                raise RuntimeError(f"{name}(url={self.url!r}) holds {meta.get('kind')!r} data, not {self.kind!r}.")
            self._meta = meta
        return self._meta

    def filesystem(self) -> Any:
        """The filesystem object this process reads the URL with, made once per datamodule and process (from this
        process's environment: :func:`fresh_fs`), shared by its splits' readers (each forked loader worker makes its
        own)."""
        if self._fs is None or self._fs_pid != os.getpid():
            self._fs, self._fs_pid = fresh_fs(self.url)[0], os.getpid()
        return self._fs

    def fingerprint(self) -> str:
        """The digest of the chunk index (:func:`index_digest`): the run's record of which data it saw.

        Each split's index is verified and checked for safe formats here, before any item is read.
        """
        if self._digest is None:
            self.meta  # noqa: B018 - a missing or unfinished dataset is named first
            texts: dict[str, str | bytes] = {"atscale.json": self._meta_text}
            with self._stops():
                for split in SPLITS:  # each index checked for safe formats and verified, read once
                    files = self._split(split).files
                    try:
                        files.index()
                    except FileNotFoundError:
                        raise _unprepared(self.url, f"{split}/index.json") from None
                    texts[f"{split}/index.json"] = files.index_bytes
            digest = digest_of(texts)
            if self.index_digest is not None and digest != self.index_digest:
                raise RuntimeError(f"{type(self).__name__}(url={self.url!r}): the data there has index digest "
                                   f"{digest[:12]}, not the {self.index_digest[:12]} asked for (index_digest): "
                                   "it was prepared again from other data since.")
            self._digest = digest
        return self._digest

    @contextlib.contextmanager
    def _stops(self) -> Iterator[None]:
        """Damage or an unwritable cache met outside the loaders: the same one line and exit code."""
        try:
            yield
        except StreamFault as err:
            raise stop(err, loud=self.trainer is None or self.trainer.is_global_zero) from None

    def state_dict(self) -> dict[str, Any]:
        """The data the run began with (its index digest): a resume refuses other data at the URL."""
        return {"index_digest": self.fingerprint()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Refuse to resume on data other than the checkpoint's (exit 2, both digests named; nothing trained)."""
        began = state_dict.get("index_digest")
        if began and began != self.fingerprint():
            raise stop(f"atscale: the data at {self.shown_url} has index digest {self.fingerprint()[:12]}, not the "
                       f"{began[:12]} this run began with: it was prepared again since. Resuming would train on "
                       "other data; start a new run (--fresh true or another --run_name), or put the original "
                       "data back and relaunch.", loud=self.trainer is None or self.trainer.is_global_zero, code=2)

    def dataset_source(self) -> dict[str, str]:
        """What the MLflow dataset input records: the URL and the index digest."""
        return {"url": self.url, "index_digest": self.fingerprint()}

    def prepare_data(self) -> None:
        self.fingerprint()

    def _split(self, split: str) -> StreamedItems:
        """The split's reader, made once per datamodule: the one ``fingerprint`` checked the index of."""
        if split not in self._splits:
            prefix = f"{split}/"
            expected = {name[len(prefix):]: sha for name, sha in (self.meta.get("files") or {}).items()
                        if name.startswith(prefix)}
            url = join(self.url, split)
            self._splits[split] = self.items_cls(
                url, self.cache_dir, self.max_cache_size, self.read_timeout_s, decoded_chunks=self.shuffle_window,
                expected=expected, shown_url=join(self.shown_url, split), fs=self.filesystem())
        return self._splits[split]

    def setup(self, stage: str | None = None) -> None:
        self.fingerprint()
        self.train_set = self._split("train")
        self.val_set = self._split("val")

    def train_dataloader(self) -> ResumableLoader:
        with self._stops():
            order = ChunkOrder(self.train_set.chunk_sizes(), self.shuffle_window)
            ahead = self._fetch_ahead(order)
        return stateful_train_loader(self.train_set, self.batch_size, self.shuffle_seed, self.trainer,
                                     self.num_workers, order=order, loader_cls=StreamingLoader,
                                     on_position=None if ahead is None else ahead.reached)

    def _fetch_ahead(self, order: ChunkOrder) -> FetchAhead | None:
        """The training split's fetch-ahead (:mod:`datamodules.fetch_ahead`), made anew with each loader.

        Without loader workers it decodes too (the training thread takes chunks decoded); with workers it fetches
        into the local copy, which the workers read. ``fetch_ahead=0``: none.
        """
        items = self.train_set
        if items.ahead is not None:
            items.ahead.close()
            items.ahead = None
        if self.fetch_ahead == 0:
            return None
        files = items.files
        ahead = FetchAhead(items.decode if self.num_workers == 0 else items.fetch, order.windows, items.chunk_of,
                           items.chunk_sizes(), items.chunk_bytes(), ahead=self.fetch_ahead,
                           budget_bytes=files.max_cache_bytes if files.remote else 1 << 62,
                           threads=max(2, min(8, self.shuffle_window)), keep=files.keep, name_of=items.chunk_name)
        items.ahead = ahead  # holds what it decoded until the cursor is a window past it
        return ahead

    def teardown(self, stage: str | None = None) -> None:
        """Stop the fetch-ahead's threads (none is left after a run, a stop or a failure)."""
        items = self._splits.get("train")
        if items is not None and items.ahead is not None:
            items.ahead.close()
            items.ahead = None

    def val_dataloader(self) -> DataLoader:
        # every rank evaluates the whole validation split, in order: exact metrics, no padding
        loud = self.trainer is None or self.trainer.is_global_zero
        return _EvalLoader(self.val_set, batch_size=self.val_batch_size(), shuffle=False, num_workers=0,
                           collate_fn=self.collate, loud=loud)

    def val_batch_size(self) -> int:
        return self.batch_size

    @staticmethod
    def collate(items: list[Any]) -> Any:
        raise NotImplementedError


class _ImageItems(StreamedItems):
    """Images as float32 ``(C, H, W)`` and int64 labels, stacked per chunk (an item is an index into them)."""

    @override
    def columns(self, items: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        images = np.stack([np.asarray(item["x"], dtype=np.float32) for item in items])
        return torch.from_numpy(images), torch.tensor([int(item["y"]) for item in items], dtype=torch.int64)

    @override
    def pick(self, columns: tuple[torch.Tensor, torch.Tensor], offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        return columns[0][offset], columns[1][offset]


class _TokenItems(StreamedItems):
    """Token windows as int64 ``(inputs, targets)`` shifted by one, stacked per chunk."""

    @override
    def columns(self, items: list[Any]) -> torch.Tensor:
        return torch.from_numpy(np.stack([np.asarray(item["x"]) for item in items]).astype(np.int64))

    @override
    def pick(self, columns: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = columns[offset]
        return window[:-1], window[1:]


class StreamingImageDataModule(_StreamingDataModule):
    """An image classification set prepared by ``python -m recipes.prepare digits|images|mnist``, streamed.

    Items are float32 images ``(C, H, W)`` as the in-memory datamodule scales them, and an int64 label.

    Args:
        url: the prepared dataset's folder or bucket URL (``s3://bucket/digits``).
        batch_size: samples per batch on each rank.
        shuffle_seed: seed of the training order (pass ``p`` uses ``shuffle_seed + p``).
        shuffle_window: chunks whose items one pass mixes together (a larger window shuffles better and needs a
            larger cache).
        num_workers: training loader worker processes.
        cache_dir: litdata's local cache of downloaded chunks.
        max_cache_size: the cache's budget (litdata deletes read chunks past it).
        read_timeout_s: how long a read may keep failing before the run ends (one ``atscale:`` line, exit 75).
        index_digest: when set, the data at ``url`` must have this index digest (``recipes.reproduce`` pins it).
        fetch_ahead: windows of chunks fetched (and decoded) ahead of the training cursor, in background threads,
            as far as ``max_cache_size`` holds them (0: each chunk is read when the cursor first needs it).

    Raises:
        ValueError: for a bad value (named).
        RuntimeError: when ``url`` holds data of another kind, or another index digest than ``index_digest``.
        FileNotFoundError: when ``url`` holds no complete prepared dataset.

    Example::

        dm = StreamingImageDataModule("s3://my-bucket/digits", batch_size=32)
        dm.setup("fit")
        x, y = next(iter(dm.val_dataloader()))   # x: (32, 1, 8, 8) float32, y: (32,) int64
    """

    kind = "images"
    items_cls = _ImageItems

    def __init__(self, url: str, batch_size: int = 32, shuffle_seed: int = 0, shuffle_window: int = 4,
                 num_workers: int = 0, cache_dir: str = "data/cache/stream", max_cache_size: str = "25GB",
                 read_timeout_s: float = 120.0, index_digest: str | None = None, fetch_ahead: int = 1) -> None:
        super().__init__(url, batch_size, shuffle_seed, shuffle_window, num_workers, cache_dir, max_cache_size,
                         read_timeout_s, index_digest, fetch_ahead)

    @property
    def num_classes(self) -> int:
        return int(self.meta["num_classes"])

    @override
    def val_batch_size(self) -> int:
        return 256

    @staticmethod
    def collate(items: list[Any]) -> Any:
        return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])

    def example_input(self) -> torch.Tensor:
        """The first validation image as a batch of one."""
        if not hasattr(self, "val_set"):
            self.setup("fit")
        return self.val_set[0][0].unsqueeze(0)


class StreamingTextDataModule(_StreamingDataModule):
    """Byte-level token windows prepared by ``python -m recipes.prepare text``, streamed.

    Each item is one window of ``block_size + 1`` bytes (``x`` and ``y`` shifted by one). The training split tiles
    the corpus's training bytes (stride ``block_size``: every byte after the first is a target once a pass); the
    validation split holds the very windows :class:`datamodules.text.TextDataModule` scores with the same
    ``val_windows``, so ``val/bpb`` compares across the two.

    Args:
        url: the prepared dataset's folder or bucket URL.
        block_size: the model's context; must be the one the data was prepared with.
        batch_size: windows per batch on each rank.
        shuffle_seed: seed of the training order.
        shuffle_window: chunks whose items one pass mixes together.
        num_workers: training loader worker processes.
        cache_dir: litdata's local cache of downloaded chunks.
        max_cache_size: the cache's budget.
        read_timeout_s: how long a read may keep failing before the run ends.
        index_digest: when set, the data at ``url`` must have this index digest.
        fetch_ahead: windows of chunks fetched ahead of the training cursor (0: none).

    Raises:
        ValueError: for a bad value (named).
        RuntimeError: for a ``block_size`` other than the prepared one, data of another kind, or another index
            digest than ``index_digest``.
        FileNotFoundError: when ``url`` holds no complete prepared dataset.
    """

    kind = "tokens"
    items_cls = _TokenItems
    vocab_size = 256

    def __init__(self, url: str, block_size: int = 128, batch_size: int = 16, shuffle_seed: int = 0,
                 shuffle_window: int = 4, num_workers: int = 0, cache_dir: str = "data/cache/stream",
                 max_cache_size: str = "25GB", read_timeout_s: float = 120.0, index_digest: str | None = None,
                 fetch_ahead: int = 1) -> None:
        super().__init__(url, batch_size, shuffle_seed, shuffle_window, num_workers, cache_dir, max_cache_size,
                         read_timeout_s, index_digest, fetch_ahead)
        self.block_size = block_size

    def _check_block_size(self) -> None:
        prepared = int(self.meta["block_size"])
        if prepared != self.block_size:
            raise RuntimeError(f"StreamingTextDataModule(block_size={self.block_size!r}): the data at {self.url} was "
                               f"prepared with block_size {prepared}.")

    @override
    def prepare_data(self) -> None:
        super().prepare_data()
        self._check_block_size()

    @override
    def setup(self, stage: str | None = None) -> None:
        self._check_block_size()
        super().setup(stage)

    @staticmethod
    def collate(items: list[Any]) -> Any:
        return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])

    def baseline_bits_per_byte(self) -> dict[str, float]:
        """The unigram and bigram bits per byte ``recipes.prepare`` counted (``TextDataModule``'s formula)."""
        return {k: float(v) for k, v in self.meta["baselines"].items()}

    def example_input(self) -> torch.Tensor:
        """The first validation window's inputs as a ``(1, block_size)`` batch."""
        if not hasattr(self, "val_set"):
            self.setup("fit")
        return self.val_set[0][0].unsqueeze(0)
