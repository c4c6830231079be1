"""LR scaling: the multiplier by hand, the rate the optimizer used at each step, logged, for 1 and 2 processes."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import mlflow
import pytest
import torch
from lightning.pytorch.loggers import MLFlowLogger
from torch.utils.data import DataLoader, TensorDataset

from callbacks.lr_scaling import LRScaling, batch_scale, lr_multiplier
from tests.conftest import CONFIGS, FAST, cli_env, client_for, run_fit, runs_of, seed_mlflow_db


def test_multiplier_and_scale_by_hand():
    assert batch_scale("linear", 256, 32) == 8.0
    assert batch_scale("sqrt", 128, 32) == 2.0
    assert batch_scale("none", 256, 32) == 1.0
    # warmup over 4 steps from 1x to 2x, then constant
    assert [lr_multiplier(s, 2.0, 4) for s in range(6)] == [1.0, 1.25, 1.5, 1.75, 2.0, 2.0]
    # inverse sqrt without warmup: a_t = a_0 / sqrt(t), t = step + 1
    assert [lr_multiplier(s, 1.0, 0, "inverse_sqrt") for s in (0, 3, 8, 99)] == [1.0, 0.5, 1 / 3, 0.1]
    # after a 3-step warmup to 4x: 4 sqrt(4 / (s + 1)) -> 4 at s = 3, 2 at s = 15
    assert lr_multiplier(3, 4.0, 3, "inverse_sqrt") == 4.0
    assert lr_multiplier(15, 4.0, 3, "inverse_sqrt") == 2.0
    assert lr_multiplier(1, 4.0, 3, "inverse_sqrt") == pytest.approx(2.0, abs=1e-15)  # 1 + 3 * 1/3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "cubic"}, r"mode='cubic'"),
        ({"schedule": "cosine"}, r"schedule='cosine'"),
        ({"base_batch_size": 0}, r"base_batch_size=0"),
        ({"warmup_steps": -1}, r"warmup_steps=-1"),
        ({"batch_size": 0}, r"batch_size=0"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LRScaling(**kwargs)


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return ((self.lin(x).squeeze(-1) - y) ** 2).mean()

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        # the scheduled rate halves after 3 optimizer steps; LRScaling multiplies whatever is scheduled
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _Recorder(pl.Callback):
    """The rate in effect when the optimizer steps, and the rate left in the optimizer after it."""

    def __init__(self) -> None:
        self.used: list[float] = []
        self.after: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.used.append(optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not trainer.fit_loop._should_accumulate():
            self.after.append(trainer.optimizers[0].param_groups[0]["lr"])


def _history(client: mlflow.MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_one_process_lr_used_and_logged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seed_mlflow_db(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    x = torch.randn(96, 4, generator=torch.Generator().manual_seed(0))
    y = x.sum(1)
    # micro-batch 8 x 2 accumulated x 1 device = global batch 16 = 2 x base 8 -> linear scale 2
    scaling, recorder = LRScaling(mode="linear", base_batch_size=8, warmup_steps=4), _Recorder()
    logger = MLFlowLogger(experiment_name="lr", tracking_uri=uri)
    trainer = pl.Trainer(max_steps=6, accumulate_grad_batches=2, callbacks=[scaling, recorder], logger=logger,
                         enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(_Tiny(), DataLoader(TensorDataset(x, y), batch_size=8))

    # scheduled 0.1, 0.1, 0.1, 0.05, 0.05, 0.05 times the warmup 1, 1.25, 1.5, 1.75, 2, 2
    expected = [0.1, 0.125, 0.15, 0.0875, 0.1, 0.1]
    assert recorder.used == pytest.approx(expected, abs=1e-15)
    assert recorder.after == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.05, 0.025], abs=1e-15)  # the scheduler's own
    assert (scaling.global_batch, scaling.scale) == (16, 2.0)
    client = mlflow.MlflowClient(uri)
    actual = _history(client, logger.run_id, "lr/actual")
    assert [s for s, _ in actual] == [0, 1, 2, 3, 4, 5]
    assert [v for _, v in actual] == pytest.approx(expected, abs=1e-15)
    assert _history(client, logger.run_id, "lr/scale") == [(0, 2.0)]
    assert _history(client, logger.run_id, "lr/batch") == [(0, 16.0)]


@pytest.mark.e2e
@pytest.mark.slow(covered_by="tests/unit/callbacks/test_lr_scaling.py::test_one_process_lr_used_and_logged")
def test_two_processes_ddp_cli_lr_used_is_logged(tmp_path):
    """2 processes (gloo) through the real CLI: per-rank batch 32 x 2 = 64 = 2 x base 32 -> scale 2.

    The noise-scale callback rides along: its DDP hook and the per-rank / global batch it reports.
    """
    seed_mlflow_db(tmp_path)
    run_fit(
        tmp_path,
        "--config", str(CONFIGS / "digits.yaml"), "--config", str(CONFIGS / "strategy/ddp.yaml"),
        "--experiment", "lr", "--run_name", "ddp", "--trainer.max_epochs", "1",
        "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "0", *FAST, "--log_model", "false",
        "--trainer.callbacks+=callbacks.lr_scaling.LRScaling", "--trainer.callbacks.mode=linear",
        "--trainer.callbacks.base_batch_size=32", "--trainer.callbacks.warmup_steps=2",
        "--trainer.callbacks+=callbacks.noise_scale.GradientNoiseScale",
        "--trainer.callbacks.log_every_n_steps=1",
        check=True, env=cli_env(tmp_path),
    )  # fmt: skip
    client = client_for(tmp_path)
    (run,) = runs_of(tmp_path, "lr")
    assert run.data.params["trainer.devices"] == "2"
    # digits.yaml: AdamW lr 0.003 (the epoch-stepped cosine is still at its start); warmup 2 steps to 2x
    actual = _history(client, run.info.run_id, "lr/actual")
    assert [s for s, _ in actual] == [0, 1, 2]
    assert [v for _, v in actual] == pytest.approx([0.003, 0.0045, 0.006], abs=1e-15)
    assert _history(client, run.info.run_id, "lr/scale") == [(0, 2.0)]
    assert _history(client, run.info.run_id, "lr/batch") == [(0, 64.0)]

    metrics = run.data.metrics
    assert metrics["noise_scale/batch_small"] == 32.0  # one rank's batch
    assert metrics["noise_scale/batch_used"] == 64.0  # the all-reduced global batch
    assert [s for s, _ in _history(client, run.info.run_id, "noise_scale/trace_sigma")] == [1, 2, 3]
    # B_simple is logged exactly when it is defined (EMA(|G|^2) > 0); its value against one computed independently
    # is tests/unit/callbacks/test_noise_scale.py's (accumulation) and its DDP hook's norms are checked there too
    assert ("noise_scale/b_simple" in metrics) == (metrics["noise_scale/grad_sq_norm"] > 0)


# ------------------------------------------------------------------ checkpoint and resume
# The one-process run above: warmup 1 -> 2x over 4 steps times StepLR's 0.1 (halved every 3 steps).
SCALED = [0.1, 0.125, 0.15, 0.0875, 0.1, 0.1]


class _SaveMidWindow(pl.Callback):
    """Saves a checkpoint after the first micro-batch of step 1's accumulation window (the scaled rate in force)."""

    def __init__(self, path) -> None:
        self.path = path
        self.lr_in_force: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 2:
            self.lr_in_force = trainer.optimizers[0].param_groups[0]["lr"]
            trainer.save_checkpoint(self.path)


