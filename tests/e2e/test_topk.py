"""Top-k sparsification with error feedback (callbacks/utils/topk.py, GradientCompression(method="topk")).

2 real gloo processes: ratio 1.0 reproduces the dense mean all-reduce bitwise; ratio 0.25 matches the
sum of every rank's hand-computed top-k part / world and keeps the rest as the residual; the CLI run
interrupted and resumed is bitwise identical to an uninterrupted one; bytes per step reach the summary.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from callbacks.compression import GradientCompression
from callbacks.utils.topk import TopKState, topk_hook
from recipes.run.shutdown import destroy_process_group, exit_process
from tests.conftest import free_port

pytestmark = pytest.mark.e2e


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _grads(rank: int, hook: str, ratio: float, steps: int) -> list[list[torch.Tensor]]:
    model = torch.nn.parallel.DistributedDataParallel(_model())
    if hook == "topk":
        state = TopKState(model.module.parameters(), ratio)
        model.register_comm_hook(state, topk_hook)
    out = []
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        model.zero_grad()
        model(torch.randn(4, 6, generator=gen)).pow(2).sum().backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


def _worker(rank: int, port: int, ratio: float, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        result = {"dense": _grads(rank, "dense", ratio, 3), "topk": _grads(rank, "topk", ratio, 3)}
        # what each rank sends without any hook: its local gradients, for the hand computation
        local = _model()
        gen = torch.Generator().manual_seed(100 + rank)
        result["local"] = []
        for _ in range(3):
            local.zero_grad()
            local(torch.randn(4, 6, generator=gen)).pow(2).sum().backward()
            result["local"].append([p.grad.clone() for p in local.parameters()])
        torch.save(result, f"{path}.{rank}")
    finally:
        destroy_process_group()
    exit_process(0)  # past a gloo group, the interpreter's teardown can abort the rank (recipes.run.shutdown)


def _run(tmp_path: Path, ratio: float) -> list[dict]:
    path = str(tmp_path / "grads")
    mp.start_processes(_worker, args=(free_port(), ratio, path), nprocs=2, start_method="spawn")
    return [torch.load(f"{path}.{r}") for r in range(2)]


def test_ratio_one_is_the_dense_allreduce_bitwise(tmp_path):
    for rank in _run(tmp_path, 1.0):
        for dense, topk in zip(rank["dense"], rank["topk"], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(dense, topk, strict=True))


def test_ratio_quarter_by_hand_with_error_feedback(tmp_path):
    """Step 1 only (no residual yet): mean over ranks of each rank's top-25% entries per parameter, the
    weights unchanged between steps (no optimizer), so later steps add the residuals by hand too."""
    ranks = _run(tmp_path, 0.25)
    residual = [[torch.zeros_like(g).reshape(-1) for g in ranks[r]["local"][0]] for r in range(2)]
    for step in range(3):
        expected = []
        for i, _ in enumerate(ranks[0]["local"][step]):
            total = torch.zeros_like(residual[0][i])
            for r in range(2):
                acc = ranks[r]["local"][step][i].reshape(-1) + residual[r][i]
                k = max(1, -(-acc.numel() // 4))
                idx = torch.topk(acc.abs(), k).indices
                part = torch.zeros_like(acc)
                part[idx] = acc[idx]
                residual[r][i] = acc - part
                total += part / 2
            expected.append(total.reshape(ranks[0]["local"][step][i].shape))
        for r in range(2):
            for got, want in zip(ranks[r]["topk"][step], expected, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_topk_ratio_is_checked():
    with pytest.raises(ValueError, match=r"topk_ratio=0"):
        GradientCompression("topk", topk_ratio=0)
    with pytest.raises(ValueError, match=r"top-k ratio 1.5"):
        TopKState([], 1.5)
    state = TopKState([torch.nn.Parameter(torch.zeros(1000))], 0.01)
    assert state.k_of(1000) == 10 and state.k_of(3) == 1 and state.flat_residual().shape == (1000,)


def test_resumed_topk_run_is_bitwise_identical_and_logs_bytes(tmp_path):
    """The CLI, 2 processes: a top-k run SIGTERMed mid-epoch (a drill) and relaunched ends with the same
    weights as an uninterrupted one — the residuals of both ranks travel in the checkpoint — and logs
    ``comm/bytes_per_step`` = 8 bytes x sum over parameters of ceil(1% of its entries)."""
    import math

    from callbacks.spot import REQUEUE_EXIT_CODE
    from recipes.classifier import ImageClassifier
    from tests.conftest import CONFIGS, FAST, assert_bitwise_equal, client_for, final_weights, run_fit, runs_of

    base = ("--config", str(CONFIGS / "digits.yaml"), "--config", str(CONFIGS / "strategy/ddp-topk.yaml"),
            "--trainer.max_epochs", "2", "--trainer.log_every_n_steps", "1", *FAST, "--log_model", "false")
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    ref.mkdir(), cut.mkdir()
    done = run_fit(ref, *base, "--run_name", "ref", check=True)
    assert "MB/step" in done.stdout
    first = run_fit(cut, *base, "--run_name", "cut", "--spot.drill_steps", "[30]")
    assert first.returncode == REQUEUE_EXIT_CODE, first.stderr[-3000:]
    run_fit(cut, *base, "--run_name", "cut", check=True)
    assert_bitwise_equal(final_weights(ref, "ref"), final_weights(cut, "cut"))
    model = ImageClassifier(num_classes=10, in_channels=1, width=32)
    expected = 8 * sum(math.ceil(0.01 * p.numel()) for p in model.parameters())
    (run,) = runs_of(ref, "digits")
    logged = {m.value for m in client_for(ref).get_metric_history(run.info.run_id, "comm/bytes_per_step")}
    assert logged == {float(expected)}
