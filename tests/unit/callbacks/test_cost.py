"""CostTracker: exact dollars under a fake clock, across an interrupted and resumed run; bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import cost
from callbacks.analysis.prices import get_instance, load_catalog
from callbacks.cost import PROGRESS_FILE, CostTracker, default_instances, read_steps_run
from tests.conftest import RecordingLogger

SPOT, ON_DEMAND = 4.42, 11.06  # a3-highgpu-1g, USD per hour (callbacks/analysis/prices.yaml)
STEP_S = 2.0


class FakeTime:
    """Stands in for the ``time`` module in ``callbacks.cost``: moves only when the test says so."""

    def __init__(self) -> None:
        self.mono = 0.0
        self.wall = 1_000_000.0

    def monotonic(self) -> float:
        return self.mono

    def time(self) -> float:
        return self.wall

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += seconds


class TimedModel(LightningModule):
    """Every training step takes ``STEP_S`` seconds of the fake clock."""

    def __init__(self, clock: FakeTime) -> None:
        super().__init__()
        self.clock = clock
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.clock.advance(STEP_S)
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4)  # 16 steps an epoch


class SaveThenDie(Callback):
    """Save a checkpoint after step ``save_at``; stop (the process 'dies') after step ``die_at``."""

    def __init__(self, path: Path, save_at: int, die_at: int) -> None:
        self.path, self.save_at, self.die_at = path, save_at, die_at

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.save_at:
            trainer.save_checkpoint(self.path)
        if trainer.global_step == self.die_at:
            trainer.should_stop = True


def _trainer(root: Path, callbacks: list[Callback], logger: Logger, max_steps: int = 10) -> Trainer:
    return Trainer(default_root_dir=root, max_steps=max_steps, accelerator="cpu", devices=1, logger=logger,
                   callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)


def usd(seconds: float, price: float = SPOT) -> float:
    return seconds / 3600 * price


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(cost, "time", fake)
    monkeypatch.setattr(cost, "launch_age_s", lambda: 0.0)  # spawn -> construction: none under the fake clock
    return fake


def test_uninterrupted_run_by_hand(tmp_path: Path, clock: FakeTime) -> None:
    logger = RecordingLogger()
    tracker = CostTracker(instance="a3-highgpu-1g", market="spot", log_every_n_steps=5, plot=False)
    clock.advance(3.0)  # start-up before training (model, data, MLflow) is billed too
    _trainer(tmp_path, [tracker], logger).fit(TimedModel(clock))
    # 3 s start-up + 10 steps x 2 s = 23 s; logged at steps 5 and 10, and at train end (step 10)
    assert logger.values("cost/billed_s") == [(5, 13.0), (10, 23.0), (10, 23.0)]
    assert logger.values("cost/usd") == [(5, pytest.approx(usd(13))), (10, pytest.approx(usd(23))),
                                         (10, pytest.approx(usd(23)))]
    final = logger.calls[-1][1]
    assert final["cost/usd_on_demand"] == pytest.approx(23 / 3600 * ON_DEMAND, rel=1e-12)
    assert final["cost/usd_spot"] == pytest.approx(23 / 3600 * SPOT, rel=1e-12)
    assert final["cost/savings_pct"] == pytest.approx(100 * (1 - 4.42 / 11.06), rel=1e-12)  # 60.04%
    assert (final["cost/lost_work_usd"], final["cost/lost_steps"], final["cost/restart_s"]) == (0.0, 0.0, 0.0)
    assert final["cost/instances"] == 1.0
    # projection at step 5: 13 s spent + 5 steps left x (10 s / 5 steps in the window) = 23 s
    (_, at5), _, _ = logger.calls
    assert at5["cost/projected_usd"] == pytest.approx(usd(23), rel=1e-12)
    assert final["cost/projected_usd"] == pytest.approx(usd(23), rel=1e-12)
    assert tracker.mean_step_s() == STEP_S
    assert read_steps_run(tmp_path / "checkpoints" / PROGRESS_FILE) == 10
    assert tracker.summary_rows({}) == [
        ("cost", "$0.0282 spot (1 x a3-highgpu-1g, 0.006 h billed)"),
        ("cost on-demand / spot", "$0.0707 / $0.0282, spot saves 60.0%"),
        # the ledger: 10 steps x 2 s productive, 3 s start-up (at $4.42/h spot, $11.06/h on-demand)
        ("goodput", "87.0% of 23.0 s billed bought steps that count (20.0 s, $0.0246)"),
        ("  badput: start-up", "3.0 s, $0.0037 spot / $0.0092 on-demand"),
    ]
    assert (final["goodput/productive_s"], final["goodput/startup_s"], final["goodput/share"]) == (20.0, 3.0, 20 / 23)


def test_a_free_instance_names_its_largest_badputs_by_time(tmp_path: Path, clock: FakeTime) -> None:
    """On a $0 machine (the default cpu-local) every badput costs $0: the largest are still named, by seconds."""
    logger = RecordingLogger()
    tracker = CostTracker(instance="cpu-local", log_every_n_steps=5, plot=False)
    clock.advance(3.0)
    _trainer(tmp_path, [tracker], logger).fit(TimedModel(clock))
    rows = dict(tracker.summary_rows({}))
    assert rows["goodput"] == "87.0% of 23.0 s billed bought steps that count (20.0 s, $0.0000)"
    assert rows["  badput: start-up"] == "3.0 s, $0.0000 on-demand"  # cpu-local has no spot price


def test_the_end_tables_badput_rows_add_up_to_the_billed_time() -> None:
    """Every non-zero badput has its row: the top three alone summed to 106.8 of a run's 108.8 s billed."""
    from callbacks.analysis import keys

    tracker = CostTracker(instance="a3-highgpu-1g", market="spot", plot=False)
    seconds = {"productive": 60.0, "startup": 20.0, "checkpoint": 12.0, "validation": 9.0, "data_wait": 4.0,
               "tail": 2.0, "restart": 1.8, "redone": 0.0, "comm_exposed": 0.0}
    billed = sum(seconds.values())  # 108.8 s
    tracker._final = {keys.BILLED_KEY: billed, keys.GOODPUT_SHARE_KEY: 60.0 / billed,
                      **{keys.goodput_seconds_key(k): v for k, v in seconds.items()},
                      **{keys.goodput_usd_key(k): v / 3600 * SPOT for k, v in seconds.items()}}
    rows = tracker.goodput_rows()
    badputs = {name: float(text.split(" s, ")[0]) for name, text in rows if name.startswith("  badput: ")}
    assert list(badputs) == ["  badput: start-up", "  badput: checkpoint stalls", "  badput: validation",
                             "  badput: data wait", "  badput: tail", "  badput: gaps between launches"]
    assert sum(badputs.values()) + 60.0 == pytest.approx(billed, rel=1e-3)