def _lr_fit(root, max_steps: int, *callbacks: pl.Callback, ckpt_path=None) -> tuple[_Recorder, pl.Trainer]:
    x = torch.randn(96, 4, generator=torch.Generator().manual_seed(0))
    recorder = _Recorder()
    trainer = pl.Trainer(max_steps=max_steps, accumulate_grad_batches=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
                         callbacks=[LRScaling(mode="linear", base_batch_size=8, warmup_steps=4), recorder, *callbacks])
    trainer.fit(_Tiny(), DataLoader(TensorDataset(x, x.sum(1)), batch_size=8), ckpt_path=ckpt_path)
    return recorder, trainer


def test_a_checkpoint_holds_the_scheduled_rate_and_a_resumed_run_continues_the_schedule(tmp_path):
    mid = _SaveMidWindow(tmp_path / "mid.ckpt")
    first, trainer = _lr_fit(tmp_path, 3, mid)
    trainer.save_checkpoint(tmp_path / "step3.ckpt")
    assert first.used == pytest.approx(SCALED[:3], abs=1e-15)
    # saved mid-window while 0.125 (1.25 x 0.1) was in force: the checkpoint holds the scheduler's 0.1, so a resumed
    # run scales it once, not twice
    assert mid.lr_in_force == pytest.approx(0.125, abs=1e-15)
    saved = torch.load(tmp_path / "mid.ckpt", weights_only=True)
    assert saved["global_step"] == 1 and saved["optimizer_states"][0]["param_groups"][0]["lr"] == 0.1
    at_three = torch.load(tmp_path / "step3.ckpt", weights_only=True)
    assert at_three["global_step"] == 3 and at_three["optimizer_states"][0]["param_groups"][0]["lr"] == 0.05

    resumed, trainer = _lr_fit(tmp_path, 6, ckpt_path=tmp_path / "step3.ckpt")
    assert trainer.global_step == 6
    assert first.used + resumed.used == pytest.approx(SCALED, abs=1e-15)  # as the uninterrupted run's
    assert resumed.after == pytest.approx([0.05, 0.05, 0.025], abs=1e-15)  # the scheduler's own, unscaled
