"""The fetch-ahead: which chunks it loads, in which order, within which budget, and that it leaves no thread behind."""

from __future__ import annotations

import threading

import pytest

from datamodules.fetch_ahead import FetchAhead
from datamodules.streaming import ChunkOrder

SIZES = [10] * 12  # 12 chunks of 10 items; windows of 3 chunks: 4 windows a pass


def _ahead(loaded: list[int], budget: int = 1 << 40, fail: set[int] | None = None, **kw) -> FetchAhead:
    order = ChunkOrder(SIZES, window=3)
    lock = threading.Lock()

    def load(chunk: int) -> str:
        with lock:
            loaded.append(chunk)
        if fail and chunk in fail:
            raise ConnectionError(f"chunk {chunk}: the store is gone")
        return f"chunk {chunk}"

    return FetchAhead(load, order.windows, lambda index: index // 10, SIZES, [100] * 12, budget_bytes=budget,
                      threads=1, **kw)


def _drain(ahead: FetchAhead, chunks: list[int]) -> None:
    for chunk in chunks:
        assert ahead.take(chunk) == f"chunk {chunk}"


def test_a_pass_loads_the_cursors_window_then_the_next_with_the_cursors_chunk_first() -> None:
    loaded: list[int] = []
    ahead = _ahead(loaded)
    windows = ChunkOrder(SIZES, window=3).windows(7)
    items = ChunkOrder(SIZES, window=3)(7)
    try:
        # a resume mid-window: the chunk holding the cursor's item first, then the rest of its window, then the next
        position = 14
        first = items[position] // 10
        ahead.reached(7, position, items[position])
        _drain(ahead, windows[0] + windows[1])
        assert loaded[0] == first
        assert sorted(loaded) == sorted(windows[0] + windows[1])
        assert loaded[1:] == [c for c in windows[0] + windows[1] if c != first]
        # positions inside the window plan nothing new
        ahead.reached(7, 29, items[29])
        assert len(loaded) == 6
        # the next window: the one after it is loaded, and nothing before the previous window is kept
        ahead.reached(7, 30, items[30])
        _drain(ahead, windows[2])
        assert loaded[6:] == windows[2]
        ahead.reached(7, 60, items[60])
        _drain(ahead, windows[3])
        assert ahead.take(windows[0][0]) is None  # released: behind the cursor
        assert ahead.take(windows[1][0]) == f"chunk {windows[1][0]}"  # the previous window: a batch may straddle
    finally:
        ahead.close()


def test_the_last_window_of_a_pass_loads_the_next_passs_first() -> None:
    loaded: list[int] = []
    ahead = _ahead(loaded)
    order = ChunkOrder(SIZES, window=3)
    items = order(3)
    try:
        ahead.reached(3, 90, items[90])  # the last window of pass seed 3
        _drain(ahead, order.windows(3)[3] + order.windows(4)[0])
        assert loaded == [items[90] // 10] + [c for c in order.windows(3)[3] + order.windows(4)[0]
                                              if c != items[90] // 10]
    finally:
        ahead.close()


@pytest.mark.parametrize(("budget", "chunks_loaded"), [(100, 3), (300, 3), (599, 5), (600, 6), (10**9, 6)])
def test_the_budget_bounds_what_is_loaded_ahead_never_the_cursors_window(budget: int, chunks_loaded: int) -> None:
    loaded: list[int] = []
    ahead = _ahead(loaded, budget=budget)  # chunks of 100 bytes, windows of 3: 300 bytes a window
    order = ChunkOrder(SIZES, window=3)
    try:
        ahead.reached(0, 0, order(0)[0])
        expected = [c for w in order.windows(0)[:2] for c in w][:chunks_loaded]
        _drain(ahead, expected)
        assert sorted(loaded) == sorted(expected)
    finally:
        ahead.close()


def test_a_failed_load_is_left_to_the_reader_and_the_chunks_about_to_be_read_are_kept() -> None:
    loaded: list[int] = []
    kept: list[set[str]] = []
    order = ChunkOrder(SIZES, window=3)
    items = order(0)
    failing = order.windows(0)[0][1]
    ahead = _ahead(loaded, fail={failing}, keep=kept.append, name_of=lambda c: f"chunk-{c}.bin")
    try:
        ahead.reached(0, 0, items[0])
        assert ahead.take(failing) is None  # the reader reads it itself, and meets the error with its own retries
        assert ahead.take(failing) is None  # forgotten, not retried
        assert kept[-1] == {f"chunk-{c}.bin" for w in order.windows(0)[:2] for c in w}
        ahead.reached(0, 30, items[30])  # the previous window may be deleted from the copy (it is decoded)
        assert kept[-1] == {f"chunk-{c}.bin" for w in order.windows(0)[1:3] for c in w}
    finally:
        ahead.close()


def test_close_ends_every_thread_and_drops_what_is_queued() -> None:
    gate = threading.Event()
    order = ChunkOrder(SIZES, window=3)

    def load(chunk: int) -> int:
        gate.wait(5)
        return chunk

    ahead = FetchAhead(load, order.windows, lambda index: index // 10, SIZES, [100] * 12, threads=3)
    ahead.reached(0, 0, order(0)[0])
    assert ahead.alive_threads == 3
    gate.set()
    ahead.close()
    assert ahead.alive_threads == 0 and not [t for t in ahead._workers if t.is_alive()]
    assert ahead.take(order.windows(0)[1][0]) is None
    ahead.reached(0, 30, order(0)[30])  # closed: plans nothing, starts nothing
    assert ahead.alive_threads == 0


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match=r"ahead=0"):
        FetchAhead(lambda c: c, lambda s: [[0]], lambda i: 0, [1], [1], ahead=0)
