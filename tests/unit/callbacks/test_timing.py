"""StepTiming: exact breakdown under a patched clock, the formulas by hand, and DDP comm hooks on gloo."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset

from callbacks import timing
from callbacks.compression import GradientCompression
from callbacks.timing import (
    PARTS,
    StepTiming,
    _HostClock,
    _Step,
    amdahl_predictions,
    amdahl_serial_fraction,
    serial_fraction,
    union_length,
)
from recipes.run.shutdown import destroy_process_group, exit_process
from tests.conftest import RecordingLogger, free_port


# ----------------------------------------------------------------------------- helpers
class FakeClock:
    """``time.perf_counter`` stand-in that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ClockedData(Dataset):
    """Each sample costs ``per_sample`` seconds of the fake clock to load."""

    def __init__(self, clock: FakeClock | None, per_sample: float, n: int = 40) -> None:
        self.clock, self.per_sample, self.n = clock, per_sample, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.clock is not None:
            self.clock.advance(self.per_sample)
        return torch.full((4,), float(index % 5))


class ClockedModel(LightningModule):
    """Forward 20 ms, backward 30 ms, optimizer 5 ms, validation 100 ms per batch (fake clock)."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.clock.advance(0.020)
        return self.layer(batch).pow(2).mean()

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.clock.advance(0.030)
        loss.backward()

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        self.clock.advance(0.005)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.clock.advance(0.100)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(ClockedData(self.clock, 0.001), batch_size=2)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(ClockedData(None, 0.0), batch_size=2)


class ClockedIO(TorchCheckpointIO):
    """A checkpoint write that takes 0.5 s of the fake clock (and writes nothing)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.saved: list[str] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.clock.advance(0.5)
        self.saved.append(str(path))


