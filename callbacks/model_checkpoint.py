"""Lightning's ModelCheckpoint, with sharded (FSDP) checkpoints published like every other one.

A file checkpoint goes through the trainer's checkpoint IO, which writes its integrity record and
uploads it (``AtomicCheckpointIO``). A distributed checkpoint, a directory of shards written by
``torch.distributed.checkpoint``, bypasses the checkpoint IO, so ModelCheckpoint's best-k
directories would get no record: a resume could not verify them and object storage would never
see them. This subclass records and uploads such a directory once every rank has written it. A trainer
without ``AtomicCheckpointIO`` gets it at setup (its file checkpoints would have no record either); another
IO stops the fit at setup with one line.

Example::

    trainer = Trainer(callbacks=[PublishedModelCheckpoint(monitor="val/acc", mode="max")])

Copy with it (paths under ``callbacks/``, each folder with an ``__init__.py``): ``checkpoint_io.py``,
``storage/{ckpt_store,safe_load,remote_store}.py``, ``utils/compat.py``.
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import LightningModule, Trainer
from typing_extensions import override

from .checkpoint_io import mirror_of, require_atomic_io
from .storage import ckpt_store
from .utils.compat import ModelCheckpointAfterSave


def mlflow_run_id(trainer: Trainer) -> str | None:
    """The run id of the trainer's first logger that has one (the MLflow run a checkpoint belongs to)."""
    return next((getattr(lg, "run_id", None) for lg in trainer.loggers if getattr(lg, "run_id", None)), None)


class PublishedModelCheckpoint(ModelCheckpointAfterSave):
    """``ModelCheckpoint`` that gives directory checkpoints an integrity record and uploads them if mirrored."""

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            require_atomic_io(trainer, type(self).__name__)  # records for file checkpoints too
        super().setup(trainer, pl_module, stage)

    @override
    def after_save(self, trainer: Trainer, filepath: str) -> None:
        path = Path(filepath)
        if not trainer.is_global_zero or not path.is_dir():
            return
        ckpt_store.write_record(path, trainer.global_step, trainer.current_epoch,
                                extra={"mlflow_run_id": mlflow_run_id(trainer)})
        mirror = mirror_of(trainer.strategy.checkpoint_io)
        if mirror is not None:
            mirror.try_publish(path)
