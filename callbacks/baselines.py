"""Baselines beside every result: the majority class and a logistic regression on the same split.

A model's accuracy means little alone: 0.97 is poor if a linear model gets 0.98. Before training
(after it, with ``defer``), this callback fits scikit-learn's ``DummyClassifier`` and ``LogisticRegression`` on the
datamodule's flat arrays (``baseline_arrays()``: the same train/val split the model sees) and logs
their validation accuracy, and, when the module has a ``cost_matrix`` (a classifier's misclassification
costs, see :mod:`.analysis.decision_cost`), what their decisions cost. A datamodule without
``baseline_arrays`` is skipped with a note. The figures are kept in the checkpoint: a resumed fit logs them
from there, and neither fits them again nor imports scikit-learn's models (a relaunch's start-up).

=========================================  ==================================================================
key                                        meaning
=========================================  ==================================================================
``baseline/majority_acc``                  val accuracy of always predicting the most common class
``baseline/linear_acc``                    val accuracy of a logistic regression on the raw pixels
``baseline/majority_expected_cost``        mean cost of always predicting the most common class
``baseline/linear_expected_cost``          mean cost of the logistic regression's argmax decisions
``baseline/linear_bayes_expected_cost``    mean cost of its Bayes decisions (least expected cost)
=========================================  ==================================================================

Copy with it: ``analysis/decision_cost.py`` (the cost math; numpy only) and ``analysis/keys.py`` (the keys' names).
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from .analysis.decision_cost import bayes_decisions, check_cost_matrix, expected_cost
from .analysis.keys import (
    DEFAULT_METRIC,
    LINEAR_BASELINE_KEY,
    LINEAR_BAYES_COST_BASELINE_KEY,
    LINEAR_COST_BASELINE_KEY,
    MAJORITY_BASELINE_KEY,
    MAJORITY_COST_BASELINE_KEY,
    VAL_BAYES_COST_KEY,
    VAL_COST_KEY,
)

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

log = logging.getLogger(__name__)


#: The model's metric each baseline is judged against, by the baseline key's ending (accuracy: ``metric``).
MODEL_KEYS = {"bayes_expected_cost": VAL_BAYES_COST_KEY, "expected_cost": VAL_COST_KEY}


def fit_baselines(x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray, y_val: np.ndarray,
                  max_iter: int = 1000, cost_matrix: np.ndarray | None = None) -> dict[str, float]:
    """Validation accuracy of the majority-class and the logistic-regression baselines.

    With a ``cost_matrix`` (rows = truth, columns = decision; labels are its indices) also the mean cost
    of their decisions, and of the logistic regression's Bayes decisions under its probabilities.
    """
    # here, not at the top: a resumed run restores its figures and never needs the models (a relaunch's start-up)
    from sklearn.dummy import DummyClassifier
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    majority = DummyClassifier(strategy="most_frequent").fit(x_train, y_train)
    linear = make_pipeline(StandardScaler(), LogisticRegression(max_iter=max_iter))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        linear.fit(x_train, y_train)
    results = {
        MAJORITY_BASELINE_KEY: float(majority.score(x_val, y_val)),
        LINEAR_BASELINE_KEY: float(linear.score(x_val, y_val)),
    }
    if cost_matrix is not None:
        costs = check_cost_matrix(cost_matrix)
        labels = np.asarray(y_val).astype(int)
        probs = np.zeros((len(x_val), len(costs)))  # the columns of the classes seen in training, 0 elsewhere
        probs[:, np.asarray(linear.classes_).astype(int)] = linear.predict_proba(x_val)
        results |= {
            MAJORITY_COST_BASELINE_KEY: expected_cost(costs, labels, majority.predict(x_val).astype(int)),
            LINEAR_COST_BASELINE_KEY: expected_cost(costs, labels, linear.predict(x_val).astype(int)),
            LINEAR_BAYES_COST_BASELINE_KEY: expected_cost(costs, labels, bayes_decisions(costs, probs)),
        }
    return results


class Baselines(Callback):
    """Fit and log the baselines once per run (rank 0), and keep them for the end summary and the checkpoint.

    A fit resumed from a checkpoint with the figures (restored before ``on_fit_start``) logs those instead of
    fitting again (a continued MLflow run leaves out the points it holds). A strategy that restores checkpoints
    after setup (FSDP) fits them again.

    With ``defer``, the fit waits until training is over (:meth:`after_fit`, called once ``trainer.fit`` has
    returned): the digits recipe's logistic regression took 0.47 s of a 7 s ``trainer.fit``, on the cores the
    steps compute on. A launch stopped by an interruption notice leaves them to the relaunch, which fits them
    at its end.

    Args:
        metric: the model's metric the baselines compare with (for the summary's lift column).
        defer: fit them after ``trainer.fit`` rather than at its start.

    Example::

        trainer = Trainer(callbacks=[Baselines()])
        trainer.fit(model, datamodule=DigitsDataModule())
    """

    def __init__(self, metric: str = DEFAULT_METRIC, defer: bool = False) -> None:
        self.metric = metric
        self.defer = defer
        self.results: dict[str, float] = {}
        self._logged = False  # by this fit or an earlier one of this instance (a fit twice logs once)
        self._deferred: tuple[Trainer, pl.LightningModule] | None = None

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        datamodule = trainer.datamodule
        if not trainer.is_global_zero or self._logged:
            return
        if self.results:  # restored from the checkpoint: logged as the first launch did, not fitted again
            self._log(trainer)
            return
        if datamodule is None or not hasattr(datamodule, "baseline_arrays"):
            log.info("Baselines: the datamodule has no baseline_arrays(); skipped.")
            return
        if not self.defer:
            self._fit(trainer, pl_module)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        if not self.defer or not trainer.is_global_zero or self._logged or self.results:
            return
        if any(getattr(cb, "interrupted", False) for cb in trainer.callbacks):
            return  # a notice's stop exits at once: the relaunch fits them
        if hasattr(trainer.datamodule, "baseline_arrays"):
            self._deferred = (trainer, pl_module)

    def after_fit(self, trainer: Trainer) -> None:
        """After ``trainer.fit`` (``callbacks.utils.run_report.AfterFit``): the fit ``defer`` held back."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            self._fit(*deferred)

    def _fit(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        costs = getattr(pl_module, "cost_matrix", None)
        costs = None if costs is None else costs.detach().cpu().double().numpy()
        datamodule: Any = trainer.datamodule
        self.results = fit_baselines(*datamodule.baseline_arrays(), cost_matrix=costs)
        self._log(trainer)

    def _log(self, trainer: Trainer) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(self.results, step=0)
        self._logged = True

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"results": dict(self.results)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.results = {str(k): float(v) for k, v in state_dict.get("results", {}).items()}

    def model_key(self, key: str) -> str:
        """The model's metric a baseline is compared with: its expected cost for a cost, else ``metric``."""
        return next((model for end, model in MODEL_KEYS.items() if key.endswith(end)), self.metric)

    def summary_rows(self, metrics: dict[str, float]) -> list[tuple[str, str]]:
        """Rows for the end summary: each baseline and the model's difference from it (a cost: lower is better)."""
        rows = []
        for key, value in self.results.items():
            model = metrics.get(self.model_key(key))
            lift = f"  (model {model - value:+.4f})" if model is not None else ""
            rows.append((key, f"{value:.4f}{lift}"))
        return rows