class SaveAt(Callback):
    """Save a checkpoint at the end of one step (before StepTiming's hook when listed first)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(Path(trainer.default_root_dir) / "x.ckpt")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", fake)
    return fake


def _trainer(tmp_path: Path, clock: FakeClock, callbacks: list[Callback], **kwargs: Any) -> tuple[Trainer, Any]:
    logger = RecordingLogger()
    io = ClockedIO(clock)
    defaults: dict[str, Any] = dict(
        default_root_dir=tmp_path, accelerator="cpu", devices=1, max_steps=6, logger=logger,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        num_sanity_val_steps=0, limit_val_batches=2, val_check_interval=3, log_every_n_steps=3, plugins=[io])
    defaults.update(kwargs)
    return Trainer(callbacks=callbacks, **defaults), (logger, io)


# --------------------------------------------------------------------- single device
def test_exact_breakdown_with_patched_clock(tmp_path: Path, clock: FakeClock) -> None:
    timer = StepTiming(warmup_steps=0)
    trainer, (logger, io) = _trainer(tmp_path, clock, [SaveAt(4), timer])
    trainer.fit(ClockedModel(clock))

    # Every step: data 2 x 1 ms, forward 20 ms, backward 30 ms, optimizer 5 ms = 57 ms.
    expected = {"data": 0.002, "forward": 0.020, "backward": 0.030, "comm_exposed": 0.0, "optimizer": 0.005}
    assert timer.steps == 6 and timer.samples == 12
    for part, seconds in expected.items():
        assert timer.totals[part] == pytest.approx(6 * seconds, abs=1e-9), part
    # the 0.5 s save inside step 4 and the two 0.2 s validations between steps are cut out of the parts
    assert (timer.checkpoints, timer.validations) == (1, 2)
    assert timer.checkpoint_s == pytest.approx(0.5, abs=1e-9)
    assert timer.validation_s == pytest.approx(0.4, abs=1e-9)
    assert len(io.saved) == 1

    # logged windows of 3 steps at global steps 3 and 6, events at the step they happen
    assert [s for s, _ in logger.values("time/step_s")] == [3, 6]
    assert [v for _, v in logger.values("time/step_s")][:2] == pytest.approx([0.057, 0.057], abs=1e-9)
    assert logger.values("time/data_s")[0][1] == pytest.approx(0.002, abs=1e-9)
    assert logger.values("time/optimizer_s")[1][1] == pytest.approx(0.005, abs=1e-9)
    assert logger.values("time/samples_per_s")[0][1] == pytest.approx(2 / 0.057, rel=1e-9)
    assert logger.values("time/checkpoint_s") == [(4, pytest.approx(0.5, abs=1e-9))]
    assert logger.values("time/validation_s") == [(3, pytest.approx(0.2, abs=1e-9)),
                                                  (6, pytest.approx(0.2, abs=1e-9))]
    # window 1: s = (2 + 5) / 57; window 2 carries the 0.5 s save over its 3 steps
    s1, s2 = (v for _, v in logger.values("time/serial_share"))
    assert s1 == pytest.approx(0.007 / 0.057, rel=1e-9)
    assert s2 == pytest.approx((0.007 + 0.5 / 3) / (0.057 + 0.5 / 3), rel=1e-9)
    # the run's fraction, once at the end; one device: Amdahl's s is the serial share itself
    s_run = (0.007 + 0.5 / 6) / (0.057 + 0.5 / 6)
    assert logger.values("amdahl/serial_fraction") == [(6, pytest.approx(s_run, rel=1e-9))]
    # and under the world size it was measured at: a run resumed elsewhere keeps one record per world size
    assert logger.values("amdahl/serial_fraction/world_1") == logger.values("amdahl/serial_fraction")
    assert logger.values("amdahl/predicted_speedup_2") == [(6, pytest.approx(1 / (s_run + (1 - s_run) / 2),
                                                                              rel=1e-9))]
    mean = dict(logger.calls[-1][1])
    assert mean["time/mean/step_s"] == pytest.approx(0.057, abs=1e-9)
    assert mean["time/mean/backward_s"] == pytest.approx(0.030, abs=1e-9)
    assert mean["time/mean/checkpoint_per_step_s"] == pytest.approx(0.5 / 6, abs=1e-9)
    assert not any(k.startswith("comm/") for _, m in logger.calls for k in m)  # one device: no comm

    # the plot and the summary rows
    assert timer.plot_path == tmp_path / "time_breakdown.png"
    assert timer.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = dict(timer.summary_rows({}))
    assert rows["time/step"] == "57.00 ms mean over 6 steps, 35 samples/s"
    assert rows["  backward compute"] == "30.00 ms (52.6%)"
    assert rows["  exposed comm"] == "none (one process)"
    assert rows["  checkpoint"] == "1 x 0.500 s (loop stall; 83.33 ms per step)"
    assert rows["  validation"] == "2 x 0.200 s"
    # issue 47: the projection says it is one, and what it assumes
    assert rows["amdahl/serial_fraction"] == ("0.644 -> projected speedup x1.22 at N=2, x1.36 at N=4, x1.45 at N=8 "
                                              "(ceiling x1.6)")
    assert rows["  projection"].startswith("Amdahl's law from this one process's serial share (data wait, ")
    assert "not a measurement" in rows["  projection"] and "adds no communication" in rows["  projection"]


def test_warmup_steps_are_not_counted_and_state_round_trips(tmp_path: Path, clock: FakeClock) -> None:
    timer = StepTiming(warmup_steps=2, plot=False)
    trainer, (logger, _) = _trainer(tmp_path, clock, [timer], limit_val_batches=0)
    trainer.fit(ClockedModel(clock))
    assert timer.steps == 4
    assert timer.totals["forward"] == pytest.approx(0.080, abs=1e-9)
    # first window (steps 1-3) holds one counted step
    assert logger.values("time/step_s")[0] == (3, pytest.approx(0.057, abs=1e-9))

    state = timer.state_dict()
    assert set(state) == {"steps", "samples", "totals", "checkpoints", "checkpoint_s", "validations", "validation_s"}
    restored = StepTiming()
    restored.load_state_dict(state)
    assert restored.steps == 4 and restored.samples == 8
    assert restored.mean_parts()["optimizer"] == pytest.approx(0.005, abs=1e-9)
    assert restored.run_serial_fraction() == pytest.approx(0.007 / 0.057, rel=1e-9)


def test_gradient_accumulation_counts_optimizer_steps(tmp_path: Path, clock: FakeClock) -> None:
    timer = StepTiming(warmup_steps=0, plot=False)
    trainer, _ = _trainer(tmp_path, clock, [timer], limit_val_batches=0, accumulate_grad_batches=2, max_steps=3)
    trainer.fit(ClockedModel(clock))
    assert timer.steps == 3 and timer.samples == 12  # 2 batches of 2 per optimizer step
    assert timer.totals["forward"] == pytest.approx(3 * 0.040, abs=1e-9)
    assert timer.totals["data"] == pytest.approx(3 * 0.004, abs=1e-9)
    # optimizer.step runs once per 2 batches
    assert timer.totals["optimizer"] == pytest.approx(3 * 0.005, abs=1e-9)


# ------------------------------------------------------------------------ pure maths
def test_serial_fraction_by_hand() -> None:
    parts = {"data": 0.010, "forward": 0.030, "backward": 0.040, "comm_exposed": 0.015, "optimizer": 0.005}
    # (10 + 15 + 5) / 100 = 0.30; with a 1 s save every 100 steps: (30 + 10) / (100 + 10)
    assert serial_fraction(parts) == pytest.approx(0.30, abs=1e-12)
    assert serial_fraction(parts, checkpoint_per_step=0.010) == pytest.approx(0.040 / 0.110, abs=1e-12)
    assert serial_fraction({}) == 0.0
    with pytest.raises(ValueError, match="data=-1"):
        serial_fraction({"data": -1})
    # Amdahl's s is a fraction of one device's time: 0.3 s serial + 0.7 s parallel on 2 devices
    # would be 0.3 + 1.4 s on one -> s = 0.3 / 1.7, and then C(2) = 1.7 / 1.0 = 2 - 0.3
    assert amdahl_serial_fraction(0.30, 1) == 0.30
    assert amdahl_serial_fraction(0.30, 2) == pytest.approx(0.3 / 1.7, abs=1e-12)
    assert amdahl_predictions(0.3 / 1.7)["amdahl/predicted_speedup_2"] == pytest.approx(1.7, abs=1e-12)
    with pytest.raises(ValueError, match="world_size=0"):
        amdahl_serial_fraction(0.3, 0)
    predictions = amdahl_predictions(0.25)
    assert [round(predictions[f"amdahl/predicted_speedup_{n}"], 2) for n in (2, 4, 8, 16, 64)] == \
        [1.60, 2.29, 2.91, 3.37, 3.82]


def test_exposed_comm_and_union_by_hand() -> None:
    """Two buckets: called at 40 and 60 ms, done at 55 and 80 ms; backward ends at 85 ms."""
    timer = StepTiming()
    step = _Step(segments=[("data", 0.0, 0.010), ("forward", 0.010, 0.030), ("backward", 0.030, 0.085),
                           ("optimizer", 0.085, 0.090)],
                 comm=[[0.040, 0.055, 4000, 4000], [0.060, 0.080, 2000, 1000]], samples=8)
    timer._clock = _HostClock()
    out = timer._resolve(step, 0.0, events=[])
    # compute ends at the last hook call (60 ms); comm runs until 80 ms: 20 ms exposed
    assert out["comm_exposed"] == pytest.approx(0.020, abs=1e-12)
    assert out["backward"] == pytest.approx(0.055 - 0.020, abs=1e-12)
    assert out["comm"] == pytest.approx(0.015 + 0.020, abs=1e-12)  # union of [40, 55] and [60, 80]
    assert out["bytes"] == 5000 and out["hook_calls"] == 2
    assert sum(out[p] for p in PARTS) == pytest.approx(0.090, abs=1e-12)
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4  # [0, 3] and [5, 6]
    # an event (a 5 ms save) inside the optimizer segment is cut out of it
    cut = timer._resolve(step, 0.0, events=[(0.086, 0.091)])
    assert cut["optimizer"] == pytest.approx(0.001, abs=1e-12)


def test_bad_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"comm_hook='int8'"):
        StepTiming(comm_hook="int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"powersgd_start_iter=1\) must be an integer >= 2"):
        StepTiming(powersgd_start_iter=1)
    with pytest.raises(ValueError, match=r"log_every_n_steps=0"):
        StepTiming(log_every_n_steps=0)
    with pytest.raises(ValueError, match=r"GradientCompression\(method='int8'\) is not one of fp16, bf16, powersgd"):
        GradientCompression("int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"GradientCompression\(powersgd_rank=0\) must be an integer >= 1"):
        GradientCompression("powersgd", powersgd_rank=0)


# ------------------------------------------------------------------ DDP on gloo, 2 ranks
def _tiny_ddp_model() -> LightningModule:
    class Tiny(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(torch.randn(64, 16), batch_size=4)

    return Tiny()


class Buckets(Callback):
    """DDP's own count of the buckets it reduced in the last step."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.counts.append(trainer.strategy.model._get_ddp_logging_data()["num_buckets_reduced"])