def test_interrupted_and_resumed_run_accumulates_and_counts_lost_work(tmp_path: Path, clock: FakeTime) -> None:
    ckpt = tmp_path / "checkpoints" / "step=4.ckpt"
    # Attempt 1: the clock starts at construction (t = 0); checkpoint after step 4 (8 s billed, saved at
    # wall time t = 8), the process dies after step 6 (12 s): steps 5 and 6 are lost.
    first = RecordingLogger()
    tracker1 = CostTracker(instance="a3-highgpu-1g", market="spot", log_every_n_steps=5, plot=False)
    _trainer(tmp_path, [tracker1, SaveThenDie(ckpt, save_at=4, die_at=6)], first).fit(TimedModel(clock))
    assert first.values("cost/billed_s") == [(5, 10.0), (6, 12.0)]
    assert first.calls[-1][1]["cost/usd"] == pytest.approx(usd(12), rel=1e-12)
    assert read_steps_run(tmp_path / "checkpoints" / PROGRESS_FILE) == 6
    state = torch.load(ckpt, weights_only=True)["callbacks"]["CostTracker"]
    ledger = state.pop("goodput")
    assert state == {"billed_s": 8.0, "instance_s": 8.0, "saved_at": 1_000_008.0, "lost_steps": 0,
                     "restart_s_total": 0.0, "step_s_total": 6.0, "steps_timed": 3,  # the first step apart
                     "goodput_first_steps": [["productive", 2.0, 2.0]],  # step 1, apart (see resolve_first_steps)
                     "goodput_reruns": [0.0, 0],
                     "usd": {"chosen": usd(8), "on_demand": 8 / 3600 * ON_DEMAND, "spot": usd(8)},
                     "segments": [{"instance": "a3-highgpu-1g", "market": "spot", "instances": 1, "billed_s": 8.0,
                                   "usd": usd(8)}]}
    assert ledger["seconds"] == {"startup": 0.0, "productive": 6.0, "data_wait": 0.0, "checkpoint": 0.0}  # steps 2-4

    # 30 s down, then the relaunch: gap = relaunch start (t = 42) - save (t = 8) = 34 s
    # (the 4 s of lost steps 5-6 and the 30 s down). Steps 5-10 again: 6 steps, 12 s.
    clock.advance(30.0)
    second = RecordingLogger()
    tracker2 = CostTracker(instance="a3-highgpu-1g", market="spot", log_every_n_steps=5, plot=False)
    _trainer(tmp_path, [tracker2], second).fit(TimedModel(clock), ckpt_path=ckpt)
    # at train start (step 4): 8 + 34 = 42 s, never less than what attempt 1 had billed (12 s)
    assert second.values("cost/billed_s") == [(4, 42.0), (5, 44.0), (10, 54.0), (10, 54.0)]
    assert [v for _, v in second.values("cost/usd")] == pytest.approx([usd(42), usd(44), usd(54), usd(54)])
    final = second.calls[-1][1]
    # the job: 12 s (attempt 1) + 30 s down + 12 s (attempt 2) = 54 s on one H100 spot
    assert final["cost/usd"] == pytest.approx(54 / 3600 * 4.42, rel=1e-12)  # $0.0663
    assert final["cost/usd_on_demand"] == pytest.approx(54 / 3600 * 11.06, rel=1e-12)
    assert final["cost/restart_s"] == 34.0
    # lost work: steps 5 and 6 ran twice: 2 steps x 2 s x $4.42/h
    assert final["cost/lost_steps"] == 2.0
    assert final["cost/lost_work_usd"] == pytest.approx(2 * 2.0 / 3600 * 4.42, rel=1e-12)
    assert [v for _, v in second.values("cost/lost_work_usd")] == pytest.approx([usd(4)] * 4)
    # projection at the resume (no window yet: the job's mean step time): 42 s + 6 steps x 2 s = 54 s
    assert second.calls[0][1]["cost/projected_usd"] == pytest.approx(usd(54), rel=1e-12)
    assert read_steps_run(tmp_path / "checkpoints" / PROGRESS_FILE) == 12  # 10 + 2 redone
    rows = tracker2.summary_rows({})
    assert rows[2] == ("cost of interruptions",
                       "$0.0049 lost work (2 steps redone x 2000.0 ms mean step), 34 s of restarts billed")
    # The ledger, from the same count: steps 5-6 were lost; their first runs are in the 34 s gap (2 x 2 s at
    # the mean step: redone), the other 30 s were the job down; their reruns count as productive.
    # 10 steps x 2 s productive + 4 s redone + 30 s restart = 54 s billed.
    goodput_s = {k: v for k, v in final.items() if k.startswith("goodput/") and k.endswith("_s")}
    assert goodput_s == {"goodput/productive_s": 20.0, "goodput/startup_s": 0.0, "goodput/redone_s": 4.0,
                         "goodput/checkpoint_s": 0.0, "goodput/validation_s": 0.0, "goodput/data_wait_s": 0.0,
                         "goodput/comm_exposed_s": 0.0, "goodput/tail_s": 0.0, "goodput/restart_s": 30.0}
    assert final["goodput/redone_usd"] == pytest.approx(usd(4), rel=1e-12) == final["cost/lost_work_usd"]
    assert final["goodput/share"] == pytest.approx(20 / 54, rel=1e-12)
    assert rows[3:] == [
        ("goodput", "37.0% of 54.0 s billed bought steps that count (20.0 s, $0.0246)"),
        ("  badput: gaps between launches", "30.0 s, $0.0368 spot / $0.0922 on-demand"),
        ("  badput: redone steps", "4.0 s, $0.0049 spot / $0.0123 on-demand"),
        ("  reruns measured", "2 steps in 4.0 s (2000.0 ms a step; the lost first runs are charged at the "
                              "2000.0 ms mean step)"),
    ]


