"""SpotCheckpoint saves a step once, also when ``every_n_steps`` lands on an epoch's last step."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, TensorDataset

from callbacks.spot import SpotCheckpoint
from tests.conftest import TinyModule


class SavesPerStep(Callback):
    def __init__(self) -> None:
        self.saves: Counter[int] = Counter()

    def on_save_checkpoint(self, trainer: Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.saves[trainer.global_step] += 1


def test_every_n_steps_on_an_epoch_end_saves_that_step_once(tmp_path: Path) -> None:
    saves = SavesPerStep()
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=2, default_root_dir=tmp_path, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      callbacks=[SpotCheckpoint(every_n_steps=4, dirpath=str(tmp_path / "ckpt")), saves])
    # 8 batches an epoch: steps 4 and 8 by every_n_steps, 8 and 16 by the epoch ends
    trainer.fit(TinyModule(), train_dataloaders=DataLoader(TensorDataset(torch.randn(16, 2)), batch_size=2))
    assert saves.saves == Counter({4: 1, 8: 1, 12: 1, 16: 1})