def _ddp_worker(rank: int, port: int, out: str) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                       "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0"})
    torch.set_num_threads(1)
    results = {}
    # compression from its own callback (before or after the timer), and from the deprecated StepTiming option
    for hook, legacy in (("none", False), ("fp16", False), ("powersgd", False), ("bf16", True)):
        timer = StepTiming(warmup_steps=2, log_every_n_steps=3, plot=False,
                           **({"comm_hook": hook, "powersgd_start_iter": 2} if legacy else {}))
        compression = [] if legacy or hook == "none" else [GradientCompression(hook, powersgd_start_iter=2)]
        buckets = Buckets()
        callbacks = [timer, *compression] if hook == "fp16" else [*compression, timer]
        trainer = Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(bucket_cap_mb=0.1), max_steps=6,
                          logger=False, enable_progress_bar=False, enable_model_summary=False,
                          enable_checkpointing=False, callbacks=[*callbacks, buckets], default_root_dir=out)
        trainer.fit(_tiny_ddp_model())
        comm_row = dict(timer.summary_rows({}))["comm"]
        results[hook] = {"steps": timer.steps, "totals": timer.totals, "link": timer.link is not None,
                         "mode": timer.comm_mode, "buckets": buckets.counts, "row": comm_row}
    # StepTiming and GradientNoiseScale share DDP's single comm hook (callbacks.utils.comm_hooks)
    from callbacks.noise_scale import GradientNoiseScale

    timer = StepTiming(warmup_steps=2, log_every_n_steps=3, plot=False, calibrate_comm=False)
    noise = GradientNoiseScale(log_every_n_steps=1)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(bucket_cap_mb=0.1), max_steps=6,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, callbacks=[noise, timer, GradientCompression("fp16")],
                      default_root_dir=out)
    trainer.fit(_tiny_ddp_model())
    results["shared"] = {"timer_mode": timer.comm_mode, "noise_mode": noise.mode, "updates": noise.ema.updates,
                         "hook_calls": timer.totals["hook_calls"], "bytes": timer.totals["bytes"],
                         "steps": timer.steps}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    # as recipes.fit ends: past a gloo group, the interpreter's teardown can abort the rank (recipes.run.shutdown)
    destroy_process_group()
    exit_process(0)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_comm_hooks_fire_per_bucket_on_gloo(tmp_path: Path) -> None:
    mp.spawn(_ddp_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    params = 16 * 256 + 256 + 256 * 256 + 256 + 256 * 4 + 4  # 71,172
    # PowerSGD rank 1 sends (rows + cols) per weight matrix and every bias as is
    powersgd_elements = (256 + 16) + (256 + 256) + (4 + 256) + (256 + 256 + 4)  # 1,560
    for ranked in results:
        for hook, bytes_per_element in (("none", 4), ("fp16", 2), ("powersgd", None), ("bf16", 2)):
            res = ranked[hook]
            assert res["row"].startswith("all-reduce, " if hook == "none" else f"{hook} compression, ")
            totals, steps = res["totals"], res["steps"]
            assert (res["mode"], steps, res["link"]) == ("ddp", 4, True)
            buckets = res["buckets"][0]
            assert buckets >= 2  # bucket_cap_mb=0.1 splits the 285 kB of gradients
            assert totals["hook_calls"] == steps * buckets  # one call per bucket per step
            expected = params * bytes_per_element if bytes_per_element else powersgd_elements * 4
            assert totals["bytes"] == steps * expected
            step_s = sum(totals[p] for p in PARTS)
            assert all(totals[p] >= 0 for p in PARTS) and totals["comm"] > 0 and totals["comm_predicted"] > 0
            assert totals["comm_exposed"] <= totals["comm"] + 1e-9
            assert totals["comm"] <= step_s and totals["comm_exposed"] <= step_s
        shared = ranked["shared"]
        assert (shared["timer_mode"], shared["noise_mode"], shared["updates"]) == ("ddp", "ddp", 6)
        assert shared["bytes"] == shared["steps"] * params * 2  # still fp16-compressed under both wrappers
        assert shared["hook_calls"] == shared["steps"] * ranked["none"]["buckets"][0]


# ------------------------------------------------------------------ shipped strategy configs
@pytest.mark.e2e
@pytest.mark.parametrize(("config", "hook"), [("ddp-fp16-compress.yaml", "fp16"), ("ddp-bf16-compress.yaml", "bf16"),
                                              ("ddp-powersgd.yaml", "powersgd")])
def test_compression_configs_parse_to_one_compression_and_one_step_timing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      config: str, hook: str) -> None:
    from recipes.run.cli import AtscaleCLI

    repo = Path(__file__).resolve().parents[3]
    for key in ("ATSCALE_RUN_NAME", "ATSCALE_CKPT_PATH", "ATSCALE_MLFLOW_RUN_ID"):  # the CLI sets them
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    cli = AtscaleCLI(args=["--config", str(repo / "configs/digits.yaml"), "--config",
                           str(repo / "configs/strategy" / config), "--runs_root", str(tmp_path), "--run_name", "x",
                           "--trainer.logger", "false"])
    timers = [cb for cb in cli.trainer.callbacks if isinstance(cb, StepTiming)]
    compressions = [cb for cb in cli.trainer.callbacks if isinstance(cb, GradientCompression)]
    assert [t.comm_hook for t in timers] == ["none"]
    assert [c.method for c in compressions] == [hook]
    assert cli.trainer.world_size == 2 and type(cli.trainer.strategy).__name__ == "DDPStrategy"
    if hook == "powersgd":
        assert (compressions[0].powersgd_rank, compressions[0].powersgd_start_iter) == (1, 10)


def test_deferred_plot_is_drawn_after_fit_not_inside_it(tmp_path: Path) -> None:
    """The CLI sets ``defer_plot``: train end only remembers the trainer; ``write_deferred_plot`` draws and logs it."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    timer = StepTiming(warmup_steps=1, log_every_n_steps=2, calibrate_comm=False)
    timer.defer_plot = True
    trainer = Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      callbacks=[timer], default_root_dir=tmp_path)
    trainer.fit(BoringModel())
    assert timer.plot_path is None and not (tmp_path / "time_breakdown.png").exists()
    assert timer.write_deferred_plot() == tmp_path / "time_breakdown.png"
    assert timer.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert timer.write_deferred_plot() == timer.plot_path  # once only
    assert dict(timer.summary_rows({}))["time breakdown"] == str(tmp_path / "time_breakdown.png")