def test_attempt_killed_before_saving_still_counts(tmp_path: Path, clock: FakeTime) -> None:
    """Two attempts die after the same checkpoint: both attempts' steps are lost work."""
    ckpt = tmp_path / "checkpoints" / "step=4.ckpt"
    tracker1 = CostTracker(instance="a3-highgpu-1g", log_every_n_steps=100)
    _trainer(tmp_path, [tracker1, SaveThenDie(ckpt, save_at=4, die_at=7)], RecordingLogger()).fit(
        TimedModel(clock))  # 14 s, steps 5-7 lost
    clock.advance(10.0)
    tracker2 = CostTracker(instance="a3-highgpu-1g", log_every_n_steps=100)
    _trainer(tmp_path, [tracker2, SaveThenDie(tmp_path / "unused.ckpt", save_at=-1, die_at=6)],
             RecordingLogger()).fit(TimedModel(clock), ckpt_path=ckpt)  # steps 5-6 again, dies unsaved: 4 s
    clock.advance(10.0)
    logger = RecordingLogger()
    tracker3 = CostTracker(instance="a3-highgpu-1g", log_every_n_steps=100)
    _trainer(tmp_path, [tracker3], logger).fit(TimedModel(clock), ckpt_path=ckpt)
    final = logger.calls[-1][1]
    # 3 (attempt 1) + 2 (attempt 2) steps redone; billed: 14 + 10 + 4 + 10 + 12 = 50 s at $11.06/h
    assert final["cost/lost_steps"] == 5.0
    assert final["cost/billed_s"] == 50.0
    assert final["cost/usd"] == pytest.approx(50 / 3600 * 11.06, rel=1e-12)
    assert final["cost/lost_work_usd"] == pytest.approx(5 * 2.0 / 3600 * 11.06, rel=1e-12)
    # the gap billed is the one from the checkpoint's save (t = 8) to the last relaunch (t = 38): it holds
    # attempt 1's 6 s after the save, 10 s down, attempt 2's 4 s and 10 s down
    assert final["cost/restart_s"] == 30.0


