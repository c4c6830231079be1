"""Fetch ahead of the cursor: the chunks a pass reads next are fetched (and decoded) in background threads.

The order of a pass is known before it is walked (:class:`datamodules.streaming.ChunkOrder`, drawn from the seed
alone), so when the training sampler hands out a position, the windows of chunks after it are known too. The
sampler tells :class:`FetchAhead` where it is (:meth:`FetchAhead.reached`, before each index it hands out); at each
new window it queues the chunks of the next ``windows`` windows (running on into the next pass, seed + 1), the
chunk holding the cursor first (a resume reads it before anything else), as many as the cache's budget holds. A few
threads fetch them in parallel, each chunk verified on the way (:class:`datamodules.verified_chunks.VerifiedFiles`);
without loader workers they decode it too, and the training thread takes it decoded; with workers this process
only fetches into the local copy, which the workers read (a fetch in flight is shared, never repeated: the copy's
per-file lock). Chunks behind the cursor are released: decoded ones dropped, and the copy's budget deletes the
oldest files first but never a chunk the cursor is about to read.

A failed fetch is forgotten: the reader then reads the chunk itself, with its retries and its one-line stop (the
outage semantics are the reader's, whether or not a fetch ran ahead). :meth:`FetchAhead.close` stops the threads
(daemon threads: a fetch stuck on a dead store never holds up the process's exit).

Written by hand: litdata's own prefetch follows its own sampler's order, reads into its own cache and decodes item
by item; the order here is the project's global cursor, the same at any world size.
"""

from __future__ import annotations

import bisect
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

__all__ = ["FetchAhead"]

_STOP = -1
#: How long :meth:`FetchAhead.close` waits for the loads in flight to end (the threads are daemons: a load stuck on a
#: dead store is left to end with the process).
CLOSE_TIMEOUT_S = 5.0


