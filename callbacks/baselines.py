"""Baselines beside every result: the majority class and a logistic regression on the same split.

A model's accuracy means little alone: 0.97 is poor if a linear model gets 0.98. Before training,
this callback fits scikit-learn's ``DummyClassifier`` and ``LogisticRegression`` on the
datamodule's flat arrays (``baseline_arrays()``: the same train/val split the model sees) and logs
their validation accuracy. A datamodule without ``baseline_arrays`` is skipped with a note.

=========================  ==============================================
key                        meaning
=========================  ==============================================
``baseline/majority_acc``  val accuracy of always predicting the most common class
``baseline/linear_acc``    val accuracy of a logistic regression on the raw pixels
=========================  ==============================================

Copy with it: nothing; this file works alone.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.callbacks import Callback
from sklearn.dummy import DummyClassifier
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from typing_extensions import override

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

log = logging.getLogger(__name__)


def fit_baselines(x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray, y_val: np.ndarray,
                  max_iter: int = 1000) -> dict[str, float]:
    """Validation accuracy of the majority-class and the logistic-regression baselines."""
    majority = DummyClassifier(strategy="most_frequent").fit(x_train, y_train)
    linear = make_pipeline(StandardScaler(), LogisticRegression(max_iter=max_iter))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        linear.fit(x_train, y_train)
    return {
        "baseline/majority_acc": float(majority.score(x_val, y_val)),
        "baseline/linear_acc": float(linear.score(x_val, y_val)),
    }


class Baselines(Callback):
    """Fit and log the baselines once per run (rank 0), and keep them for the end summary.

    Args:
        metric: the model's metric the baselines compare with (for the summary's lift column).

    Example::

        trainer = Trainer(callbacks=[Baselines()])
        trainer.fit(model, datamodule=DigitsDataModule())
    """

    def __init__(self, metric: str = "val/acc") -> None:
        self.metric = metric
        self.results: dict[str, float] = {}

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        datamodule = trainer.datamodule
        if not trainer.is_global_zero or self.results:
            return
        if datamodule is None or not hasattr(datamodule, "baseline_arrays"):
            log.info("Baselines: the datamodule has no baseline_arrays(); skipped.")
            return
        self.results = fit_baselines(*datamodule.baseline_arrays())
        for logger in trainer.loggers:
            logger.log_metrics(self.results, step=0)

    def summary_rows(self, metrics: dict[str, float]) -> list[tuple[str, str]]:
        """Rows for the end summary: each baseline and the model's lift over it."""
        rows = []
        model = metrics.get(self.metric)
        for key, value in self.results.items():
            lift = f"  (model {model - value:+.4f})" if model is not None else ""
            rows.append((key, f"{value:.4f}{lift}"))
        return rows