def test_fixed_restart_time_and_several_instances(tmp_path: Path, clock: FakeTime) -> None:
    ckpt = tmp_path / "checkpoints" / "step=4.ckpt"
    tracker1 = CostTracker(instance="a3-highgpu-8g", market="on_demand", instances=2, log_every_n_steps=100)
    _trainer(tmp_path, [tracker1, SaveThenDie(ckpt, save_at=4, die_at=4)], RecordingLogger()).fit(
        TimedModel(clock))  # 8 s on 2 instances
    clock.advance(500.0)  # an unbilled queue: bill a fixed 60 s restart instead
    logger = RecordingLogger()
    tracker2 = CostTracker(instance="a3-highgpu-8g", market="on_demand", instances=2, restart_s=60.0,
                           log_every_n_steps=100)
    _trainer(tmp_path, [tracker2], logger).fit(TimedModel(clock), ckpt_path=ckpt)
    final = logger.calls[-1][1]
    assert final["cost/billed_s"] == 8 + 60 + 12
    assert final["cost/usd"] == pytest.approx(80 / 3600 * 88.49 * 2, rel=1e-12)  # $3.93
    assert final["cost/usd_spot"] == pytest.approx(80 / 3600 * 35.40 * 2, rel=1e-12)
    assert final["cost/lost_steps"] == 0.0


def test_dollars_per_market_by_hand() -> None:
    tracker = CostTracker(instance="a3-highgpu-1g")
    one_hour = 3600.0
    assert tracker.usd("on_demand", one_hour) == 11.06
    assert tracker.usd("spot", one_hour) == 4.42
    assert tracker.usd(instance_s=2.5 * 3600) == pytest.approx(27.65, rel=1e-12)  # on-demand is the default
    eight = CostTracker(instance="a3-highgpu-8g", market="spot", price_spot=30.0)
    assert eight.usd(instance_s=2 * 3600) == 60.0  # 1 h on 2 instances at the overridden $30/h
    assert CostTracker().usd("on_demand", 10 * 3600) == 0.0  # cpu-local


