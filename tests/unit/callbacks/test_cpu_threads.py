"""AdaptiveCpuThreads: keeps the thread count whose steps are fastest now, probing the others with backoff."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, TensorDataset

from callbacks.cpu_threads import THREADS_METRIC, AdaptiveCpuThreads, ThreadChooser, candidate_counts
from tests.conftest import RecordingLogger, TinyModule


def drive(chooser: ThreadChooser, step_s: dict[int, float], steps: int) -> list[int]:
    """Feed ``steps`` steps whose time depends on the chooser's current count; the count of each step."""
    counts = []
    for _ in range(steps):
        counts.append(chooser.current)
        chooser.record(step_s[chooser.current])
    return counts


def test_candidate_counts() -> None:
    assert candidate_counts(1) == [1]
    assert candidate_counts(2) == [2, 1]
    assert candidate_counts(16) == [16, 15, 8, 1]
    with pytest.raises(ValueError, match="cores=0"):
        candidate_counts(0)


def test_quiet_machine_keeps_all_threads_and_backs_off_its_probes() -> None:
    chooser = ThreadChooser([2, 1], probe_every=4, max_probe_every=16, probe_steps=2, settle_steps=1, window=3)
    counts = drive(chooser, {2: 0.006, 1: 0.0075}, 80)
    # 3 steps fill the window and the first probe follows at once: 1 settling + 2 timed steps at 1 thread,
    # then 1 settling step back at 2; the next probes come after 8 timed steps, then 16, 16...
    assert counts[:3] == [2, 2, 2] and counts[3:6] == [1, 1, 1] and counts[6] == 2
    assert [i for i, count in enumerate(counts) if count == 1][3::3] == [15, 35, 55, 75]
    assert chooser.kept == 2 and chooser.probes == 5
    assert counts.count(1) == 5 * 3  # each probe: one settle step and two timed ones
    assert chooser.probe_every == 16
    assert chooser.last_probe == {2: 0.006, 1: 0.0075}


def test_busy_machine_moves_to_one_thread_and_stays() -> None:
    chooser = ThreadChooser([2, 1], probe_every=4, max_probe_every=16, probe_steps=2, settle_steps=0, window=3)
    counts = drive(chooser, {2: 0.015, 1: 0.0077}, 60)
    assert counts[:5] == [2, 2, 2, 1, 1]
    # kept at 1 from then on; 2 is probed again after 4 steps, then 8, 16, 16 (two steps each time)
    assert chooser.kept == 1
    assert [i for i, count in enumerate(counts) if count == 2 and i >= 5] == [9, 10, 19, 20, 37, 38, 55, 56]
    assert chooser.last_probe == {1: 0.0077, 2: 0.015}


def test_collapse_mid_run_starts_a_probe_at_once() -> None:
    chooser = ThreadChooser([2, 1], probe_every=1000, probe_steps=2, settle_steps=0, window=3, slowdown=1.5)
    drive(chooser, {2: 0.006, 1: 0.0075}, 10)  # the first probe (at step 3) finds 1 thread slower
    assert chooser.kept == 2 and chooser.probes == 1
    # another process starts: 2 threads now take 0.16 s; the window's median crosses 1.5x after 2 slow steps
    counts = drive(chooser, {2: 0.16, 1: 0.0077}, 6)
    assert counts == [2, 2, 1, 1, 1, 1] and chooser.kept == 1 and chooser.probes == 2


def test_a_hopeless_probe_ends_after_one_step() -> None:
    chooser = ThreadChooser([2, 1], probe_every=3, probe_steps=5, settle_steps=0, window=3, give_up=3.0)
    counts = drive(chooser, {2: 0.007, 1: 0.5}, 5)
    assert counts == [2, 2, 2, 1, 2]  # 0.5 s > 3 x 7 ms: one step of it is enough
    assert chooser.last_probe == {2: 0.007, 1: 0.5} and chooser.kept == 2


