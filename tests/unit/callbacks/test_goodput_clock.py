"""callbacks.utils.goodput_clock: the seconds of a launch filed under what the loop was doing, by hand."""

from __future__ import annotations

import pytest

from callbacks.utils.goodput_clock import GoodputClock


def test_a_stop_after_a_rerun_is_tail_and_reruns_are_tallied() -> None:
    """A launch stopped (notice save, wrap-up) right after a rerun step once filed its wrap-up as a rerun: the
    wait between two steps belongs to the *next* step, or to the tail. Reruns are productive, and tallied."""
    clock = GoodputClock(start=0.0)
    clock.redo_until = 2
    clock.step_start(1.0, next_step=1)    # 1 s start-up
    clock.step_end(1.5, True, 1.0)        # first step (rerun) 0.5 s: kept apart
    clock.step_start(1.6, next_step=2)    # 0.1 s wait before a rerun: rerun
    clock.step_end(2.0, True, 1.0)        # rerun 0.4 s
    clock.enter("checkpoint", 2.2)        # 0.2 s after it (the notice)...
    clock.enter("between", 3.2)           # ... a 1 s save
    clock.train_end(3.5)                  # 0.2 + 0.3 s of wrap-up
    assert clock.first_steps == [("productive", 0.5, 0.5)]
    assert clock.attempt == pytest.approx({"startup": 1.0, "data_wait": 0.1, "productive": 0.4, "checkpoint": 1.0,
                                           "tail": 0.5})
    assert (clock.rerun_s, clock.rerun_steps) == (pytest.approx(1.0), 2)  # 0.5 + 0.1 + 0.4 s
    assert clock.raw(3.5, 1.0, 0.0).total_s() + 0.5 == 3.5  # with the first step: every second of the clock


def test_live_reading_files_the_pending_seconds_under_the_context() -> None:
    clock = GoodputClock(start=10.0)
    assert clock.raw(12.0, 2.0, 5.0).seconds == {"restart": 5.0, "startup": 2.0}
    clock.step_start(12.0, next_step=1)
    assert clock.raw(12.5, 2.0, 0.0).seconds == {"startup": 2.0, "data_wait": 0.0, "productive": 0.5}
    assert clock.raw(12.5, 2.0, 0.0).instance_s == {"startup": 4.0, "data_wait": 0.0, "productive": 1.0}
