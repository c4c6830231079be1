"""The resumable loader continues on another number of workers: its position is the sampler's global cursor.

torchdata restores its own loader state only into a loader with the worker count that saved it (an assertion
otherwise); a relaunch with other ``num_workers`` (``recipes.run.context.DATA_SETTINGS``) must still see exactly
the batches an uninterrupted run sees.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import TensorDataset

from datamodules import compat
from datamodules.loaders import stateful_train_loader
from tests.unit.datamodules.test_loaders import Crash, CrashAtEpochEnd, WorkerRecorder

pytestmark = pytest.mark.timeout(180)


def fit(root: Path, num_workers: int, ckpt: Path | None = None, crash: Callback | None = None) -> list[list[int]]:
    """Two epochs of the recorder (5 batches each) with ``num_workers``; the samples of every step it trained."""
    model = WorkerRecorder(num_workers)
    trainer = Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
                      num_sanity_val_steps=0, callbacks=[crash] if crash else [])
    try:
        trainer.fit(model, ckpt_path=ckpt)
    except SystemExit:
        assert crash is not None
    return model.seen


@pytest.mark.parametrize(("saved", "resumed", "stop"), [
    (0, 2, "step 3"), (2, 0, "step 3"), (2, 1, "step 7"), (0, 2, "validation_end"), (2, 0, "validation_end")])
def test_a_run_stopped_with_one_worker_count_resumes_exactly_with_another(tmp_path: Path, saved: int, resumed: int,
                                                                          stop: str) -> None:
    kill = tmp_path / "cut" / "kill.ckpt"
    crash = CrashAtEpochEnd(5, kill, stop) if stop == "validation_end" else Crash(int(stop.split()[1]), kill)
    full = fit(tmp_path / "full", 0)
    first = fit(tmp_path / "cut", saved, crash=crash)
    second = fit(tmp_path / "cut", resumed, ckpt=kill)
    assert len(full) == 10 and len(first) == {"step 3": 3, "step 7": 7, "validation_end": 5}[stop]
    assert first + second == full


@pytest.mark.parametrize("workers", [0, 2])
def test_saved_num_workers_reads_the_count_a_state_was_taken_with(workers: int) -> None:
    data = TensorDataset(torch.arange(40))
    load = stateful_train_loader(data, 4, seed=0, trainer=None, num_workers=workers)
    batches = iter(load)
    next(batches)
    assert compat.saved_num_workers(load.state_dict()) == workers, "torchdata moved the state's worker count"
    assert compat.saved_num_workers({}) is None
