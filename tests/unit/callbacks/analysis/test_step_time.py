"""callbacks.analysis.step_time: a step's serial share, Amdahl's ``s`` and its predictions, interval unions.

Every expected value is worked by hand in the test (binary-exact inputs, so ``==`` holds).
"""

from __future__ import annotations

import math

import pytest

from callbacks.analysis.step_time import (
    PARTS,
    PREDICT_N,
    SERIAL_PARTS,
    amdahl_predictions,
    amdahl_serial_fraction,
    overlap,
    serial_fraction,
    union_length,
)


def test_the_parts_and_the_serial_ones() -> None:
    assert PARTS == ("data", "forward", "backward", "comm_exposed", "optimizer")
    assert SERIAL_PARTS == ("data", "comm_exposed", "optimizer") and set(SERIAL_PARTS) <= set(PARTS)
    assert PREDICT_N == (2, 4, 8, 16, 32, 64)


def test_serial_fraction_is_the_serial_parts_over_the_step() -> None:
    parts = {"data": 0.5, "forward": 1.0, "backward": 2.0, "comm_exposed": 0.25, "optimizer": 0.25}
    assert serial_fraction(parts) == 1.0 / 4.0  # (0.5 + 0.25 + 0.25) / 4
    # a checkpoint stall of 4 s per step adds to both: (1 + 4) / (4 + 4)
    assert serial_fraction(parts, checkpoint_per_step=4.0) == 5.0 / 8.0


def test_missing_parts_count_zero_and_unknown_keys_are_ignored() -> None:
    assert serial_fraction({"forward": 3.0, "data": 1.0, "unknown": 100.0}) == 0.25
    assert serial_fraction({"forward": 2.0}) == 0.0
    assert serial_fraction({"optimizer": 2.0}) == 1.0


def test_an_empty_step_has_no_serial_share() -> None:
    assert serial_fraction({}) == 0.0
    assert serial_fraction({key: 0.0 for key in PARTS}) == 0.0


@pytest.mark.parametrize(("parts", "stall", "name"), [
    ({"backward": -1.0}, 0.0, "backward=-1.0"),
    ({"data": math.nan}, 0.0, "data=nan"),
    ({"data": 1.0}, -0.5, "checkpoint_per_step=-0.5"),
])
def test_a_negative_or_nan_part_is_refused_by_name(parts: dict, stall: float, name: str) -> None:
    with pytest.raises(ValueError) as refused:
        serial_fraction(parts, stall)
    assert str(refused.value) == f"serial_fraction: `{name}` must be >= 0."


def test_amdahl_s_counts_the_parallel_part_w_times() -> None:
    assert amdahl_serial_fraction(0.5, 1) == 0.5  # one device: the share itself
    assert amdahl_serial_fraction(0.5, 2) == 1 / 3  # 1 serial + 2 x 1 parallel on one device
    assert amdahl_serial_fraction(0.25, 4) == 0.25 / (0.25 + 4 * 0.75)  # 1 / 13
    assert amdahl_serial_fraction(0.0, 8) == 0.0
    assert amdahl_serial_fraction(1.0, 8) == 1.0


@pytest.mark.parametrize(("share", "world", "message"), [
    (1.5, 2, "amdahl_serial_fraction: `share=1.5` must be in [0, 1]."),
    (-0.1, 2, "amdahl_serial_fraction: `share=-0.1` must be in [0, 1]."),
    (0.5, 0, "amdahl_serial_fraction: `world_size=0` must be an integer >= 1."),
    (0.5, 1.5, "amdahl_serial_fraction: `world_size=1.5` must be an integer >= 1."),
])
def test_amdahl_s_refuses_bad_inputs(share: float, world: float, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        amdahl_serial_fraction(share, world)  # type: ignore[arg-type]
    assert str(refused.value) == message


def test_amdahl_predictions_for_each_device_count() -> None:
    # s = 0.5: 1 / (0.5 + 0.5 / N) = 2N / (N + 1)
    assert amdahl_predictions(0.5, (1, 2, 4)) == {"amdahl/predicted_speedup_1": 1.0,
                                                  "amdahl/predicted_speedup_2": 4 / 3,
                                                  "amdahl/predicted_speedup_4": 8 / 5}
    assert amdahl_predictions(0.0) == {f"amdahl/predicted_speedup_{n}": float(n) for n in PREDICT_N}
    assert amdahl_predictions(1.0, (64,)) == {"amdahl/predicted_speedup_64": 1.0}


@pytest.mark.parametrize(("intervals", "length"), [
    ([], 0.0),
    ([(1.0, 3.0)], 2.0),
    ([(0.0, 1.0), (2.0, 3.5)], 2.5),  # disjoint
    ([(2.0, 5.0), (0.0, 3.0)], 5.0),  # overlapping, unsorted: [0, 5]
    ([(0.0, 4.0), (1.0, 2.0)], 4.0),  # one inside the other
    ([(0.0, 1.0), (1.0, 2.0)], 2.0),  # touching
])
def test_union_length_counts_each_instant_once(intervals: list, length: float) -> None:
    assert union_length(intervals) == length


@pytest.mark.parametrize(("a", "b", "events", "covered"), [
    (0.0, 10.0, [], 0.0),
    (0.0, 10.0, [(1.0, 2.0), (4.0, 6.5)], 3.5),
    (2.0, 5.0, [(0.0, 3.0), (4.5, 9.0)], 1.5),  # clipped at both ends: [2, 3] and [4.5, 5]
    (2.0, 5.0, [(6.0, 7.0), (0.0, 1.0)], 0.0),  # outside
])
def test_overlap_is_the_part_of_the_window_the_events_cover(a: float, b: float, events: list, covered: float) -> None:
    assert overlap(a, b, events) == covered
