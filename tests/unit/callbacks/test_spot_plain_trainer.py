"""SpotCheckpoint in a plain ``Trainer`` (no ``AtomicCheckpointIO`` plugin), as a notebook user writes one.

Before the fix it trained, but silently wrote no integrity records: pruning kept every save (28 with
``keep=2``) and ``ckpt_store.newest_good`` found nothing, so the run could not resume. Now the callback
installs the plugin at setup, or stops there with one line naming what is missing.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

from callbacks.checkpoint_io import AtomicCheckpointIO, BoundedAsyncCheckpointIO
from callbacks.model_checkpoint import PublishedModelCheckpoint
from callbacks.spot import SpotCheckpoint
from callbacks.storage import ckpt_store


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)


def trainer(tmp_path: Path, callbacks: list, **kwargs) -> pl.Trainer:
    kwargs = {"accelerator": "cpu", "devices": 1, "max_steps": 12, "logger": False, "enable_progress_bar": False,
              "enable_model_summary": False, "enable_checkpointing": False, "default_root_dir": tmp_path, **kwargs}
    return pl.Trainer(callbacks=callbacks, **kwargs)


def test_plain_trainer_gets_the_plugin_and_prunes_records_and_resumes(tmp_path: Path) -> None:
    spot = SpotCheckpoint(every_n_steps=2, keep=2, dirpath=str(tmp_path / "ckpts"))
    t = trainer(tmp_path, [spot])
    t.fit(Tiny(), train_dataloaders=loader())
    assert type(t.strategy.checkpoint_io) is AtomicCheckpointIO
    names = sorted(p.name for p in (tmp_path / "ckpts").glob("step=*.ckpt"))
    assert names == ["step=00000010.ckpt", "step=00000012.ckpt"]  # pruned to keep=2, not 6 files
    newest = ckpt_store.newest_good(tmp_path / "ckpts")
    assert newest is not None and newest.global_step == 12
    resumed = trainer(tmp_path, [SpotCheckpoint(keep=2, dirpath=str(tmp_path / "ckpts"))], max_steps=16)
    resumed.fit(Tiny(), train_dataloaders=loader(), ckpt_path=str(newest.path))
    assert resumed.global_step == 16


def test_async_wrapper_of_the_default_io_gets_the_atomic_one_inside(tmp_path: Path) -> None:
    spot = SpotCheckpoint(every_n_steps=4, keep=1, dirpath=str(tmp_path / "ckpts"))
    t = trainer(tmp_path, [spot], plugins=[AsyncCheckpointIO()])
    t.fit(Tiny(), train_dataloaders=loader())
    assert isinstance(t.strategy.checkpoint_io, AsyncCheckpointIO)
    assert type(t.strategy.checkpoint_io.checkpoint_io) is AtomicCheckpointIO
    assert [p.name for p in (tmp_path / "ckpts").glob("step=*.ckpt")] == ["step=00000012.ckpt"]
    assert ckpt_store.newest_good(tmp_path / "ckpts").global_step == 12


def test_the_atomic_plugin_given_is_kept(tmp_path: Path) -> None:
    io = BoundedAsyncCheckpointIO(AtomicCheckpointIO())
    t = trainer(tmp_path, [SpotCheckpoint(every_n_steps=4, dirpath=str(tmp_path / "c"))], plugins=[io])
    t.fit(Tiny(), train_dataloaders=loader())
    assert t.strategy.checkpoint_io is io


class OwnIO(CheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        torch.save(checkpoint, path)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        return torch.load(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path):
        Path(path).unlink()


@pytest.mark.parametrize("make", [lambda: SpotCheckpoint(dirpath="c"), lambda: PublishedModelCheckpoint(dirpath="c")])
def test_another_io_stops_at_setup_with_one_line(tmp_path: Path, make) -> None:
    callback = make()
    t = trainer(tmp_path, [callback], plugins=[OwnIO()], enable_checkpointing=True)
    with pytest.raises(ValueError) as err:
        t.fit(Tiny(), train_dataloaders=loader())
    message = str(err.value)
    assert "\n" not in message
    assert message == (f"{type(callback).__name__} needs the trainer's checkpoint IO to be AtomicCheckpointIO (it "
                       "writes the integrity records that pruning and resume read), but the trainer has OwnIO: "
                       "pass plugins=[AtomicCheckpointIO()] (or BoundedAsyncCheckpointIO(AtomicCheckpointIO())) "
                       "to the Trainer.")
    assert t.global_step == 0


def test_published_model_checkpoint_in_a_plain_trainer_writes_records(tmp_path: Path) -> None:
    best = PublishedModelCheckpoint(dirpath=str(tmp_path / "best"), every_n_train_steps=6, save_top_k=-1,
                                    filename="{step}")
    t = trainer(tmp_path, [best], enable_checkpointing=True)
    t.fit(Tiny(), train_dataloaders=loader())
    assert type(t.strategy.checkpoint_io) is AtomicCheckpointIO
    steps = sorted(ckpt_store.read_record(p, verify_hash=True).global_step for p in (tmp_path / "best").glob("*.ckpt"))
    assert steps == [6, 12]
    assert TorchCheckpointIO  # the default the callbacks replace
