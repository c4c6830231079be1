"""The resumable training loader: a resumed run sees exactly the batches an uninterrupted run sees."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import TensorDataset

from datamodules.loaders import PassSampler, stateful_train_loader


class Recorder(LightningModule):
    """A one-weight model whose training loader is the resumable one; it records every sample it sees."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.batch_size = batch_size
        self.seen: list[list[int]] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(batch[0].flatten().long().tolist())
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        data = TensorDataset(torch.arange(20, dtype=torch.float32).unsqueeze(1))
        return stateful_train_loader(data, self.batch_size, seed=7, trainer=self.trainer)


class Crash(Callback):
    """Save a checkpoint after optimizer step ``at`` and die, as a killed spot run does."""

    def __init__(self, at: int, path: Path) -> None:
        self.at, self.path = at, path

    def on_train_batch_end(self, trainer: Trainer, *args: object) -> None:
        if trainer.global_step == self.at:
            trainer.save_checkpoint(self.path)
            raise SystemExit("killed")


def _fit(root: Path, max_epochs: int, ckpt: Path | None = None, crash_at: int | None = None,
         **trainer_args: object) -> list[list[int]]:
    """Train the recorder; with ``crash_at``, die after that step with a checkpoint in ``root/kill.ckpt``."""
    model = Recorder()
    trainer = Trainer(accelerator="cpu", max_epochs=max_epochs, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
                      callbacks=[Crash(crash_at, root / "kill.ckpt")] if crash_at else [], **trainer_args)
    try:
        trainer.fit(model, ckpt_path=ckpt)
    except SystemExit:
        assert crash_at is not None
    return model.seen


@pytest.mark.parametrize(("limit", "crash_at"), [(None, 7), (3, 3), (3, 4), (3, 8), (0.5, 2), (0.5, 5)],
                         ids=["full-mid-epoch", "3-end-of-epoch", "3-start", "3-mid", "half-end", "half-mid"])
def test_a_killed_run_resumes_with_exactly_the_uninterrupted_batches(tmp_path: Path, limit: float | None,
                                                                       crash_at: int) -> None:
    args = {} if limit is None else {"limit_train_batches": limit}
    full = _fit(tmp_path / "full", 4, **args)
    first = _fit(tmp_path / "cut", 4, crash_at=crash_at, **args)
    second = _fit(tmp_path / "cut", 4, ckpt=tmp_path / "cut" / "kill.ckpt", **args)
    per_epoch = {None: 5, 3: 3, 0.5: 2}[limit]  # 20 samples / 4 = 5 batches; half of 5 is 2
    assert len(full) == 4 * per_epoch and len(first) == crash_at
    assert first + second == full


def test_pass_sampler_state_round_trips() -> None:
    data = TensorDataset(torch.arange(10))
    sampler = PassSampler(data, num_replicas=1, rank=0, seed=3)
    sampler.set_epoch(0)
    it = iter(sampler)
    head = [next(it) for _ in range(4)]
    restored = PassSampler(data, num_replicas=1, rank=0, seed=3)
    restored.load_state_dict(sampler.state_dict())
    assert sampler.state_dict() == {"epoch": 0, "yielded": 4}
    assert head + list(restored) == list(PassSampler(data, num_replicas=1, rank=0, seed=3))


class WorkerRecorder(Recorder):
    """The recorder with loader workers and a validation loop, whose end is where Lightning saves the epoch."""

    def __init__(self, num_workers: int) -> None:
        super().__init__()
        self.num_workers = num_workers

    def train_dataloader(self):
        data = TensorDataset(torch.arange(20, dtype=torch.float32).unsqueeze(1))
        return stateful_train_loader(data, self.batch_size, seed=7, trainer=self.trainer, num_workers=self.num_workers)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        return None

    def val_dataloader(self):
        return torch.utils.data.DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=4)


class CrashAtEpochEnd(Callback):
    """Save at the end of the epoch whose last optimizer step is ``at`` (in ``hook``), then die."""

    def __init__(self, at: int, path: Path, hook: str) -> None:
        self.at, self.path, self.hook = at, path, hook

    def _maybe_crash(self, trainer: Trainer, hook: str) -> None:
        if hook == self.hook and trainer.global_step == self.at and not trainer.sanity_checking:
            trainer.save_checkpoint(self.path)
            raise SystemExit("killed")

    def on_validation_end(self, trainer: Trainer, *args: object) -> None:
        self._maybe_crash(trainer, "validation_end")  # the epoch is not yet processed: its loader state is restored

    def on_train_epoch_end(self, trainer: Trainer, *args: object) -> None:
        self._maybe_crash(trainer, "train_epoch_end")  # processed: Lightning restores no loader state


@pytest.mark.parametrize("hook", ["validation_end", "train_epoch_end"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_run_resumed_at_an_epochs_end_with_workers_starts_the_next_pass(tmp_path: Path, num_workers: int,
                                                                          hook: str) -> None:
    """Workers draw indices as soon as Lightning creates the iterator, before it sets the epoch: the first pass after
    an epoch-end resume once replayed pass 0 with workers (the weights of the resumed run differed)."""
    def fit(root: Path, ckpt: Path | None = None, crash: bool = False) -> list[list[int]]:
        model = WorkerRecorder(num_workers)
        trainer = Trainer(accelerator="cpu", max_epochs=3, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
                          num_sanity_val_steps=0,
                          callbacks=[CrashAtEpochEnd(5, root / "kill.ckpt", hook)] if crash else [])
        try:
            trainer.fit(model, ckpt_path=ckpt)
        except SystemExit:
            assert crash
        return model.seen

    full = fit(tmp_path / "full")
    first = fit(tmp_path / "cut", crash=True)
    second = fit(tmp_path / "cut", ckpt=tmp_path / "cut" / "kill.ckpt")
    assert len(first) == 5 and first + second == full