def test_default_instances() -> None:
    catalog = load_catalog()
    cpu, h100, h100x8 = (get_instance(catalog, n) for n in ("cpu-local", "a3-highgpu-1g", "a3-highgpu-8g"))
    assert default_instances(cpu, world_size=2, num_nodes=1) == 1  # 2 processes on one machine
    assert default_instances(cpu, world_size=4, num_nodes=2) == 2
    assert default_instances(h100, world_size=4, num_nodes=1) == 4
    assert default_instances(h100x8, world_size=16, num_nodes=2) == 2
    assert default_instances(h100x8, world_size=8, num_nodes=2) == 2  # 4 GPUs on each of 2 machines
    assert default_instances(h100x8, world_size=4, num_nodes=1) == 1
    assert default_instances(h100x8, world_size=1, num_nodes=1) == 1


def test_state_round_trip_in_one_process_does_not_double_bill(clock: FakeTime) -> None:
    tracker = CostTracker(instance="a3-highgpu-1g")
    clock.advance(10.0)
    state = tracker.state_dict()
    clock.advance(5.0)
    tracker.load_state_dict(state)  # the same object resumes a checkpoint it saved itself
    assert tracker.billed_s() == 15.0
    assert tracker.restart_s_total == 0.0


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"instance": "a9-megagpu"}, ValueError, "CostTracker(instance='a9-megagpu'): unknown instance"),
        ({"market": "preemptible"}, ValueError, "CostTracker(market='preemptible')"),
        ({"price_on_demand": -3.0}, ValueError, "on_demand_usd_per_h=-3.0"),
        ({"price_spot": -1.5}, ValueError, "spot_usd_per_h=-1.5"),
        ({"instance": "p5.48xlarge", "market": "spot"}, ValueError, "lacks a spot price for instance 'p5.48xlarge'"),
        ({"instances": 0}, ValueError, "CostTracker(instances=0)"),
        ({"restart_s": -5.0}, ValueError, "CostTracker(restart_s=-5.0)"),
        ({"log_every_n_steps": 0}, ValueError, "CostTracker(log_every_n_steps=0)"),
        ({"catalog": "/nonexistent/prices.yaml"}, FileNotFoundError, "/nonexistent/prices.yaml"),
    ],
)
def test_bad_input_names_the_value(kwargs: dict[str, Any], error: type[Exception], named: str) -> None:
    with pytest.raises(error) as info:
        CostTracker(**kwargs)
    assert named in str(info.value)


class SlowLoadModel(TimedModel):
    """Each training batch takes 0.25 s to load, each validation batch 1 s to run (2 batches a validation)."""

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.clock.advance(1.0)

    def train_dataloader(self) -> DataLoader:
        def collate(items: list[Any]) -> list[torch.Tensor]:
            self.clock.advance(0.25)
            return [torch.stack([i[0] for i in items])]
        return DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4, collate_fn=collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)


class SlowSave(Callback):
    """Save after step ``at``; the save stalls the loop ``seconds`` of the fake clock."""

    def __init__(self, clock: FakeTime, path: Path, at: int, seconds: float) -> None:
        self.clock, self.path, self.at, self.seconds = clock, path, at, seconds

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            trainer.save_checkpoint(self.path)

    def on_save_checkpoint(self, *args: Any) -> None:
        self.clock.advance(self.seconds)


class CommTotals(Callback):
    """Stands in for StepTiming's run totals: exposed comm is 1 s of 9 s of compute (data wait apart)."""

    totals = {"data": 1.0, "forward": 4.0, "backward": 3.0, "comm_exposed": 1.0, "optimizer": 1.0}

    def mean_parts(self) -> dict[str, float]:
        return self.totals


