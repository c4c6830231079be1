"""Lightning's rich progress bar, drawn at most a few times a second, with an epoch count that makes sense.

Lightning's ``RichProgressBar`` redraws on every batch and collects the progress-bar metrics for it: on
small, fast steps (the digits recipe's) that is per-step host work the training pays for and no
eye can follow. This one draws at most ``max_refresh_hz`` times a second, and always on an epoch's or a
validation's last batch, so the bar never ends short of its total.

With ``leave=True`` Lightning stops its live display at each epoch's start (printing the finished bar)
and starts a new one, with a new console and refresh thread: 0.65 s of the digits recipe's 10 s fit (20
epochs of 0.5 s). This one prints the finished epoch's bars above the running display and keeps it.

Lightning labels the bar ``Epoch {current}/{max_epochs - 1}``, which reads ``Epoch 0/-2`` when a run is
bounded by ``max_steps`` (``max_epochs=-1``). This one shows ``Epoch 0`` then, and ``Epoch 3/19`` as before
otherwise.

Example::

    trainer = Trainer(callbacks=[RunProgressBar(leave=True)], max_steps=300)

Copy with it (paths under ``callbacks/``, each folder with an ``__init__.py``): ``utils/compat.py``.
"""

from __future__ import annotations

import math
from time import monotonic
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from .utils.compat import LabelledRichProgressBar

#: Redraws per second at most: a counter that changes four times a second reads as live, and each redraw (in
#: the refresh thread, holding the GIL) is time the training step waits for.
DEFAULT_MAX_REFRESH_HZ = 4.0


class RunProgressBar(LabelledRichProgressBar):
    """``RichProgressBar`` drawn at most ``max_refresh_hz`` times a second, without a negative epoch total.

    Args:
        refresh_rate: how often a second Lightning's refresh thread looks for something to draw (``0``:
            no display); by default ``max_refresh_hz`` rounded up. Lightning's own default, 100, wakes the
            thread 100 times a second to look for at most ``max_refresh_hz`` draws, and every wake-up
            takes the GIL from the training step for a moment.
        leave: keep each finished epoch's bars on the terminal, above the one live display.
        max_refresh_hz: redraws a second at most.
    """

    def __init__(self, refresh_rate: int | None = None, leave: bool = False, *args: Any,
                 max_refresh_hz: float = DEFAULT_MAX_REFRESH_HZ, **kwargs: Any) -> None:
        if not max_refresh_hz > 0:
            raise ValueError(f"RunProgressBar(max_refresh_hz={max_refresh_hz!r}): expected a positive number.")
        # Lightning's own leave would stop the display at each epoch's start and start a new one: kept here instead
        super().__init__(math.ceil(max_refresh_hz) if refresh_rate is None else refresh_rate, False, *args, **kwargs)
        self.leave = leave
        self._min_interval_s = 1.0 / max_refresh_hz
        self._last_drawn: float | None = None

    def _due(self, batch_idx: int, total: int | float) -> bool:
        """Whether to draw now: the first batch, the last one, or ``1 / max_refresh_hz`` after the last draw."""
        now = monotonic()
        if self._last_drawn is None or batch_idx + 1 >= total or now - self._last_drawn >= self._min_interval_s:
            self._last_drawn = now
            return True
        return False

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.is_disabled and self._due(batch_idx, self.total_train_batches):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        # a disabled bar (every rank but 0) never learns the current dataloader, whose total it cannot read
        if not self.is_disabled and self._due(batch_idx, self.total_val_batches_current_dataloader):
            super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        progress = self.progress
        if self.leave and progress is not None and self.train_progress_bar_id is not None:
            # the finished epoch's bars, printed above the running display (Lightning then resets the epoch's task)
            progress.console.print(progress.make_tasks_table(progress.tasks))
        super().on_train_epoch_start(trainer, pl_module)

    @override
    def train_label(self, label: str) -> str:
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs < 0:  # no epoch limit: no total to show
            return label.replace(f"/{max_epochs - 1}", "", 1)
        return label
