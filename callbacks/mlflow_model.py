"""Log the trained model to MLflow at the end of a completed fit, from rank 0 only.

A classifier (a module with a ``cost_matrix``, ``class_names`` and ``decision``) is logged as the
servable pyfunc model of :mod:`.utils.served_classifier`: it answers with the decision (argmax or the
cost-aware Bayes decision, per the config), the class probabilities and the class names, and holds the
PyTorch network as its ``network`` artifact. Any other module is logged with ``mlflow.pytorch.log_model``.
Either way the model gets an input example and a signature (the network's pt2 format needs the example).
Under FSDP the parameters are sharded: the full state dict is gathered (a collective on every rank) into
an unsharded copy of the module on rank 0 first. A fit that stopped on an interruption notice is not
finished, so nothing is logged then. A process killed while it logs leaves the run RUNNING with a PENDING
model; the relaunch finishes the run, marks that model FAILED and logs the model again.

Copy with it: ``utils/served_classifier.py`` and ``analysis/decision_cost.py`` (for classifiers).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import MLFlowLogger
from typing_extensions import override

if TYPE_CHECKING:
    import mlflow
    from lightning.pytorch import Trainer

log = logging.getLogger(__name__)

#: The pyfunc model a classifier is served as (logged as code), and the pure decision math it imports.
SERVED_CLASSIFIER = Path(__file__).resolve().parent / "utils" / "served_classifier.py"
DECISION_MATH = Path(__file__).resolve().parent / "analysis" / "decision_cost.py"
ENABLE_PROGRESS_BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


@contextlib.contextmanager
def _quiet_artifact_downloads() -> Iterator[None]:
    """No download progress bars while MLflow reloads the model it logs (to infer its output schema)."""
    previous = os.environ.get(ENABLE_PROGRESS_BAR)
    os.environ[ENABLE_PROGRESS_BAR] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(ENABLE_PROGRESS_BAR, None)
        else:
            os.environ[ENABLE_PROGRESS_BAR] = previous


def is_classifier(model: torch.nn.Module) -> bool:
    """Whether the module carries what the served classifier needs (as ``recipes.classifier.ImageClassifier``)."""
    return all(hasattr(model, attr) for attr in ("cost_matrix", "class_names", "decision"))


def _is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def unsharded_copy(pl_module: pl.LightningModule, is_global_zero: bool) -> torch.nn.Module | None:
    """A CPU copy of the module with full weights on rank 0 (``None`` elsewhere); collective if sharded.

    The copy is rebuilt from the module's saved hyperparameters, so it holds no trainer state.
    """
    if _is_sharded(pl_module):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(pl_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = {k: v.detach().cpu() for k, v in pl_module.state_dict().items()}
    if not is_global_zero:
        return None
    fresh = type(pl_module)(**{k: v for k, v in pl_module.hparams.items() if not k.startswith("_")})
    fresh.load_state_dict(state)
    return fresh.eval()


class LogModel(Callback):
    """Log the model of a finished fit as the MLflow run's ``model`` artifact.

    Args:
        name: the logged model's name within the run.
        defer: on one device, only remember the model at fit end; :meth:`log_deferred` logs it once
            ``trainer.fit`` has returned (the CLI does, before its summary), so that the ~2 s of
            MLflow's model logging is not part of ``trainer.fit``.

    A classifier's logged model is the served classifier (``mlflow.pyfunc.load_model``; ``mlflow models
    serve``), other modules' a PyTorch model (``mlflow.pytorch.load_model``).

    The datamodule must provide ``example_input()`` (a batch-of-one tensor) for the input
    example; callbacks with an ``interrupted`` attribute set veto the logging.

    Example::

        trainer = Trainer(logger=MLFlowLogger(...), callbacks=[LogModel()])
    """

    def __init__(self, name: str = "model", defer: bool = False) -> None:
        self.name = name
        self.defer = defer
        self.model_uri: str | None = None
        self._deferred: tuple[Trainer, pl.LightningModule] | None = None

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        if any(getattr(cb, "interrupted", False) for cb in trainer.callbacks):
            return
        if self.defer and trainer.world_size == 1:  # sharded or not, more ranks gather inside fit as before
            self._deferred = (trainer, pl_module)
            return
        self._log_fit(trainer, pl_module)

    def after_fit(self, trainer: Trainer) -> None:
        """After ``trainer.fit`` (``callbacks.utils.run_report.AfterFit``): the model ``defer`` held back."""
        self.log_deferred()

    def log_deferred(self) -> str | None:
        """Log the model that ``defer`` held back at fit end (call once ``trainer.fit`` has returned)."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            self._log_fit(*deferred)
        return self.model_uri

    def _log_fit(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        logger = next((lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)), None)
        if logger is None:
            return
        model = unsharded_copy(pl_module, trainer.is_global_zero)
        if model is None:
            return
        datamodule: Any = trainer.datamodule
        example = datamodule.example_input() if hasattr(datamodule, "example_input") else None
        if example is not None and example.shape[0] == 1:
            # torch.export specializes a batch dimension of size 1: show it a batch of 2 to keep it dynamic
            example = torch.cat([example, example])
        import mlflow  # here, not at the top: the other ranks never log a model, and never import MLflow

        mlflow.set_tracking_uri(logger.experiment.tracking_uri)  # the logger's store (its MlflowClient's), on rank 0
        info = self._log(model, logger.run_id, example)
        self.model_uri = info.model_uri
        log.info("Logged model %s", self.model_uri)

    @staticmethod
    def discard_pending(client: mlflow.MlflowClient, run_id: str) -> list[str]:
        """Mark FAILED the models of run ``run_id`` still PENDING: a process killed while it logged one left them.

        MLflow registers a logged model as PENDING before it writes it and as READY after; a SIGKILL
        between the two leaves a model that will never be complete on the run. The relaunch that
        logs the model again (one launch per run at a time: the run lock) marks those FAILED first.
        Returns their ids.
        """
        from mlflow.entities import LoggedModelStatus

        experiment_id = client.get_run(run_id).info.experiment_id
        pending = [m for m in client.search_logged_models([experiment_id], filter_string=f"source_run_id = '{run_id}'")
                   if m.status == LoggedModelStatus.PENDING]
        for orphan in pending:
            client.finalize_logged_model(orphan.model_id, LoggedModelStatus.FAILED)
            log.warning("Model %s of MLflow run %s was left half-logged by an earlier attempt; marked FAILED.",
                        orphan.model_id, run_id)
        return [m.model_id for m in pending]

    def _log(self, model: torch.nn.Module, run_id: str, example: torch.Tensor | None) -> Any:
        import mlflow

        client = mlflow.MlflowClient()
        status = client.get_run(run_id).info.status
        self.discard_pending(client, run_id)
        with mlflow.start_run(run_id=run_id):
            if is_classifier(model):
                info = self._log_classifier(model, example)
            else:
                info = mlflow.pytorch.log_model(
                    model,
                    name=self.name,
                    input_example=None if example is None else example.numpy(),
                    # the pt2 (torch.export) program needs torch alone; inferring requirements costs ~10 s
                    pip_requirements=mlflow.pytorch.get_default_pip_requirements(),
                )
        client.update_run(run_id, status=status)  # leaving the context ended the run; the logger ends it
        return info

    def _log_classifier(self, model: Any, example: torch.Tensor | None) -> Any:
        """The served classifier: the network saved as a PyTorch model inside a pyfunc model logged as code."""
        if example is None:
            raise ValueError("LogModel: a classifier is served with an input example; the datamodule has no "
                             "example_input().")
        import mlflow

        requirements = [*mlflow.pytorch.get_default_pip_requirements(), f"mlflow=={mlflow.__version__}"]
        with tempfile.TemporaryDirectory() as tmp:
            network = Path(tmp) / "network"
            mlflow.pytorch.save_model(model, str(network), input_example=example.numpy(),
                                      pip_requirements=requirements)
            # an artifact, not model_config: MLflow logs a model_config as run params (the whole cost matrix)
            serving = Path(tmp) / "serving.json"
            serving.write_text(json.dumps({"classes": list(model.class_names), "decision": str(model.decision),
                                           "costs": model.cost_matrix.detach().cpu().tolist()}))
            with warnings.catch_warnings(), _quiet_artifact_downloads():
                warnings.filterwarnings("ignore", message=".*Inferred schema contains integer column")  # class_index
                return mlflow.pyfunc.log_model(
                    name=self.name,
                    python_model=str(SERVED_CLASSIFIER),
                    artifacts={"network": str(network), "serving": str(serving)},
                    code_paths=[str(DECISION_MATH)],
                    input_example=(example.numpy(), {"decision": str(model.decision)}),
                    pip_requirements=requirements,
                )