class FetchAhead:
    """Loads the chunks after the cursor's window in background threads, within a budget of bytes.

    Args:
        load: loads chunk ``c`` (fetch and verify; and decode, when the training thread takes the result).
        windows: the chunks of each window of pass ``seed``, in the order the pass reads them.
        chunk_of: the chunk that item ``index`` lies in.
        chunk_items: items in each chunk (index order).
        chunk_bytes: each chunk's size in bytes (index order).
        ahead: windows loaded after the cursor's (``>= 1``).
        budget_bytes: bytes the queued chunks may hold at once (the local copy's budget); at least the cursor's
            window is always loaded.
        threads: loads in flight at once.
        keep: told the names of the chunks the cursor is about to read (the local copy keeps them).
        name_of: the file name of chunk ``c`` (for ``keep``).
    """

    def __init__(self, load: Callable[[int], Any], windows: Callable[[int], list[list[int]]],
                 chunk_of: Callable[[int], int], chunk_items: Sequence[int], chunk_bytes: Sequence[int], ahead: int = 1,
                 budget_bytes: int = 1 << 62, threads: int = 4,
                 keep: Callable[[set[str]], None] | None = None, name_of: Callable[[int], str] | None = None) -> None:
        if ahead < 1 or threads < 1:
            raise ValueError(f"FetchAhead(ahead={ahead!r}, threads={threads!r}): both must be >= 1.")
        self.load = load
        self.windows = windows
        self.chunk_of = chunk_of
        self.chunk_items = list(chunk_items)
        self.chunk_bytes = list(chunk_bytes)
        self.ahead = ahead
        self.budget_bytes = budget_bytes
        self.threads = threads
        self.keep = keep
        self.name_of = name_of
        #: The process that made it: a forked loader worker inherits the object, never its threads.
        self.pid = os.getpid()
        self._queue: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._loads: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        self._closed = False
        self._seed: int | None = None
        self._bounds: list[int] = [0]
        self._lo = self._hi = 0  # the cursor's window's positions
        self._plans: dict[int, list[list[int]]] = {}

    # ------------------------------------------------------------ the sampler's side
    def reached(self, seed: int, position: int, index: int) -> None:
        """The sampler is about to hand out ``index``, at ``position`` of pass ``seed``: plan at a new window."""
        if (seed == self._seed and self._lo <= position < self._hi) or self._closed:
            return
        self._plan(seed, position, index)

    def _windows_of(self, seed: int) -> list[list[int]]:
        if seed not in self._plans:
            self._plans = {s: w for s, w in self._plans.items() if s in (seed - 1, seed)}
            self._plans[seed] = self.windows(seed)
        return self._plans[seed]

    def _plan(self, seed: int, position: int, index: int) -> None:
        windows = self._windows_of(seed)
        if seed != self._seed:
            self._seed = seed
            self._bounds = list(itertools.accumulate((sum(self.chunk_items[c] for c in w) for w in windows), initial=0))
        at = max(0, bisect.bisect_right(self._bounds, position) - 1)
        self._lo, self._hi = self._bounds[at], self._bounds[min(at + 1, len(self._bounds) - 1)]
        following = [chunk for w in windows[at:at + 1 + self.ahead] for chunk in w]
        short = self.ahead - (len(windows) - at - 1)
        if short > 0:  # the pass ends within reach: the next one's first windows follow
            following += [chunk for w in self._windows_of(seed + 1)[:short] for chunk in w]
        first = self.chunk_of(index)
        wanted = [first] + [c for c in dict.fromkeys(following) if c != first]  # a resume's item first
        current = set(windows[at]) | {first}
        planned, total = [], 0
        for chunk in wanted:  # the cursor's window always; then as far as the budget goes
            total += self.chunk_bytes[chunk]
            if chunk not in current and total > self.budget_bytes:
                break
            planned.append(chunk)
        previous = set(windows[at - 1]) if at > 0 else set()
        with self._lock:
            for chunk in [c for c in self._loads if c not in previous and c not in planned]:
                self._loads.pop(chunk).cancel()  # behind the cursor, or no longer planned: released
            fresh = [c for c in planned if c not in self._loads]
            for chunk in fresh:
                self._loads[chunk] = Future()
        if self.keep is not None and self.name_of is not None:  # within the budget (the cursor's window beyond it)
            self.keep({self.name_of(c) for c in planned})
        self._start()
        for chunk in fresh:
            self._queue.put(chunk)

    # ------------------------------------------------------------ the reader's side
    def take(self, chunk: int) -> Any:
        """Chunk ``chunk`` as ``load`` returned it (waiting while it loads); ``None`` when it was not planned or its
        load failed (the reader then reads it itself)."""
        with self._lock:
            future = self._loads.get(chunk)
        if future is None:
            return None
        try:
            return future.result()
        except BaseException:  # a cancelled or failed load: the reader reads it and meets the error
            with self._lock:
                if self._loads.get(chunk) is future:
                    del self._loads[chunk]
            return None

    def close(self) -> None:
        """Stop loading: queued loads are dropped, the threads end after the load they are in."""
        with self._lock:
            self._closed = True
            for future in self._loads.values():
                future.cancel()
            self._loads.clear()
        for _ in self._workers:
            self._queue.put(_STOP)
        deadline = time.monotonic() + CLOSE_TIMEOUT_S  # one wait for all: a dead store holds each thread alike
        for worker in self._workers:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
        self._workers = [w for w in self._workers if w.is_alive()]

    @property
    def alive_threads(self) -> int:
        return sum(w.is_alive() for w in self._workers)

    # ------------------------------------------------------------ the threads
    def _start(self) -> None:
        if self._workers or self._closed:
            return
        for n in range(self.threads):
            worker = threading.Thread(target=self._work, name=f"atscale-fetch-ahead-{n}", daemon=True)
            worker.start()
            self._workers.append(worker)

    def _work(self) -> None:
        while True:
            chunk = self._queue.get()  # sleeps until woken with work
            if chunk == _STOP:
                return
            with self._lock:
                future = self._loads.get(chunk)
                if future is None or not future.set_running_or_notify_cancel():
                    continue  # released before its turn
            try:
                future.set_result(self.load(chunk))
            except BaseException as err:  # handed to the reader, who reads the chunk itself
                future.set_exception(err)
