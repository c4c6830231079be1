"""One split of a prepared dataset as a map-style dataset: its chunks read verified, decoded whole, kept a while.

A chunk is read once (:meth:`datamodules.verified_chunks.VerifiedFiles.read`: fetched from the bucket or read from
the folder, its SHA-256 checked), decoded whole from those very bytes, and its items turned into the tensors a
batch is made of at once (:meth:`StreamedItems.columns`), so that serving item ``i`` costs what an in-memory
dataset's does: an index into a tensor. The last ``decoded_chunks`` chunks stay decoded; the training split is
also decoded ahead of the cursor by :class:`datamodules.fetch_ahead.FetchAhead` (the datamodule attaches it).

The chunk file's layout (``num_items``, ``num_items + 1`` offsets, then the items) is litdata's, as its
``PyTreeLoader`` documents it; each item's bytes are decoded by litdata's own ``PyTreeLoader.load_item_from_bytes``
(its serializers, restricted to the safe formats :func:`datamodules.verified_chunks.check_index` lets through).
Written by hand: litdata decodes items one read at a time through its ``StreamingDataset`` (3.3 ms an item in the
shuffled order of a window, 0.15 ms in chunk order, with its own cache), and has no call that decodes a chunk held
in memory. Decoding whole from memory takes about 9 us an item (digits).
``tests/unit/datamodules/test_streaming.py`` holds every item equal to litdata's own reader's.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.data import Dataset

from .compat import item_loader
from .stream_stops import UNAVAILABLE_EXIT_CODE, StreamUnavailable, _reason
from .urls import redact
from .verified_chunks import DataDamaged, StreamFault, UnsafeData, VerifiedFiles, cache_bytes

if TYPE_CHECKING:
    from .fetch_ahead import FetchAhead

__all__ = ["StreamedItems", "decode_chunk"]


def decode_chunk(data: bytes, loader: Any, chunk: int) -> list[Any]:
    """The items of one chunk file's bytes, in order (``loader``: a litdata ``PyTreeLoader`` set up for its index).

    Raises:
        ValueError: when the bytes do not hold the layout (verified bytes always do; damage is caught before).
    """
    view = memoryview(data)
    if len(view) < 4:
        raise ValueError(f"a chunk of {len(view)} bytes has no item count")
    count = int(np.frombuffer(view, np.uint32, 1)[0])
    if 4 * (count + 2) > len(view):
        raise ValueError(f"a chunk of {len(view)} bytes cannot hold the offsets of {count} items")
    offsets = np.frombuffer(view, np.uint32, count + 1, 4).tolist()
    if offsets[-1] > len(view) or any(b < a for a, b in itertools.pairwise(offsets)):
        raise ValueError(f"a chunk of {len(view)} bytes has item offsets past its end")
    return [loader.load_item_from_bytes(bytes(view[offsets[k]:offsets[k + 1]]), chunk) for k in range(count)]


class StreamedItems(Dataset):
    """One split of a prepared dataset: item ``i`` read from its chunk, verified and decoded whole.

    The object pickles as its settings (a loader worker reads and decodes on its own). Damage or an unwritable
    cache raises at once; a failed read is retried (every 0.5 s) for ``read_timeout_s``, then raises
    :class:`StreamUnavailable`.

    Args:
        url: the split's folder or bucket URL (``<dataset url>/train``).
        cache_dir: where a bucket's verified files are copied.
        max_cache_size: the copy's budget (``"1GB"``, bytes).
        read_timeout_s: how long a read may keep failing before the run ends.
        decoded_chunks: chunks kept decoded in memory (each loader worker keeps its own); the datamodules pass
            their ``shuffle_window``, the chunks one stretch of the order reads from.
        expected: SHA-256 of each of the split's files by name (``atscale.json``'s ``files``, this split's part).
        shown_url: ``url`` as messages print it (credentials redacted).
        fs: the filesystem object this process reads ``url`` with (default: one of its own, made on first use).
    """

    def __init__(self, url: str, cache_dir: str, max_cache_size: str | int = "25GB",
                 read_timeout_s: float = 120.0, decoded_chunks: int = 4, expected: dict[str, str] | None = None,
                 shown_url: str | None = None, fs: Any = None) -> None:
        if decoded_chunks < 1:
            raise ValueError(f"StreamedItems(decoded_chunks={decoded_chunks!r}) must be >= 1.")
        self.url = url
        self.shown_url = shown_url or redact(url)
        self.files = VerifiedFiles(url, expected, cache_dir, cache_bytes(max_cache_size), self.shown_url, fs)
        self.cache_dir = cache_dir
        self.max_cache_size = max_cache_size
        self.read_timeout_s = read_timeout_s
        self.decoded_chunks = decoded_chunks
        #: Decodes ahead of the training cursor (in the process that made it only: a forked worker reads alone).
        self.ahead: FetchAhead | None = None
        self._loader: Any = None
        self._loader_lock = threading.Lock()
        self._length: int | None = None
        self._starts: list[int] | None = None
        self._names: list[str] | None = None
        self._decoded: collections.OrderedDict[int, Any] = collections.OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "ahead": None, "_loader": None, "_loader_lock": None,
                "_decoded": collections.OrderedDict()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _loader_lock=threading.Lock())

    def chunk_sizes(self) -> list[int]:
        """Items in each chunk, in the index's order (item ``i`` lies in the chunk its cumulative count says)."""
        chunks = self.files.index()["chunks"]
        self._names = [str(chunk["filename"]) for chunk in chunks]
        return [int(chunk["chunk_size"]) for chunk in chunks]

    def chunk_bytes(self) -> list[int]:
        """Each chunk file's size in bytes, in the index's order."""
        return [int(chunk.get("chunk_bytes") or 0) for chunk in self.files.index()["chunks"]]

    def chunk_name(self, chunk: int) -> str:
        if self._names is None:
            self.chunk_sizes()
        assert self._names is not None
        return self._names[chunk]

    def chunk_of(self, index: int) -> int:
        """The chunk item ``index`` lies in."""
        if self._starts is None:
            self._starts = list(itertools.accumulate(self.chunk_sizes(), initial=0))
        if not 0 <= index < self._starts[-1]:
            raise IndexError(f"{self.shown_url}: item {index} of {self._starts[-1]}")
        return bisect.bisect_right(self._starts, index) - 1

    def _item_loader(self) -> Any:
        """litdata's ``PyTreeLoader`` set up for this split's (verified, safe) index: what decodes an item's bytes."""
        with self._loader_lock:
            if self._loader is None:
                self._loader = item_loader(self.files.index())
            return self._loader

    def decode(self, chunk: int) -> Any:
        """Chunk ``chunk`` read (verified) and decoded whole, as :meth:`columns` holds it."""
        name = self.chunk_name(chunk)
        data = self.files.read(name)
        try:
            items = decode_chunk(data, self._item_loader(), chunk)
        except ValueError as err:  # bytes that hash right and decode wrong: the index and the chunk disagree
            raise DataDamaged(self.files.damaged(name, f"it does not decode as its index says ({err})")) from None
        return self.columns(items)

    def fetch(self, chunk: int) -> None:
        """Chunk ``chunk`` fetched and verified into the local copy, not decoded (for the loader workers to read)."""
        self.files.read(self.chunk_name(chunk))

    def columns(self, items: list[Any]) -> Any:
        """A decoded chunk as items are served from it (here: the list); subclasses stack tensors."""
        return items

    def pick(self, columns: Any, offset: int) -> Any:
        """Item ``offset`` of a chunk held as :meth:`columns` made it."""
        return columns[offset]

    def _chunk(self, chunk: int) -> Any:
        """Chunk ``chunk`` decoded: from the ones kept, from the fetch-ahead, else read now (and kept)."""
        columns = self._decoded.get(chunk)
        if columns is not None:
            self._decoded.move_to_end(chunk)
            return columns
        ahead = self.ahead
        if ahead is not None and ahead.pid == os.getpid():
            columns = ahead.take(chunk)
        if columns is None:
            columns = self.decode(chunk)
        self._decoded[chunk] = columns
        while len(self._decoded) > self.decoded_chunks:
            self._decoded.popitem(last=False)
        return columns

    def __len__(self) -> int:
        if self._length is None:
            self._length = sum(self.chunk_sizes())
        return self._length

    def __getitem__(self, index: int) -> Any:
        index = int(index)
        deadline = None
        while True:
            try:
                chunk = self.chunk_of(index)
                assert self._starts is not None
                return self.pick(self._chunk(chunk), index - self._starts[chunk])
            except (KeyboardInterrupt, SystemExit, MemoryError, IndexError):  # IndexError: past the split's end
                raise
            except (StreamFault, UnsafeData):  # damage, the local cache: a retry meets the same
                raise
            except Exception as err:  # a network, permission or missing-object error of the store
                now = time.monotonic()
                deadline = deadline if deadline is not None else now + self.read_timeout_s
                if now >= deadline:
                    raise StreamUnavailable(
                        f"atscale: the streamed data at {self.shown_url} cannot be read ({_reason(err)}) "
                        f"for {self.read_timeout_s:g} s; the run stopped (exit {UNAVAILABLE_EXIT_CODE}). Relaunch the "
                        "same command once it is back: it resumes from the newest checkpoint.") from None
                self.files.reset()  # a fresh client on the next try
                time.sleep(0.5)
