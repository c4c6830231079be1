"""Lightning's rich progress bar, with an epoch count that makes sense for step-limited runs.

Lightning's ``RichProgressBar`` labels the bar ``Epoch {current}/{max_epochs - 1}``, which reads
``Epoch 0/-2`` when a run is bounded by ``max_steps`` (``max_epochs=-1``). This one shows
``Epoch 0`` then, and ``Epoch 3/19`` as before otherwise.

Example::

    trainer = Trainer(callbacks=[RunProgressBar(leave=True)], max_steps=300)

Copy with it: nothing; this file works alone.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override


class RunProgressBar(RichProgressBar):
    """``RichProgressBar`` without a negative epoch total on step-limited runs."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs < 0:  # no epoch limit: no total to show
            return description.replace(f"/{max_epochs - 1}", "", 1)
        return description
