"""FixedCpuThreads: the count a run starts with holds for its life and comes back on resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, TensorDataset

from callbacks.cpu_threads import THREADS_METRIC, FixedCpuThreads
from tests.conftest import RecordingLogger, TinyModule


class ThreadsSeen(Callback):
    """Torch's thread count at every training step."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(torch.get_num_threads())


def fit(tmp_path: Path, steps: int, ckpt_path: str | None = None) -> tuple[ThreadsSeen, RecordingLogger, Trainer]:
    seen, logger = ThreadsSeen(), RecordingLogger()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, default_root_dir=tmp_path, logger=logger,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      callbacks=[FixedCpuThreads(), seen])
    data = DataLoader(TensorDataset(torch.randn(16, 2)), batch_size=2)
    trainer.fit(TinyModule(), train_dataloaders=data, ckpt_path=ckpt_path)
    return seen, logger, trainer


@pytest.fixture
def threads():
    """Torch's count as the test found it, put back afterwards."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_resume_sets_the_count_the_run_started_with(tmp_path: Path, threads: int) -> None:
    torch.set_num_threads(2)
    seen, logger, trainer = fit(tmp_path, 3)
    assert seen.seen == [2, 2, 2]
    assert logger.values(THREADS_METRIC) == [(0, 2.0)]
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    assert torch.load(tmp_path / "a.ckpt", weights_only=True)["callbacks"]["FixedCpuThreads"] == \
        {"threads": 2, "world_size": 1}

    torch.set_num_threads(1)  # the relaunch's process would use 1 (another machine, or OMP_NUM_THREADS=1)
    seen, logger, _ = fit(tmp_path, 6, ckpt_path=str(tmp_path / "a.ckpt"))
    assert seen.seen == [2, 2, 2]  # steps 4-6 at the run's count
    assert logger.values(THREADS_METRIC) == []  # held, not changed: nothing new for the history
    assert torch.get_num_threads() == 1  # the process as it was found


def test_a_checkpoint_of_another_world_size_keeps_this_launch_count(threads: int) -> None:
    callback = FixedCpuThreads()
    callback.load_state_dict({"threads": 2, "world_size": 4})
    callback._initial_threads, callback._world_size, callback.threads = 1, 1, 1  # as setup leaves it here
    torch.set_num_threads(1)
    callback.on_fit_start(None, None)  # type: ignore[arg-type]
    assert callback.threads == 1 and torch.get_num_threads() == 1


def test_bad_count_is_refused() -> None:
    with pytest.raises(ValueError, match=r"FixedCpuThreads\(threads=0\)"):
        FixedCpuThreads(threads=0)
