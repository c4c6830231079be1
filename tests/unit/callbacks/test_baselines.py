"""Baselines: the majority class and the logistic regression on a tiny data set whose answers are known by hand."""

from __future__ import annotations

import io
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from callbacks.baselines import Baselines, fit_baselines
from tests.conftest import RecordingLogger

# One feature, three classes in clusters far apart: class 0 (the most common in training) near -10, class 1
# near 0, class 2 near +10. Any sensible linear model separates them; the majority class is 0.
X_TRAIN = np.array([[-10.0], [-10.5], [-9.5], [-11.0], [0.0], [0.5], [10.0], [10.5]])
Y_TRAIN = np.array([0, 0, 0, 0, 1, 1, 2, 2])
# Validation: one point of each cluster plus a class-2 point that sits in class 0's cluster (no model gets it).
X_VAL = np.array([[-10.0], [0.2], [10.2], [-10.2]])
Y_VAL = np.array([0, 1, 2, 2])
# Rows: truth; columns: decision. Taking a 2 for a 0 costs 10, a 1 for a 0 costs 5, any other mistake 1.
COSTS = np.array([[0.0, 1.0, 1.0], [5.0, 0.0, 1.0], [10.0, 1.0, 0.0]])
ZERO_ONE = np.ones((3, 3)) - np.eye(3)


def test_majority_and_linear_accuracy_by_hand() -> None:
    results = fit_baselines(X_TRAIN, Y_TRAIN, X_VAL, Y_VAL)
    # majority: always 0, right on 1 of 4; linear: the three cluster points right, the stray class 2 taken for 0
    assert results == {"baseline/majority_acc": 0.25, "baseline/linear_acc": 0.75}


def test_expected_costs_by_hand() -> None:
    results = fit_baselines(X_TRAIN, Y_TRAIN, X_VAL, Y_VAL, cost_matrix=COSTS)
    assert results["baseline/majority_acc"] == 0.25 and results["baseline/linear_acc"] == 0.75
    # majority decides 0 four times: costs 0 + 5 + 10 + 10 = 25, mean 6.25
    assert results["baseline/majority_expected_cost"] == 6.25
    # the logistic regression's argmax: right three times, the stray 2 decided 0 (cost 10): mean 2.5
    assert results["baseline/linear_expected_cost"] == 2.5


def test_bayes_decisions_under_zero_one_costs_are_the_argmax() -> None:
    """With every mistake costing 1, deciding d costs 1 - p_d in expectation: the Bayes decision is the argmax,
    and every mean cost is 1 - accuracy."""
    results = fit_baselines(X_TRAIN, Y_TRAIN, X_VAL, Y_VAL, cost_matrix=ZERO_ONE)
    assert results == {"baseline/majority_acc": 0.25, "baseline/linear_acc": 0.75,
                       "baseline/majority_expected_cost": 0.75, "baseline/linear_expected_cost": 0.25,
                       "baseline/linear_bayes_expected_cost": 0.25}


def test_a_class_never_seen_in_training_gets_probability_zero() -> None:
    """A 4th class in the cost matrix but not in training: its column of probabilities is 0, never decided."""
    costs = np.ones((4, 4)) - np.eye(4)
    x_val, y_val = np.array([[-10.0], [0.2], [10.2], [0.1]]), np.array([0, 1, 2, 3])
    results = fit_baselines(X_TRAIN, Y_TRAIN, x_val, y_val, cost_matrix=costs)
    assert results == {"baseline/majority_acc": 0.25, "baseline/linear_acc": 0.75,
                       "baseline/majority_expected_cost": 0.75, "baseline/linear_expected_cost": 0.25,
                       "baseline/linear_bayes_expected_cost": 0.25}


class _Arrays:
    def baseline_arrays(self) -> tuple[np.ndarray, ...]:
        return X_TRAIN, Y_TRAIN, X_VAL, Y_VAL


def test_the_callback_logs_at_step_0_once_and_summarises_against_the_model() -> None:
    logger = RecordingLogger()
    trainer = SimpleNamespace(is_global_zero=True, datamodule=_Arrays(), loggers=[logger])
    callback = Baselines()
    callback.on_fit_start(trainer, SimpleNamespace(cost_matrix=torch.tensor(ZERO_ONE)))  # type: ignore[arg-type]
    expected = {"baseline/majority_acc": 0.25, "baseline/linear_acc": 0.75, "baseline/majority_expected_cost": 0.75,
                "baseline/linear_expected_cost": 0.25, "baseline/linear_bayes_expected_cost": 0.25}
    assert logger.calls == [(0, expected)]
    callback.on_fit_start(trainer, SimpleNamespace(cost_matrix=None))  # type: ignore[arg-type]
    assert len(logger.calls) == 1  # fitted once per run (a resumed fit does not refit)
    rows = callback.summary_rows({"val/acc": 0.9, "val/expected_cost": 1.0, "val/bayes_expected_cost": 0.5})
    assert rows == [
        ("baseline/majority_acc", "0.2500  (model +0.6500)"),
        ("baseline/linear_acc", "0.7500  (model +0.1500)"),
        ("baseline/majority_expected_cost", "0.7500  (model +0.2500)"),  # a cost: lower is better
        ("baseline/linear_expected_cost", "0.2500  (model +0.7500)"),
        ("baseline/linear_bayes_expected_cost", "0.2500  (model +0.2500)"),  # against the model's Bayes cost
    ]
    assert Baselines().summary_rows({}) == []


