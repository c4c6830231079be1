"""Gradient noise scale: the estimators by hand, B_simple against an analytic value, the DDP hook's norms."""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from callbacks.analysis.gradient_noise import (
    NoiseScaleEMA,
    grad_sq_norm_estimate,
    suggest_batch_note,
    trace_sigma_estimate,
)
from callbacks.noise_scale import GradientNoiseScale
from callbacks.utils.comm_hooks import NoiseScaleCommHook, add_comm_hook_wrapper
from tests.conftest import RecordingLogger, free_port


def test_estimators_hand_computed():
    # B_small 8, B_big 32, g_s 3.0, g_b 1.5:
    # |G|^2 = (32*1.5 - 8*3)/(32 - 8) = 24/24 = 1; tr = (3 - 1.5)/(1/8 - 1/32) = 1.5/(3/32) = 16
    assert grad_sq_norm_estimate(3.0, 1.5, 8, 32) == 1.0
    assert trace_sigma_estimate(3.0, 1.5, 8, 32) == 16.0
    # expectations |G|^2 + tr/B recovered exactly: |G|^2 = 2, tr = 40 -> g_s = 2 + 40/4 = 12, g_b = 2 + 40/16 = 4.5
    assert grad_sq_norm_estimate(12.0, 4.5, 4, 16) == pytest.approx(2.0, abs=1e-12)
    assert trace_sigma_estimate(12.0, 4.5, 4, 16) == pytest.approx(40.0, abs=1e-12)
    with pytest.raises(ValueError, match=r"b_small=32, b_big=8"):
        grad_sq_norm_estimate(1.0, 1.0, 32, 8)


def test_ema_ratio_of_averages():
    ema = NoiseScaleEMA(beta=0.5)
    assert math.isnan(ema.b_simple)
    assert ema.update(3.0, 1.5, 8, 32) == 16.0  # first update initialises: 16 / 1
    # second: |G|^2 = 2, tr = 40 -> EMAs 0.5*1 + 0.5*2 = 1.5 and 0.5*16 + 0.5*40 = 28
    assert ema.update(12.0, 4.5, 4, 16) == pytest.approx(28.0 / 1.5, abs=1e-12)
    assert (ema.grad_sq_norm, ema.trace_sigma, ema.updates) == (1.5, 28.0, 2)
    # a negative |G|^2 EMA leaves B_simple undefined rather than negative
    neg = NoiseScaleEMA(beta=0.0)
    neg.update(1.0, 2.0, 8, 32)  # |G|^2 = (64 - 8)/24 > 0 ... tr = -1/(3/32) < 0
    neg.update(3.0, 0.0, 8, 32)  # |G|^2 = -24/24 = -1
    assert neg.grad_sq_norm == -1.0 and math.isnan(neg.b_simple)
    with pytest.raises(ValueError, match=r"beta=1.0"):
        NoiseScaleEMA(beta=1.0)


def test_suggest_batch_note():
    assert suggest_batch_note(400.0, 64) == (
        "suggests a batch of ~400 vs 64 used: a larger batch (more devices) would still cut steps almost linearly")
    assert suggest_batch_note(50.0, 64).startswith("suggests a batch of ~50 vs 64 used: the batch is near")
    assert "past the critical size" in suggest_batch_note(10.0, 64)
    assert suggest_batch_note(float("nan"), 64).startswith("not estimated (batch used 64)")


# ------------------------------------------------------------------ B_simple on a known problem

D, DELTA_SQ, NOISE_VAR = 10, 1.0, 1.0
# Linear regression, x ~ N(0, I_D), y = w*.x + e, e ~ N(0, s^2), loss 0.5 (w.x - y)^2, at w = w* + delta.
# Per-example gradient g = (delta.x - e) x: mean G = delta; by Isserlis E[g g^T] = (|d|^2 + s^2) I + 2 d d^T,
# so Sigma = (|d|^2 + s^2) I + d d^T, tr(Sigma) = D (|d|^2 + s^2) + |d|^2 = 21 and B_simple = 21 / |d|^2 = 21.
ANALYTIC_B_SIMPLE = (D * (DELTA_SQ + NOISE_VAR) + DELTA_SQ) / DELTA_SQ


class _Regression(pl.LightningModule):
    def __init__(self, w0: torch.Tensor) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(D, 1, bias=False)
        with torch.no_grad():
            self.lin.weight.copy_(w0[None])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return 0.5 * ((self.lin(x).squeeze(-1) - y) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the gradient distribution stays put


def _regression_data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=gen)
    w_star = torch.randn(D, generator=gen)
    y = x @ w_star + math.sqrt(NOISE_VAR) * torch.randn(n, generator=gen)
    delta = torch.zeros(D)
    delta[0] = math.sqrt(DELTA_SQ)
    return x, y, w_star + delta


