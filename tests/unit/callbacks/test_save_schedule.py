"""callbacks.utils.save_schedule: when periodic saves are due, on a clock the test moves."""

from __future__ import annotations

import logging
import math

import pytest

from callbacks.utils.save_schedule import SaveSchedule


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_every_n_steps_counts_optimizer_steps_from_one() -> None:
    schedule = SaveSchedule(every_n_steps=5)
    assert [step for step in range(0, 16) if schedule.due_by_steps(step)] == [5, 10, 15]


def test_a_timed_save_is_due_once_the_interval_passed_since_the_last() -> None:
    clock = Clock()
    schedule = SaveSchedule(every_minutes=0.5, clock=clock)
    clock.now = 29.999
    assert not schedule.due_by_clock()
    clock.now = 30.0
    assert schedule.due_by_clock()
    assert schedule.saved(save_cost_s=2.0, instances=1, speak=False) is None  # no rate: nothing to check
    clock.now = 59.0
    assert not schedule.due_by_clock()  # counted from the save's end


def test_auto_takes_dalys_interval_from_the_first_save_only() -> None:
    clock = Clock()
    schedule = SaveSchedule(every_minutes="auto", interruption_rate=1 - math.exp(-1 / 24), clock=clock)
    assert schedule.interval_s is None and not schedule.due_by_clock()
    metrics = schedule.saved(save_cost_s=300.0, instances=1, speak=False)
    assert metrics is not None and metrics["spot/interval_s"] / 60 == pytest.approx(116.7, abs=0.05)
    assert schedule.saved(save_cost_s=10.0, instances=1, speak=False) is None  # chosen once
    assert schedule.interval_s / 60 == pytest.approx(116.7, abs=0.05)


def test_more_instances_shorten_the_mtbf_and_the_interval() -> None:
    rate = 1 - math.exp(-1 / 24)
    one = SaveSchedule(every_minutes="auto", interruption_rate=rate)
    eight = SaveSchedule(every_minutes="auto", interruption_rate=rate)
    one.saved(300.0, instances=1, speak=False)
    eight.saved(300.0, instances=8, speak=False)
    assert eight.interval_s is not None and one.interval_s is not None and eight.interval_s < one.interval_s


@pytest.mark.parametrize(("save_s", "said"), [
    (0.0032, "the first save's 3.2 ms loop stall"),
    (0.0, "the first save's 0 ms loop stall, counted as 1 ms"),
    (2.5, "the first save's 2.50 s loop stall"),
])
def test_auto_names_the_save_cost_it_used(save_s: float, said: str, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 47: "Daly's optimum for a 0.00 s save" rounded the measured save away."""
    schedule = SaveSchedule(every_minutes="auto", interruption_rate=0.05)
    with caplog.at_level(logging.WARNING):
        schedule.saved(save_s, instances=1, speak=True)
    (message,) = [r.getMessage() for r in caplog.records]
    assert said in message and "0.00 s" not in message
