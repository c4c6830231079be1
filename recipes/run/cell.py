"""What a run shows in a notebook cell: one line per epoch instead of a live progress bar.

Lightning's rich bar redraws a live display; in Jupyter without ``ipywidgets`` (and in the output a notebook
keeps) that is either nothing or a wall of frames. :class:`EpochLines` prints one short line when each
epoch's validation is done, on global rank 0: what a person glancing at the cell wants to see (the epoch,
the step, the loss and the monitored metric, the seconds it took).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar
from typing_extensions import override

from callbacks.analysis import keys

#: The metrics a line shows when the run logged them, in this order.
SHOWN = (keys.TRAIN_LOSS_KEY, keys.VAL_LOSS_KEY, keys.VAL_ACC_KEY, keys.VAL_COST_KEY)


class EpochLines(ProgressBar):
    """A progress "bar" of one printed line per finished epoch (rank 0), e.g.
    ``epoch 2/3  step 135  train/loss 0.1321  val/acc 0.9500  (1.4 s)``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._started = time.monotonic()

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._started = time.monotonic()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._enabled or not trainer.is_global_zero:
            return
        metrics: dict[str, Any] = trainer.callback_metrics
        total = f"/{trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""
        parts = [f"epoch {trainer.current_epoch + 1}{total}", f"step {trainer.global_step}"]
        parts += [f"{key} {float(metrics[key]):.4f}" for key in SHOWN if key in metrics]
        print("  ".join(parts) + f"  ({time.monotonic() - self._started:.1f} s)", file=sys.stdout, flush=True)