def _hand_ema(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, micro: int, accumulate: int, steps: int,
              beta: float) -> tuple[float, float]:
    """EMA(|G|^2) and EMA(tr Sigma) of the regression's run, from its data alone (the loader is not shuffled)."""
    residual = x @ w - y
    per_example = x * residual[:, None]  # gradient of 0.5 (w.x - y)^2
    micro_grads = per_example.reshape(steps, accumulate, micro, -1).mean(dim=2)  # (steps, A, D)
    g_small = micro_grads.pow(2).sum(-1).mean(-1)  # mean over the A micro-batches of |g_micro|^2
    g_big = micro_grads.mean(dim=1).pow(2).sum(-1)  # |the accumulated (A x micro) gradient|^2
    b_small, b_big = micro, micro * accumulate
    ema_g = ema_t = None
    for gs, gb in zip(g_small.tolist(), g_big.tolist(), strict=True):
        g2 = (b_big * gb - b_small * gs) / (b_big - b_small)
        tr = (gs - gb) / (1 / b_small - 1 / b_big)
        ema_g = g2 if ema_g is None else beta * ema_g + (1 - beta) * g2
        ema_t = tr if ema_t is None else beta * ema_t + (1 - beta) * tr
    return ema_g, ema_t


@pytest.mark.e2e
def test_b_simple_matches_analytic_value_with_accumulation(tmp_path):
    micro, accumulate, steps = 8, 4, 300
    x, y, w0 = _regression_data(micro * accumulate * steps)
    callback, logger = GradientNoiseScale(beta=0.99, log_every_n_steps=100), RecordingLogger()
    trainer = pl.Trainer(max_epochs=1, accumulate_grad_batches=accumulate, callbacks=[callback], logger=logger,
                         enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    trainer.fit(_Regression(w0), DataLoader(TensorDataset(x, y), batch_size=micro))

    assert callback.mode == "accumulation"
    assert callback.ema.updates == steps
    assert (callback.batch_small, callback.batch_used) == (micro, micro * accumulate)
    logged = [(step, m) for step, m in logger.calls if "noise_scale/b_simple" in m]
    assert [step for step, _ in logged] == [100, 200, 300]  # every 100 steps; the last one at train end
    final = logged[-1][1]
    assert final["noise_scale/batch_used"] == 32.0 and final["noise_scale/batch_small"] == 8.0
    assert final["noise_scale/b_simple"] == pytest.approx(ANALYTIC_B_SIMPLE, rel=0.2)
    assert final["noise_scale/grad_sq_norm"] == pytest.approx(DELTA_SQ, rel=0.2)
    assert final["noise_scale/trace_sigma"] == pytest.approx(ANALYTIC_B_SIMPLE * DELTA_SQ, rel=0.2)
    # the same three values computed independently, in float64: each step's 4 micro-batch gradients at the
    # fixed weights, the two estimators and the ratio of EMAs written out (no callback code involved)
    grad_sq, trace = _hand_ema(x.double(), y.double(), w0.double(), micro, accumulate, steps, beta=0.99)
    assert final["noise_scale/grad_sq_norm"] == pytest.approx(grad_sq, rel=1e-5)
    assert final["noise_scale/trace_sigma"] == pytest.approx(trace, rel=1e-5)
    assert final["noise_scale/b_simple"] == pytest.approx(trace / grad_sq, rel=1e-5)
    (_, value), (_, note) = callback.summary_rows({})
    assert value == f"{callback.ema.b_simple:,.1f}"
    assert note.startswith(f"suggests a batch of ~{callback.ema.b_simple:,.0f} vs 32 used: the batch is near")
    # state for resume round-trips
    fresh = GradientNoiseScale()
    fresh.load_state_dict(callback.state_dict())
    assert fresh.ema.b_simple == callback.ema.b_simple and fresh.batch_used == 32


def test_one_process_without_accumulation_is_disabled_with_a_reason(tmp_path):
    x, y, w0 = _regression_data(64)
    callback, logger = GradientNoiseScale(), RecordingLogger()
    trainer = pl.Trainer(max_steps=2, callbacks=[callback], logger=logger, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(_Regression(w0), DataLoader(TensorDataset(x, y), batch_size=8))
    assert callback.mode is None and callback.ema.updates == 0
    assert not any("noise_scale/b_simple" in m for _, m in logger.calls)
    ((key, text),) = callback.summary_rows({})
    assert key == "noise_scale" and "accumulate_grad_batches >= 2" in text


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"beta=1.5"):
        GradientNoiseScale(beta=1.5)
    with pytest.raises(ValueError, match=r"log_every_n_steps=0"):
        GradientNoiseScale(log_every_n_steps=0)


# ------------------------------------------------------------------ the DDP hook, two processes


def _ddp_check(rank: int, port: int, out_dir: str) -> None:
    """One rank's part: run as its own small Python process (torch and the torch-free module only)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    data = [torch.randn(6, 5, generator=torch.Generator().manual_seed(10 + r)) for r in range(2)]

    def local_grads(r: int) -> list[torch.Tensor]:
        model.zero_grad()
        model(data[r]).pow(2).mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    expected_local = [sum(float(g.pow(2).sum()) for g in local_grads(r)) for r in range(2)]
    mean_grads = [(a + b) / 2 for a, b in zip(local_grads(0), local_grads(1), strict=True)]
    model.zero_grad()

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    hook, seen = NoiseScaleCommHook(), []

    def counting(bucket, inner):  # another callback's wrapper, composed on the same DDP hook
        seen.append(bucket.index())
        return inner(bucket)

    add_comm_hook_wrapper(ddp, hook)
    add_comm_hook_wrapper(ddp, counting)
    ddp(data[rank]).pow(2).mean().backward()
    local, reduced, buckets = hook.pop()
    grads_ok = all(torch.allclose(p.grad, g, atol=1e-7) for p, g in zip(ddp.parameters(), mean_grads, strict=True))

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    # a compressing base hook under the wrapper: the reduced norm is that of the fp16-rounded mean
    torch.manual_seed(0)
    compressed = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1)))
    fp16_hook = NoiseScaleCommHook()
    add_comm_hook_wrapper(compressed, fp16_hook, base=(fp16_compress_hook, None))
    compressed(data[rank]).pow(2).mean().backward()
    fp16_local, fp16_reduced, _ = fp16_hook.pop()
    fp16_expected = sum(float(g.half().float().pow(2).sum()) for g in mean_grads)
    try:
        add_comm_hook_wrapper(compressed, counting, base=(default_hooks.allreduce_hook, None))
        base_conflict = ""
    except RuntimeError as err:
        base_conflict = str(err)

    other = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
    other.register_comm_hook(None, fp16_compress_hook)
    try:
        add_comm_hook_wrapper(other, hook)
        conflict = ""
    except RuntimeError as err:
        conflict = str(err)
    result = {"local": local, "reduced": reduced, "buckets": buckets, "seen": seen, "grads_ok": grads_ok,
              "expected_local": expected_local[rank],
              "expected_reduced": sum(float(g.pow(2).sum()) for g in mean_grads), "conflict": conflict,
              "fp16_local": fp16_local, "fp16_reduced": fp16_reduced, "fp16_expected": fp16_expected,
              "base_conflict": base_conflict}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


_WORKER_HEADER = """
from __future__ import annotations
import json, multiprocessing, sys
from pathlib import Path
import torch
import torch._dynamo  # what DDP's constructor imports: once here, not in each rank
from callbacks.utils.comm_hooks import NoiseScaleCommHook, add_comm_hook_wrapper
"""
_WORKER_LAUNCH = """
ranks = [multiprocessing.get_context("fork").Process(target=_ddp_check, args=(r, int(sys.argv[1]), sys.argv[2]))
         for r in range(2)]
for p in ranks:
    p.start()
for p in ranks:
    p.join(120)
sys.exit(max(abs(p.exitcode if p.exitcode is not None else 1) for p in ranks))
"""


@pytest.mark.e2e
def test_ddp_comm_hook_sees_local_and_reduced_norms_two_processes(tmp_path):
    """Two gloo ranks, forked from one small interpreter that imported torch (and nothing of the tests)."""
    script = _WORKER_HEADER + textwrap.dedent(inspect.getsource(_ddp_check)) + _WORKER_LAUNCH
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script, str(free_port()), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in results:
        assert res["grads_ok"]  # the wrapped hook still averages the gradients
        assert res["buckets"] == 1 and res["seen"] == [0]
        assert res["local"] == pytest.approx(res["expected_local"], rel=1e-5)  # before the all-reduce: own batch
        assert res["reduced"] == pytest.approx(res["expected_reduced"], rel=1e-5)  # after: the global mean
        assert "already has the comm hook fp16_compress_hook" in res["conflict"]
        assert res["fp16_local"] == pytest.approx(res["expected_local"], rel=1e-5)
        assert res["fp16_reduced"] == pytest.approx(res["fp16_expected"], rel=1e-3)
        assert res["base_conflict"] == ("the DDP comm hook already communicates with fp16_compress_hook; "
                                        "allreduce_hook cannot be used as well.")
    assert results[0]["local"] != pytest.approx(results[1]["local"], rel=1e-3)  # the ranks' batches differ
    assert results[0]["reduced"] == pytest.approx(results[1]["reduced"], rel=1e-6)