def test_a_hopeless_settling_step_ends_the_probe_too() -> None:
    chooser = ThreadChooser([2, 1], probe_every=3, probe_steps=5, settle_steps=2, window=3, give_up=3.0)
    # starts at 2 (slow); 3 steps fill the window, then 1 thread: 2 settling steps and 5 timed ones win
    assert drive(chooser, {1: 0.0077, 2: 0.16}, 10) == [2, 2, 2] + [1] * 7 and chooser.kept == 1
    counts = drive(chooser, {1: 0.0077, 2: 0.16}, 30)
    # 2 is probed after 3 steps, then 6 (+2 settling), then 12 (+2): one step each, its 0.16 s ends the probe
    assert [i for i, count in enumerate(counts) if count == 2] == [3, 4 + 2 + 6, 13 + 2 + 12]
    assert chooser.probes == 4
    assert chooser.last_probe == {1: 0.0077, 2: 0.16}


def test_small_gains_do_not_switch() -> None:
    chooser = ThreadChooser([2, 1], probe_every=3, probe_steps=2, settle_steps=0, window=3, gain=0.05)
    drive(chooser, {2: 0.0100, 1: 0.0097}, 30)  # 3 % faster: noise, not a reason to move
    assert chooser.kept == 2


def test_one_candidate_never_probes() -> None:
    chooser = ThreadChooser([1], probe_every=1, window=1)
    assert drive(chooser, {1: 0.01}, 10) == [1] * 10 and chooser.probes == 0


@pytest.mark.parametrize("settings, named", [
    ({"candidates": [0, 2]}, "candidates"), ({"candidates": [2], "probe_every": 0}, "probe_every"),
    ({"candidates": [2], "gain": 1.0}, "gain=1.0"), ({"candidates": [2], "slowdown": 1.0}, "slowdown=1.0")])
def test_bad_settings_name_the_value(settings: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ThreadChooser(**settings)


# ----------------------------------------------------------------------------- the callback in a Trainer
class _ThreadClock:
    """A clock whose steps last 15 ms at 2 threads and 7.7 ms at 1 (a busy neighbour), read per hook call."""

    def __init__(self) -> None:
        self.now = 0.0
        self.started = True

    def __call__(self) -> float:
        if not self.started:  # on_train_batch_end: the step took as long as its thread count makes it
            self.now += {2: 0.015, 1: 0.0077}[torch.get_num_threads()]
        self.started = not self.started
        return self.now


def test_callback_moves_a_busy_run_to_one_thread_logs_it_and_restores_the_count(tmp_path: Any) -> None:
    before = torch.get_num_threads()
    logger = RecordingLogger()
    threads = AdaptiveCpuThreads(candidates=[2, 1], clock=_ThreadClock(), probe_every=4, probe_steps=2,
                                 settle_steps=0, window=3)
    seen: list[int] = []

    class Spy(TinyModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append(torch.get_num_threads())
            return super().training_step(batch, batch_idx)

    trainer = Trainer(max_steps=12, callbacks=[threads], logger=logger, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      accelerator="cpu", log_every_n_steps=1000)
    trainer.fit(Spy(), train_dataloaders=DataLoader(TensorDataset(torch.ones(12, 2)), batch_size=1))
    assert seen == [2, 2, 2, 1, 1, 1, 1, 1, 1, 2, 2, 1]  # steps 10-11: 2 threads probed again, and lose
    assert threads.changes == [(5, 1)]  # decided at the end of the 5th step
    assert logger.values(THREADS_METRIC) == [(0, 2.0), (5, 1.0)]
    assert torch.get_num_threads() == before and set(threads.probed) == {1, 2}


def test_callback_leaves_a_multi_process_or_gpu_run_alone(tmp_path: Any) -> None:
    threads = AdaptiveCpuThreads()

    class FakeTrainer:
        world_size = 2
        accelerator = None

    threads.setup(FakeTrainer(), TinyModule(), "fit")  # type: ignore[arg-type]
    assert threads.chooser is None
