"""The ``slow`` tier: each variant ``.ci/run`` leaves out names a test it runs that holds the same behaviour.

The check itself (``tests.conftest.slow_tier_problems``) runs at every collection; these cases show it refuses
what would let a behaviour leave CI unnoticed.
"""

from __future__ import annotations

from tests.conftest import slow_tier_problems

A = "tests/e2e/test_a.py"


def test_a_slow_variant_covered_by_a_test_ci_runs_passes() -> None:
    assert slow_tier_problems([(f"{A}::test_x[3]", f"{A}::test_x[4]", True), (f"{A}::test_x[4]", None, False)]) == []
    # a function's node id covers through any of its parametrizations that is not slow
    assert slow_tier_problems([(f"{A}::test_y", f"{A}::test_x", True), (f"{A}::test_x[4]", None, False)]) == []


def test_a_slow_test_without_covered_by_is_named() -> None:
    assert slow_tier_problems([(f"{A}::test_y", None, True)]) == [f"{A}::test_y: marked slow without covered_by="]


def test_a_cover_that_is_not_a_test_is_named() -> None:
    problems = slow_tier_problems([(f"{A}::test_y", f"{A}::test_gone", True), (f"{A}::test_x", None, False)])
    assert problems == [f"{A}::test_y: covered_by {A}::test_gone, which is not a test"]


def test_a_cover_that_is_slow_too_is_named() -> None:
    problems = slow_tier_problems([(f"{A}::test_y", f"{A}::test_x", True), (f"{A}::test_x[1]", f"{A}::test_y", True)])
    assert f"{A}::test_y: covered_by {A}::test_x, which is slow too" in problems


def test_a_cover_in_a_file_not_collected_is_left_to_the_run_that_collects_it() -> None:
    assert slow_tier_problems([(f"{A}::test_y", "tests/e2e/test_b.py::test_z", True)]) == []
