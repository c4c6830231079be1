"""recipes.bench.threads: each thread's CPU time, attributed to the role its name gives it."""

from __future__ import annotations

import threading
import time

import pytest

from recipes.bench import threads as bench_threads

TICK_S = 0.02  # the kernel counts a thread's CPU in clock ticks (10 ms here); two readings, two ticks


class _RefreshThread(threading.Thread):  # as Lightning's progress bar names its refresh thread's class
    pass


@pytest.mark.parametrize(("name", "cls", "role"), [
    ("MLflowBatchLoggingWorkerPool_0", threading.Thread, "MLflow metric writer"),
    ("ThreadPoolExecutor-3_0", threading.Thread, "checkpoint writer (thread pool)"),
    ("SystemMetricsMonitor", threading.Thread, "MLflow system metrics"),
    (None, _RefreshThread, "progress bar refresh"),  # unnamed: Thread-N, its class says what it is
    ("my-loader-7", threading.Thread, "my-loader"),  # an unknown role keeps its name, less the counter
])
def test_a_thread_is_named_by_its_role(name: str | None, cls: type[threading.Thread], role: str) -> None:
    assert bench_threads.thread_role(cls(name=name)) == role


def _spin(cpu_s: float, used: list[float], started: threading.Event, stop: threading.Event) -> None:
    started.wait()
    begin = time.thread_time()
    while time.thread_time() - begin < cpu_s:
        pass
    used.append(time.thread_time() - begin)
    stop.wait()  # alive until read: a thread that has ended is no longer listed


def test_the_window_counts_a_busy_threads_own_cpu_time_under_its_role() -> None:
    used: list[float] = []
    started, stop = threading.Event(), threading.Event()
    busy = threading.Thread(target=_spin, args=(0.3, used, started, stop), name="SystemMetricsMonitor")
    busy.start()
    window = bench_threads.ThreadCpuWindow(first=1, last=3)
    try:
        window.on_train_batch_end(None, None, None, None, 0)  # type: ignore[arg-type]  # batch 1: the start
        started.set()
        while not used:
            time.sleep(0.01)
        window.on_train_batch_end(None, None, None, None, 1)  # type: ignore[arg-type]
        assert window.shares == {}  # batch 2: inside the window
        window.on_train_batch_end(None, None, None, None, 2)  # type: ignore[arg-type]  # batch 3: the end
    finally:
        stop.set()
        busy.join()
    # the kernel's figure for the busy thread is the CPU the thread measured itself, to the clock tick
    assert window.shares["MLflow system metrics"] * window.wall_s == pytest.approx(used[0], abs=TICK_S)
    assert window.shares["training thread"] * window.wall_s < used[0] / 2  # this thread mostly slept


def test_a_window_must_hold_at_least_one_batch() -> None:
    with pytest.raises(ValueError, match=r"first=3, last=3"):
        bench_threads.ThreadCpuWindow(first=3, last=3)