def test_ledger_files_every_cause_by_hand(tmp_path: Path, clock: FakeTime) -> None:
    logger = RecordingLogger()
    tracker = CostTracker(instance="a3-highgpu-1g", log_every_n_steps=100, plot=False)
    clock.advance(3.0)
    trainer = Trainer(default_root_dir=tmp_path, max_steps=10, accelerator="cpu", devices=1, logger=logger,
                      callbacks=[tracker, SlowSave(clock, tmp_path / "s.ckpt", 4, 0.5), CommTotals()],
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=2, val_check_interval=5, num_sanity_val_steps=0)
    trainer.fit(SlowLoadModel(clock))
    final = logger.calls[-1][1]
    got = {k[len("goodput/"):-2]: v for k, v in final.items() if k.startswith("goodput/") and k.endswith("_s")}
    # 3 s before fit + 10 x 2 s steps + 10 x 0.25 s loads + 2 validations x 2 s + one 0.5 s save = 30 s
    assert final["cost/billed_s"] == 30.0
    assert got == pytest.approx({
        "startup": 3.25,           # 3 s, then the first batch's load
        "productive": 20 * 8 / 9,  # 10 steps x 2 s, less the exposed comm
        "comm_exposed": 20 / 9,    # 1 s of StepTiming's 9 s of compute
        "data_wait": 2.25,         # the other 9 loads
        "validation": 4.0, "checkpoint": 0.5, "redone": 0.0, "tail": 0.0, "restart": 0.0,
    })
    assert sum(got.values()) == pytest.approx(final["cost/billed_s"], rel=1e-12)


def test_spawn_to_clock_is_start_up(tmp_path: Path, clock: FakeTime, monkeypatch: pytest.MonkeyPatch) -> None:
    """The seconds from process spawn to the bill's clock: billed with ``bill_from="spawn"``, and on a relaunch
    moved out of the gap (which holds them either way) into start-up."""
    monkeypatch.setattr(cost, "launch_age_s", lambda: 5.0)  # 5 s of imports before the CLI built the tracker
    ckpt = tmp_path / "checkpoints" / "step=4.ckpt"
    spawned = CostTracker(instance="a3-highgpu-1g", bill_from="spawn", log_every_n_steps=100, plot=False)
    _trainer(tmp_path, [spawned, SaveThenDie(ckpt, save_at=4, die_at=6)], RecordingLogger()).fit(TimedModel(clock))
    assert spawned.billed_s() == 5 + 12.0  # 6 steps of 2 s, and the 5 s before construction
    assert spawned.ledger().seconds == {"startup": 5.0, "productive": 12.0, "data_wait": 0.0, "checkpoint": 0.0,
                                        "tail": 0.0}
    clock.advance(30.0)
    logger = RecordingLogger()
    relaunch = CostTracker(instance="a3-highgpu-1g", log_every_n_steps=100, plot=False)  # bill from construction
    _trainer(tmp_path, [relaunch], logger).fit(TimedModel(clock), ckpt_path=ckpt)
    final = logger.calls[-1][1]
    # saved at 5 + 8 = 13 s billed; gap 34 s = the first runs of steps 5-6 (4 s), the relaunch's 5 s of imports,
    # 25 s down; then steps 5-6 again (4 s redone) and 7-10 (8 s)
    assert final["cost/billed_s"] == 13 + 34 + 12
    assert (final["goodput/startup_s"], final["goodput/productive_s"], final["goodput/redone_s"],
            final["goodput/restart_s"]) == (10.0, 20.0, 4.0, 25.0)


def test_bad_bill_from_names_the_value() -> None:
    with pytest.raises(ValueError, match=r"CostTracker\(bill_from='boot'\)"):
        CostTracker(bill_from="boot")  # type: ignore[arg-type]


def test_goodput_plot_beside_the_run(tmp_path: Path, clock: FakeTime) -> None:
    tracker = CostTracker(instance="a3-highgpu-1g", log_every_n_steps=100)
    _trainer(tmp_path, [tracker], RecordingLogger(), max_steps=2).fit(TimedModel(clock))
    assert tracker.plot_path == tmp_path / "goodput.png"
    assert tracker.plot_path.read_bytes()[:4] == b"\x89PNG"
    assert tracker.summary_rows({})[-1] == ("goodput ledger", str(tmp_path / "goodput.png"))


class RunLogger(RecordingLogger):
    """A recording logger of one MLflow run (the tracker keys its first-launch record by the run id)."""

    def __init__(self, run_id: str) -> None:
        super().__init__()
        self.run_id = run_id


