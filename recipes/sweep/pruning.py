"""``SweepTrial``: the callback a sweep adds to each trial's ``recipes.fit``: report, and stop when pruned.

At the end of every validation (sanity checks excepted) rank zero reports the metric to the trial in the
study's storage (step = the epoch), asks the study's pruner, and the ranks agree on its answer with one
broadcast. Pruned, the trial stops like a finished run (``trainer.should_stop``: its checkpoint, cost and
model are written as usual), its MLflow run is tagged ``pruned`` and the trial records the epoch in its
user attr ``pruned_at_epoch``; the sweep process then marks the trial PRUNED. The storage URL comes from
``ATSCALE_SWEEP_STORAGE`` (it may hold a password: never on a command line or in the logged config).

MLflow tags set on the run: ``pruned`` = ``true`` and ``pruned_at_epoch`` when pruned.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import MLFlowLogger
from typing_extensions import override

from callbacks.analysis.keys import PRUNED_AT_TAG, PRUNED_TAG

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

log = logging.getLogger(__name__)

#: Where the trial's study lives (the sweep sets it for each trial process).
ENV_SWEEP_STORAGE = "ATSCALE_SWEEP_STORAGE"


class SweepTrial(Callback):
    """Report ``metric`` to trial ``trial`` of study ``study`` after each validation; stop when pruned.

    Args:
        study: The study's name (the sweep's ``--name``).
        trial: The trial's number.
        metric: The validation metric the study optimizes.
        pruner: ``median``, ``halving`` or ``none`` (see :func:`recipes.sweep.study.make_pruner`).
        startup_trials: Finished trials before the median pruner prunes anything.
        warmup_epochs: Epochs of a trial before it can be pruned.

    Raises:
        ValueError: an unknown pruner.

    Example::

        trainer = Trainer(callbacks=[SweepTrial(study="my-sweep", trial=3, metric="val/acc")])
    """

    def __init__(self, study: str, trial: int, metric: str, pruner: str = "median", startup_trials: int = 2,
                 warmup_epochs: int = 0) -> None:
        from .study import PRUNERS

        if pruner not in PRUNERS:
            raise ValueError(f"SweepTrial(pruner={pruner!r}) must be one of {', '.join(PRUNERS)}.")
        self.study, self.trial, self.metric = study, trial, metric
        self.pruner, self.startup_trials, self.warmup_epochs = pruner, startup_trials, warmup_epochs
        self._study: Any = None
        self._storage: Any = None
        self._tid = -1
        self.pruned_at: int | None = None

    def _open(self, trainer: Trainer) -> None:
        import optuna

        from .study import RUN_ID_ATTR, make_pruner, open_storage, trial_id

        url = os.environ.get(ENV_SWEEP_STORAGE)
        if not url:
            raise RuntimeError(f"SweepTrial: {ENV_SWEEP_STORAGE} is not set (recipes.sweep sets it)")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage = open_storage(url)
        study = optuna.load_study(study_name=self.study, storage=storage,
                                  sampler=optuna.samplers.RandomSampler(),
                                  pruner=make_pruner(self.pruner, self.startup_trials, self.warmup_epochs))
        # The sweep process claimed the trial (Study.ask); this process only reports to it, through the storage
        # and the pruner: optuna.Trial(study, trial_id) is a constructor Optuna keeps to itself.
        self._study, self._storage, self._tid = study, storage, trial_id(storage, study, self.trial)
        logger = self._mlflow(trainer)
        if logger is not None and logger.run_id:
            storage.set_trial_user_attr(self._tid, RUN_ID_ATTR, logger.run_id)

    @staticmethod
    def _mlflow(trainer: Trainer) -> MLFlowLogger | None:
        return next((lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)), None)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self._open(trainer)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        prune = False
        if trainer.is_global_zero and self._study is not None:
            prune = self._report(trainer)
        prune = bool(trainer.strategy.broadcast(prune))
        if prune:
            trainer.should_stop = True

    def _report(self, trainer: Trainer) -> bool:
        from .study import PRUNED_ATTR

        value = trainer.callback_metrics.get(self.metric)
        if value is None:
            log.warning("SweepTrial: the validation logged no %s; nothing reported to trial %d.",
                        self.metric, self.trial)
            return False
        epoch = int(trainer.current_epoch)
        if epoch not in self._storage.get_trial(self._tid).intermediate_values:
            # what Trial.report stores; a resumed epoch already reported keeps its first value
            self._storage.set_trial_intermediate_value(self._tid, epoch, float(value))
        if not self._study.pruner.prune(self._study, self._storage.get_trial(self._tid)):  # Trial.should_prune's
            return False
        self.pruned_at = epoch
        self._storage.set_trial_user_attr(self._tid, PRUNED_ATTR, epoch)
        logger = self._mlflow(trainer)
        if logger is not None and logger.run_id:
            logger.experiment.set_tag(logger.run_id, PRUNED_TAG, "true")
            logger.experiment.set_tag(logger.run_id, PRUNED_AT_TAG, str(epoch))
        log.warning("Trial %d pruned after epoch %d (%s %.4f).", self.trial, epoch, self.metric, float(value))
        return True
