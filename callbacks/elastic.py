"""Elastic resume: what a run resumed on another number of devices keeps, and what follows the new world.

A checkpoint written on ``W`` ranks can be resumed on ``M``: the training loader's global sample cursor
(``datamodules/loaders.py``) continues the interrupted epoch with exactly the samples not yet trained,
split over the ``M`` ranks; a distributed (FSDP) checkpoint is resharded by ``torch.distributed.checkpoint``
on load; each rank's RNG follows ``callbacks/utils/rng.py``'s mapping. What the world size changes is the
global batch, ``per-device batch x M x accumulation``. By default it follows the world (and
:class:`callbacks.lr_scaling.LRScaling`, when present, scales the learning rate for the new global
batch); with ``keep_global_batch`` this callback pins the global batch of the run's first world
instead, through gradient accumulation: a run that shrinks from 2 ranks to 1 accumulates 2 batches per
optimizer step, and every optimizer step then takes the same samples as on 2 ranks.

The state (``state_dict``) is the world size, the accumulation and the pinned global batch (in
per-device batches) of the save.

Logged (rank 0, at the first launch's start and at each resume on another world size): ``elastic/world_size``,
``elastic/accumulate_grad_batches``.

Copy with it: nothing; this file works alone.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

log = logging.getLogger(__name__)


def kept_accumulation(global_units: int, world_size: int) -> int | None:
    """Batches to accumulate on ``world_size`` ranks for a global batch of ``global_units`` per-device batches.

    None when the world does not divide it (3 ranks cannot make a global batch of 2 or 4 per-device batches).

    Example::

        >>> kept_accumulation(2, 1), kept_accumulation(4, 2), kept_accumulation(2, 4)
        (2, 2, None)
    """
    if world_size < 1 or global_units % world_size:
        return None
    return global_units // world_size


class ElasticResume(Callback):
    """Apply the run's global-batch rule when a resume finds another world size.

    Args:
        keep_global_batch: keep the global batch of the run's first world (per-device batch x ranks x
            accumulation) by changing the gradient accumulation; False: the global batch follows the
            world size (and ``LRScaling``, when present, scales the learning rate with it).

    Example::

        python -m recipes.fit --config configs/digits.yaml --config configs/strategy/ddp.yaml --run_name r
        # stopped, then relaunched on one process: 2 batches accumulated per optimizer step
        python -m recipes.fit --config configs/digits.yaml --run_name r --elastic.keep_global_batch true
    """

    def __init__(self, keep_global_batch: bool = False) -> None:
        self.keep_global_batch = keep_global_batch
        #: The pinned global batch in per-device batches (ranks x accumulation of the run's first world).
        self.global_units: int | None = None
        self.saved_world: int | None = None
        self._trainer_world: int | None = None
        self._accumulate: int | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._trainer_world, self._accumulate = trainer.world_size, trainer.accumulate_grad_batches
            if self.global_units is None:
                self.global_units = trainer.world_size * trainer.accumulate_grad_batches

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        state = next((v for k, v in (checkpoint.get("callbacks") or {}).items()
                      if k.startswith(type(self).__qualname__)), None)
        if not state or state.get("world_size") is None:
            return
        self.saved_world = int(state["world_size"])
        if self.saved_world == trainer.world_size:
            self.global_units = int(state["global_units"])
            return
        if not self.keep_global_batch:
            self.global_units = trainer.world_size * trainer.accumulate_grad_batches
            return
        self.global_units = int(state["global_units"])
        accumulate = kept_accumulation(self.global_units, trainer.world_size)
        if accumulate is None:
            if trainer.is_global_zero:
                log.warning("ElasticResume(keep_global_batch=True): %d ranks cannot make the run's global batch of "
                            "%d per-device batches; it follows the world size instead.", trainer.world_size,
                            self.global_units)
            self.global_units = trainer.world_size * trainer.accumulate_grad_batches
            return
        trainer.accumulate_grad_batches = self._accumulate = accumulate
        if trainer.is_global_zero:
            log.warning("ElasticResume: %d rank(s) instead of %d keep the global batch of %d per-device batches by "
                        "accumulating %d per optimizer step.", trainer.world_size, self.saved_world,
                        self.global_units, accumulate)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        # a segment starts at the first launch and where the world changed: a relaunch on the same world
        # logs nothing, so its history stays an uninterrupted run's
        if trainer.is_global_zero and self.saved_world != trainer.world_size:
            for logger in trainer.loggers:
                logger.log_metrics({"elastic/world_size": float(trainer.world_size),
                                    "elastic/accumulate_grad_batches": float(trainer.accumulate_grad_batches)},
                                   step=trainer.global_step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"world_size": self._trainer_world, "accumulate": self._accumulate, "global_units": self.global_units}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass  # read in on_load_checkpoint, where the new world is known
