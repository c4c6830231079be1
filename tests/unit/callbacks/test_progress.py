"""RunProgressBar: drawn at most max_refresh_hz times a second, always on an epoch's last batch."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import RichProgressBar
from torch.utils.data import DataLoader, TensorDataset

import callbacks.progress as progress
from callbacks.progress import RunProgressBar
from tests.conftest import TinyModule


def _loader(batches: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.ones(batches, 2)), batch_size=1)


def test_draws_every_interval_and_on_each_last_batch(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    ticks = itertools.count(step=3)  # every look at the clock is 3 s after the last; draws are 10 s apart
    monkeypatch.setattr(progress, "monotonic", lambda: float(next(ticks)))
    drawn: list[tuple[str, int]] = []
    train_end, val_end = RichProgressBar.on_train_batch_end, RichProgressBar.on_validation_batch_end

    def spy_train(self: Any, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        drawn.append(("train", batch_idx))
        train_end(self, trainer, module, outputs, batch, batch_idx)

    def spy_val(self: Any, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int,
                dataloader_idx: int = 0) -> None:
        drawn.append(("val", batch_idx))
        val_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx)

    monkeypatch.setattr(RichProgressBar, "on_train_batch_end", spy_train)
    monkeypatch.setattr(RichProgressBar, "on_validation_batch_end", spy_val)
    bar = RunProgressBar(max_refresh_hz=0.1)
    trainer = Trainer(max_epochs=1, callbacks=[bar], logger=False, enable_checkpointing=False,
                      num_sanity_val_steps=0, default_root_dir=tmp_path, accelerator="cpu")
    trainer.fit(TinyModule(), train_dataloaders=_loader(9), val_dataloaders=_loader(3))
    # clock 0 (first), 3, 6, 9, 12 (>= 10 after 0), 15, 18, 21, 24 (12 after 12; also the last batch)
    # then validation at 27 (3 after 24), 30, 33 (last of validation)
    assert drawn == [("train", 0), ("train", 4), ("train", 8), ("val", 2)]
    assert bar.progress is not None
    # the bar still ends at its total
    assert [task.completed for task in bar.progress.tasks if task.total == 9] == [9]


def test_a_rate_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_refresh_hz=0"):
        RunProgressBar(max_refresh_hz=0)


def test_a_disabled_bar_as_on_every_rank_but_0_draws_nothing_and_does_not_fail(tmp_path: Any) -> None:
    bar = RunProgressBar()
    bar.disable()  # what Lightning does on every rank but 0
    trainer = Trainer(max_epochs=1, callbacks=[bar], logger=False, enable_checkpointing=False,
                      num_sanity_val_steps=2, default_root_dir=tmp_path, accelerator="cpu")
    trainer.fit(TinyModule(), train_dataloaders=_loader(4), val_dataloaders=_loader(3))
    assert bar.progress is None and trainer.global_step == 4


def test_leave_keeps_each_finished_epoch_without_restarting_the_display(tmp_path: Any) -> None:
    import io
    import re

    out = io.StringIO()
    bar = RunProgressBar(leave=True, console_kwargs={"file": out, "force_terminal": True, "width": 120,
                                                      "color_system": None})
    started: list[object] = []
    start = RichProgressBar._init_progress

    def spy_init(self: Any, trainer: Any) -> None:
        start(self, trainer)
        started.append(self.progress)

    trainer = Trainer(max_epochs=3, callbacks=[bar], logger=False, enable_checkpointing=False,
                      num_sanity_val_steps=0, default_root_dir=tmp_path, accelerator="cpu")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RichProgressBar, "_init_progress", spy_init)
        trainer.fit(TinyModule(), train_dataloaders=_loader(4), val_dataloaders=_loader(2))
    assert len({id(p) for p in started}) == 1  # one live display for the whole fit
    # what stays on the terminal: each line's last redraw (after its last carriage return), codes removed
    shown = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line.split("\r")[-1]) for line in out.getvalue().split("\n")]
    assert [line.split()[1] for line in shown if line.startswith("Epoch")] == ["0/2", "1/2", "2/2"]
    assert all(" 4/4 " in line for line in shown if line.startswith("Epoch"))  # each epoch's finished bar


@pytest.mark.parametrize(("max_refresh_hz", "polls_per_s"), [(10.0, 10), (2.5, 3), (0.1, 1)])
def test_the_refresh_thread_wakes_no_more_often_than_the_bar_draws(tmp_path: Any, max_refresh_hz: float,
                                                                   polls_per_s: int) -> None:
    # Lightning's refresh thread sleeps 1 / refresh_rate between looks (refresh_rate 100 by default): 100 wake-ups
    # a second, each taking the GIL from the training step, to find at most max_refresh_hz draws
    polls: list[float] = []
    start = RichProgressBar._init_progress

    def spy_init(self: Any, trainer: Any) -> None:
        start(self, trainer)
        assert self.progress is not None
        polls.append(self.progress.live._refresh_thread.refresh_per_second)

    bar = RunProgressBar(max_refresh_hz=max_refresh_hz)
    trainer = Trainer(max_epochs=1, callbacks=[bar], logger=False, enable_checkpointing=False,
                      num_sanity_val_steps=0, default_root_dir=tmp_path, accelerator="cpu")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RichProgressBar, "_init_progress", spy_init)
        trainer.fit(TinyModule(), train_dataloaders=_loader(4), val_dataloaders=_loader(2))
    assert polls and set(polls) == {polls_per_s}
    assert bar.refresh_rate == polls_per_s and bar.is_enabled


@pytest.mark.parametrize(("limits", "shown"), [({"max_steps": 6}, ["0", "1"]), ({"max_epochs": 2}, ["0/1", "1/1"])])
def test_no_negative_epoch_total_when_only_steps_bound_the_run(tmp_path: Any, limits: dict[str, int],
                                                               shown: list[str]) -> None:
    import io
    import re

    out = io.StringIO()
    bar = RunProgressBar(leave=True, console_kwargs={"file": out, "force_terminal": True, "width": 120,
                                                      "color_system": None})
    trainer = Trainer(callbacks=[bar], logger=False, enable_checkpointing=False, num_sanity_val_steps=0,
                      default_root_dir=tmp_path, accelerator="cpu", **limits)  # max_steps alone: max_epochs=-1
    trainer.fit(TinyModule(), train_dataloaders=_loader(3), val_dataloaders=_loader(2))
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    assert "/-" not in text  # not even in a first frame
    lines = [line.split("\r")[-1] for line in text.split("\n")]
    assert [line.split()[1] for line in lines if line.startswith("Epoch")] == shown
