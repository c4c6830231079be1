"""StepTiming logs the checkpoints of one step as one ``time/checkpoint_s`` point: their summed stall."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, TensorDataset

from callbacks.timing import StepTiming
from tests.conftest import RecordingLogger, TinyModule


class TwoSavesAt(Callback):
    """Two checkpoints after step ``step`` (as a best and a periodic one at an epoch's end), one after step 6."""

    def __init__(self, directory: Path, step: int) -> None:
        self.directory, self.step = directory, step

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.directory / "a.ckpt")
            trainer.save_checkpoint(self.directory / "b.ckpt")
        elif trainer.global_step == 6:
            trainer.save_checkpoint(self.directory / "last.ckpt")  # the last step: logged at train end


def test_two_saves_of_one_step_are_one_point(tmp_path: Path) -> None:
    logger, timer = RecordingLogger(), StepTiming(plot=False)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=6, default_root_dir=tmp_path, logger=logger,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      callbacks=[timer, TwoSavesAt(tmp_path, 4)], log_every_n_steps=3)
    trainer.fit(TinyModule(), train_dataloaders=DataLoader(TensorDataset(torch.randn(12, 2)), batch_size=2))
    points = logger.values("time/checkpoint_s")
    assert [step for step, _ in points] == [4, 6]
    assert timer.checkpoints == 3
    assert sum(v for _, v in points) == pytest.approx(timer.checkpoint_s, rel=1e-12)
    assert points[0][1] == pytest.approx(timer.checkpoint_s - points[1][1], rel=1e-12)
