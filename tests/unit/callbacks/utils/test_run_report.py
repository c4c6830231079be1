"""The three after-fit protocols (callbacks/utils/run_report.py): who takes part, and what each asks for."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from callbacks import Baselines, CostTracker, LogModel, SpotCheckpoint, StepTiming
from callbacks.spot import REQUEUE_EXIT_CODE
from callbacks.utils.run_report import AfterFit, ExitCode, SummaryRows


def test_the_project_callbacks_take_part_by_defining_the_methods() -> None:
    timing, model, spot = StepTiming(), LogModel(defer=True), SpotCheckpoint(signals=[])
    assert isinstance(timing, AfterFit) and isinstance(timing, SummaryRows) and not isinstance(timing, ExitCode)
    assert isinstance(model, AfterFit) and not isinstance(model, SummaryRows)
    assert isinstance(spot, ExitCode) and not isinstance(spot, AfterFit)
    assert isinstance(CostTracker(), SummaryRows) and isinstance(Baselines(), SummaryRows)
    assert not isinstance(Callback(), (AfterFit, SummaryRows, ExitCode))  # Lightning's own: none of the three


def test_spot_asks_for_a_relaunch_only_once_stopped_on_a_notice() -> None:
    spot = SpotCheckpoint(signals=[])
    assert spot.exit_code() is None
    spot.interrupted = True
    assert spot.exit_code() == REQUEUE_EXIT_CODE == 75


def test_step_timing_after_fit_writes_nothing_without_a_deferred_plot() -> None:
    timing = StepTiming()
    timing.after_fit(None)  # nothing was deferred: no trainer is touched
    assert timing.plot_path is None
