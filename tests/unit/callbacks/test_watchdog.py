"""callbacks.utils.watchdog: when a wait is a hang, decided on a patched clock and a store of heartbeats."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch.distributed as dist

from callbacks.utils.watchdog import HangWatchdog, PeerBoard, main_thread_wait, silent_ranks


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watchdog(clock: Clock, board: PeerBoard | None = None, **kwargs: float) -> HangWatchdog:
    settings = {"notice_grace_s": 20.0, "stall_floor_s": 60.0, "stall_factor": 10.0, "period_s": 0.01, **kwargs}
    return HangWatchdog(lambda line: None, rank=0, notice_signals={signal.SIGTERM}, board=board, clock=clock,
                        **settings)


def test_the_stall_timeout_follows_the_longest_gap_between_boundaries() -> None:
    clock = Clock()
    dog = watchdog(clock)
    for gap in (0.5, 2.0, 1.0):
        clock.now += gap
        dog.beat()
    assert dog.longest_gap_s == 2.0
    assert dog.stall_timeout_s() == 60.0  # the floor: 10 x 2.0 s is less
    clock.now += 9.0
    dog.beat()
    assert dog.stall_timeout_s() == 90.0  # 10 x the 9 s gap


def test_time_spent_busy_does_not_set_the_timeout() -> None:
    clock = Clock()
    dog = watchdog(clock)
    with dog.busy("writing a checkpoint"):
        clock.now += 500.0
    clock.now += 1.0
    dog.beat()
    assert dog.longest_gap_s == 1.0


def test_a_notice_the_loop_does_not_reach_within_the_grace_is_a_hang() -> None:
    clock = Clock()
    dog = watchdog(clock)
    dog.notice_at = clock.now
    clock.now += 19.9
    assert dog.check() is None
    clock.now += 0.1
    line = dog.check()
    assert line is not None and line.startswith("hang: a notice 20 s ago found rank 0 unable to reach a step boundary")


def test_a_notice_the_loop_reaches_is_not_a_hang() -> None:
    clock = Clock()
    dog = watchdog(clock)
    dog.notice_at = clock.now
    clock.now += 5.0
    dog.beat(7)  # the step boundary: the notice is being acted on
    clock.now += 100.0
    assert dog.check() is None  # one process: no stall check without peers


def board_of(world: int) -> tuple[dist.HashStore, list[PeerBoard]]:
    store = dist.HashStore()
    return store, [PeerBoard(store, rank, world) for rank in range(world)]


def test_a_stall_names_the_rank_whose_heartbeat_stopped() -> None:
    _, boards = board_of(3)
    for board in boards:
        board.publish(step=5, busy=None)
    clock = Clock()
    dog = watchdog(clock, boards[0], stall_floor_s=60.0, period_s=0.2)
    clock.now += 59.0
    assert dog.check() is None
    clock.now += 1.0
    ticking = threading.Timer(0.05, boards[2].publish, kwargs={"step": 5, "busy": None})
    ticking.start()  # rank 2 is alive while the watchdog looks twice; rank 1 is not
    line = dog.check()
    ticking.join()
    assert line is not None and "rank(s) 1 stopped answering (step 0)" in line, line


def test_a_stall_beside_a_busy_live_peer_is_a_legitimate_wait() -> None:
    _, boards = board_of(2)
    clock = Clock()
    dog = watchdog(clock, boards[0], period_s=0.2)
    boards[1].publish(step=5, busy="writing a checkpoint")
    clock.now += 61.0
    beating = threading.Timer(0.05, boards[1].publish, kwargs={"step": 5, "busy": "writing a checkpoint"})
    beating.start()
    assert dog.check() is None
    beating.join()
    assert dog.last_beat == clock.now  # the wait starts over


def test_ranks_that_all_answer_but_wait_are_a_split_decision() -> None:
    _, boards = board_of(2)
    clock = Clock()
    dog = watchdog(clock, boards[0], period_s=0.2)
    boards[1].publish(step=5, busy=None)
    clock.now += 61.0
    beating = threading.Timer(0.05, boards[1].publish, kwargs={"step": 5, "busy": None})
    beating.start()
    line = dog.check()
    beating.join()
    assert line is not None and "every rank answers but waits: they disagree on what comes next" in line


def test_silent_ranks_compares_two_readings() -> None:
    before = {0: {"seq": 3}, 1: {"seq": 7}, 2: None}
    after = {0: {"seq": 4}, 1: {"seq": 7}, 2: None}
    assert silent_ranks(before, after) == [1, 2]


def test_where_the_main_thread_waits_names_the_collective_and_our_caller() -> None:
    seen: list[str] = []
    reader = threading.Thread(target=lambda: (time.sleep(0.2), seen.append(main_thread_wait())))
    reader.start()
    time.sleep(0.5)  # the main thread is here, in this test's frame, not in torch.distributed
    reader.join()
    assert seen[0].startswith("no collective (the step itself), called from test_watchdog.py:")


def test_a_real_signal_to_a_blocked_main_thread_reaches_the_watchdog() -> None:
    """The main thread sits in C (a blocking read) and runs no Python handler; the wakeup descriptor still tells."""
    fired: list[str] = []
    done = threading.Event()

    def on_hang(line: str) -> None:
        fired.append(line)
        done.set()
        os.write(unblock_w, b"x")

    unblock_r, unblock_w = os.pipe()
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    dog = HangWatchdog(on_hang, rank=0, notice_signals={signal.SIGUSR1}, notice_grace_s=0.3, period_s=0.05)
    try:
        dog.start()
        threading.Timer(0.1, os.kill, args=(os.getpid(), signal.SIGUSR1)).start()
        started = time.monotonic()
        os.read(unblock_r, 1)  # blocks in C until the watchdog fires
        assert done.wait(5)
        assert 0.3 <= time.monotonic() - started < 3.0
        assert fired[0].startswith("hang: a notice 0 s ago found rank 0 unable to reach a step boundary")
    finally:
        dog.stop()
        signal.signal(signal.SIGUSR1, previous)
        os.close(unblock_r)
        os.close(unblock_w)


@pytest.mark.parametrize("bad", [{"notice_grace_s": 0.0}, {"stall_floor_s": -1.0}, {"stall_factor": 0.0},
                                 {"stall_factor": float("nan")}])
def test_non_positive_settings_are_refused_by_name(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        HangWatchdog(lambda line: None, rank=0, notice_signals=set(), **bad)


def test_a_store_that_stops_answering_is_read_once_not_once_per_rank() -> None:
    """The store's host hung (global rank 0 under Lightning's launcher): one timeout, then every rank unknown."""
    class Hung:
        calls = 0

        def set(self, key: str, value: str) -> None: ...

        def check(self, keys: list[str]) -> bool:
            Hung.calls += 1
            raise TimeoutError("the store did not answer")

        def get(self, key: str) -> bytes:
            raise AssertionError("not reached")

    assert PeerBoard(Hung(), rank=1, world_size=4).read() == {0: None, 1: None, 2: None, 3: None}
    assert Hung.calls == 1


def test_stop_wakes_the_thread_instead_of_waiting_out_its_period() -> None:
    """The thread sleeps in select() on the signal pipe; stop() used to wait for it to wake on its own: every run's
    end of training waited up to a period (1 s) for the watchdog."""
    dog = HangWatchdog(lambda line: None, rank=0, notice_signals={signal.SIGTERM}, period_s=120.0)
    dog.start()
    thread = dog._thread
    assert thread is not None and thread.is_alive()
    started = time.monotonic()
    dog.stop()  # from the main thread, as SpotCheckpoint does (it gives the wakeup descriptor back)
    assert time.monotonic() - started < 60.0  # half the period: only a woken thread ends before it
    assert not thread.is_alive()