@pytest.mark.parametrize(("second_run", "billed", "lost"), [
    ("r1", 11.0 + 5.0 + 23.0, 4.0),  # the same MLflow run: the dead launch and the time down are billed
    ("r2", 23.0, 0.0),  # a corrected relaunch that opened another MLflow run starts its own bill
])
def test_a_launch_killed_before_any_checkpoint_is_billed_to_its_relaunch(tmp_path: Path, clock: FakeTime,
                                                                         second_run: str, billed: float,
                                                                         lost: float) -> None:
    first = CostTracker(instance="a3-highgpu-1g", market="spot", log_every_n_steps=5, plot=False)
    clock.advance(3.0)
    _trainer(tmp_path, [first], RunLogger("r1"), max_steps=4).fit(TimedModel(clock))  # 3 s + 4 x 2 s, no checkpoint
    clock.advance(5.0)  # killed; down 5 s; relaunched
    logger = RunLogger(second_run)
    second = CostTracker(instance="a3-highgpu-1g", market="spot", log_every_n_steps=5, plot=False)
    clock.advance(3.0)
    _trainer(tmp_path, [second], logger).fit(TimedModel(clock))
    final = logger.calls[-1][1]
    assert final["cost/billed_s"] == billed
    assert final["cost/lost_steps"] == lost and final["cost/restart_s"] == billed - 23.0
    assert final["cost/usd"] == pytest.approx(usd(billed), rel=1e-12)
    # the ledger still sums to the bill: the dead launch's steps are redone, the rest of the gap a restart
    assert final["goodput/redone_s"] == pytest.approx(lost * STEP_S)
    assert sum(v for k, v in final.items() if k.startswith("goodput/") and k.endswith("_s")) == pytest.approx(billed)


def test_a_relaunch_on_another_instance_prices_each_launch_at_its_own_rate(tmp_path: Path, clock: FakeTime) -> None:
    """A spot fallback: 8 s on an A100 (a2-highgpu-1g spot, $1.293/h) up to the checkpoint, then the relaunch on an H100
    (a3-highgpu-1g spot, $4.42/h): its gap and its own seconds at the H100's price, the A100's 8 s at the A100's."""
    ckpt = tmp_path / "resume.ckpt"
    first = CostTracker(instance="a2-highgpu-1g", market="spot", log_every_n_steps=5, plot=False)
    _trainer(tmp_path, [first, SaveThenDie(ckpt, save_at=4, die_at=6)], RecordingLogger()).fit(TimedModel(clock))
    clock.advance(30.0)  # down
    logger = RecordingLogger()
    second = CostTracker(instance="a3-highgpu-1g", market="spot", log_every_n_steps=5, plot=False)
    _trainer(tmp_path, [second], logger).fit(TimedModel(clock), ckpt_path=ckpt)
    final = logger.calls[-1][1]
    a100, h100 = 1.293, 4.42
    # saved at 8 s (4 steps x 2 s); the gap 4 s lost + 30 s down = 34 s; the relaunch 6 steps x 2 s = 12 s
    assert final["cost/billed_s"] == 8.0 + 34.0 + 12.0
    assert final["cost/usd"] == pytest.approx(8 / 3600 * a100 + 46 / 3600 * h100, rel=1e-12)  # not 54 s at $4.42
    assert final["cost/usd_on_demand"] == pytest.approx(8 / 3600 * 3.673 + 46 / 3600 * 11.06, rel=1e-12)
    assert second.segments() == [
        {"instance": "a2-highgpu-1g", "market": "spot", "instances": 1, "billed_s": 8.0,
         "usd": pytest.approx(8 / 3600 * a100)},
        {"instance": "a3-highgpu-1g", "market": "spot", "instances": 1, "billed_s": 46.0,
         "usd": pytest.approx(46 / 3600 * h100)}]
    assert final["cost/usd"] == pytest.approx(sum(s["usd"] for s in second.segments()), rel=1e-12)
    # the ledger's dollars add up to the bill across both prices
    assert sum(v for k, v in final.items() if k.startswith("goodput/") and k.endswith("_usd")) == \
        pytest.approx(final["cost/usd"], rel=1e-9)
    assert dict(second.summary_rows({}))["cost by launch"] == (
        "a2-highgpu-1g spot x1: 8.0 s, $0.0029; a3-highgpu-1g spot x1: 46.0 s, $0.0565")