def test_no_baseline_arrays_or_another_rank_fits_nothing(caplog: pytest.LogCaptureFixture) -> None:
    logger = RecordingLogger()
    callback = Baselines()
    with caplog.at_level(logging.INFO, logger="callbacks.baselines"):
        callback.on_fit_start(SimpleNamespace(is_global_zero=True, datamodule=object(), loggers=[logger]),
                              SimpleNamespace())  # type: ignore[arg-type]
    assert caplog.messages == ["Baselines: the datamodule has no baseline_arrays(); skipped."]
    callback.on_fit_start(SimpleNamespace(is_global_zero=False, datamodule=_Arrays(), loggers=[logger]),
                          SimpleNamespace())  # type: ignore[arg-type]
    assert callback.results == {} and logger.calls == []
    partial = Baselines(metric="val/f1")
    partial.results = {"baseline/linear_acc": 0.75}
    assert partial.summary_rows({}) == [("baseline/linear_acc", "0.7500")]  # the model's metric not logged


def test_a_resumed_fit_restores_the_figures_instead_of_fitting_again() -> None:
    logger = RecordingLogger()
    trainer = SimpleNamespace(is_global_zero=True, datamodule=_Arrays(), loggers=[logger])
    first = Baselines()
    first.on_fit_start(trainer, SimpleNamespace(cost_matrix=None))  # type: ignore[arg-type]
    state = torch.load(_saved(first.state_dict()), weights_only=True)  # a checkpoint, loaded as a resume does
    assert state == {"results": {"baseline/majority_acc": 0.25, "baseline/linear_acc": 0.75}}
    resumed = Baselines()
    resumed.load_state_dict(state)
    resumed.on_fit_start(trainer, SimpleNamespace(cost_matrix=None))  # type: ignore[arg-type]
    assert logger.calls == [(0, first.results)] * 2  # logged from the checkpoint (a continued run drops repeats)
    assert resumed.summary_rows({"val/acc": 0.9}) == first.summary_rows({"val/acc": 0.9})
    old = Baselines()
    old.load_state_dict({})  # a checkpoint written before the figures were kept: fitted again at fit start
    old.on_fit_start(trainer, SimpleNamespace(cost_matrix=None))  # type: ignore[arg-type]
    assert len(logger.calls) == 3 and old.results == first.results


def test_deferred_baselines_are_fitted_after_the_fit_and_never_after_a_notices_stop() -> None:
    """``defer`` (the CLI's): the logistic regression took 0.47 s of the digits recipe's 7 s trainer.fit."""
    logger = RecordingLogger()
    trainer = SimpleNamespace(is_global_zero=True, datamodule=_Arrays(), loggers=[logger], callbacks=[])
    module = SimpleNamespace(cost_matrix=None)
    callback = Baselines(defer=True)
    trainer.callbacks.append(callback)
    callback.on_fit_start(trainer, module)  # type: ignore[arg-type]
    assert callback.results == {} and logger.calls == []  # nothing at the start of training
    callback.on_fit_end(trainer, module)  # type: ignore[arg-type]
    assert logger.calls == []
    callback.after_fit(trainer)  # type: ignore[arg-type]
    assert logger.calls == [(0, {"baseline/majority_acc": 0.25, "baseline/linear_acc": 0.75})]
    callback.after_fit(trainer)  # type: ignore[arg-type]
    assert len(logger.calls) == 1  # once

    stopped = Baselines(defer=True)
    notice = SimpleNamespace(interrupted=True)  # SpotCheckpoint after a notice: the run exits at once
    trainer = SimpleNamespace(is_global_zero=True, datamodule=_Arrays(), loggers=[logger], callbacks=[notice])
    stopped.on_fit_start(trainer, module)  # type: ignore[arg-type]
    stopped.on_fit_end(trainer, module)  # type: ignore[arg-type]
    stopped.after_fit(trainer)  # type: ignore[arg-type]
    assert stopped.results == {} and len(logger.calls) == 1  # the relaunch fits them, at its end


def _saved(state: dict) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer
