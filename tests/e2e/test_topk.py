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


def _grads(rank: int, hook: str, ratio: float, steps: int) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Each step's gradients after DDP's reduction, and (top-k) each parameter's residual after the step."""
    model = torch.nn.parallel.DistributedDataParallel(_model())
    state = None
    if hook == "topk":
        state = TopKState(model.module.parameters(), ratio)
        model.register_comm_hook(state, topk_hook)
    grads, residuals = [], []
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        model.zero_grad()
        model(torch.randn(4, 6, generator=gen)).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if state is not None:
            residuals.append([state.residuals[i].clone() for i in range(len(state.params))])
    return grads, residuals


def _worker(rank: int, port: int, ratio: float, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        topk, residual = _grads(rank, "topk", ratio, 3)
        result = {"dense": _grads(rank, "dense", ratio, 3)[0], "topk": topk, "residual": residual}
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


def _by_hand(local: list[list[torch.Tensor]], feedback: bool) -> tuple[list[list[torch.Tensor]], list]:
    """Each step's reduced gradient at ratio 0.25, per parameter: the mean over the 2 ranks of each rank's
    ceil(numel / 4) entries of largest magnitude of (its gradient + its residual), and each rank's new residual
    (the rest). ``local[r][step]`` holds rank r's own gradients; ``feedback=False`` drops the residuals."""
    residual = [[torch.zeros_like(g).reshape(-1) for g in local[r][0]] for r in range(2)]
    reduced, residuals = [], []
    for step in range(len(local[0])):
        expected = []
        for i, grad in enumerate(local[0][step]):
            total = torch.zeros_like(residual[0][i])
            for r in range(2):
                acc = local[r][step][i].reshape(-1) + (residual[r][i] if feedback else 0)
                idx = torch.topk(acc.abs(), -(-acc.numel() // 4)).indices
                part = torch.zeros_like(acc)
                part[idx] = acc[idx]
                residual[r][i] = acc - part
                total += part / 2  # rank order, as the hook adds them: exact (halving is)
            expected.append(total.reshape(grad.shape))
        reduced.append(expected)
        residuals.append([[t.clone() for t in residual[r]] for r in range(2)])
    return reduced, residuals


def test_ratio_quarter_by_hand_with_error_feedback(tmp_path):
    """Three steps at ratio 0.25 on 2 ranks, the weights unchanged between them (no optimizer): each step's
    reduced gradient equals, bitwise, the mean over ranks of each rank's top 25% entries (per parameter) of its
    gradient plus its residual, and each rank keeps the rest as its residual. Step 1 has no residual yet; steps
    2 and 3 differ from what the same selection without the residuals gives, so error feedback is what they check."""
    ranks = _run(tmp_path, 0.25)
    local = [ranks[r]["local"] for r in range(2)]
    expected, residuals = _by_hand(local, feedback=True)
    for step in range(3):
        for r in range(2):
            for got, want in zip(ranks[r]["topk"][step], expected[step], strict=True):
                assert torch.equal(got, want), (step, r)
            for got, want in zip(ranks[r]["residual"][step], residuals[step][r], strict=True):
                assert torch.equal(got, want), (step, r)
    without, _ = _by_hand(local, feedback=False)
    assert all(torch.equal(a, b) for a, b in zip(without[0], expected[0], strict=True))  # no residual at step 1
    for step in (1, 2):
        assert not all(torch.equal(a, b) for a, b in zip(without[step], expected[step], strict=True)), step


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
