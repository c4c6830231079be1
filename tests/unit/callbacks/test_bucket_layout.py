"""callbacks.utils.comm_hooks.pin_bucket_layout: one gradient bucket layout for a DDP module's whole life.

3 real gloo processes (with 2, ``a + b == b + a`` and no layout can change a sum). A "relaunch" is a new DDP
wrapper around the same weights after some steps, as a resumed process builds one: without the pin, its first
step reduces in DDP's first-step layout where the uninterrupted module used its rebuilt one, and the reduced
gradients differ in their last bits; with it, every step's are bitwise those of the uninterrupted module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from callbacks.utils.comm_hooks import add_comm_hook_wrapper, pin_bucket_layout
from recipes.run.shutdown import destroy_process_group, exit_process
from tests.servers import free_port  # not tests.conftest: each spawned rank imports this module (and not mlflow)

WORLD = 3
STEPS = 3
RELAUNCH_AT = 1  # DDP rebuilt its buckets at this step's forward: the uninterrupted module uses them
VARIANTS = {"bucket_cap_mb": 0.01, "gradient_as_bucket_view": True}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 10))


def _train(rank: int, pin: bool, relaunch_at: int | None, **ddp_kwargs: object) -> dict:
    """Reduced gradients (bytes, hex) and bucket layouts (parameter names) of each step."""
    model = _model()
    names = {p: n for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + rank)
    grads, layouts = [], []

    def wrap() -> torch.nn.parallel.DistributedDataParallel:
        ddp = torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
        if pin:
            def seen(bucket: dist.GradBucket, inner: object) -> object:
                layouts[-1].append([names[p] for p in bucket.parameters()])
                return inner(bucket)
            add_comm_hook_wrapper(ddp, seen)  # pins the layout, as every CLI run's StepTiming does
        return ddp

    ddp = wrap()
    for step in range(STEPS):
        if step == relaunch_at:
            ddp = wrap()
        layouts.append([])
        optimizer.zero_grad()
        ddp(torch.randn(8, 16, generator=generator)).pow(2).mean().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().tobytes().hex())
        optimizer.step()
    return {"grads": grads, "layouts": layouts}


def _old_reducer_is_unhooked(rank: int) -> dict:
    """A hook on the reducer DDP built first (not through DDP's own list) never fires once the layout is pinned."""
    ddp = torch.nn.parallel.DistributedDataParallel(_model())
    calls: list[int] = []

    def counting(state: object, bucket: dist.GradBucket) -> torch.futures.Future:
        calls.append(bucket.index())
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    dist._register_comm_hook(ddp.reducer, None, counting)
    first_pin, second_pin = pin_bucket_layout(ddp), pin_bucket_layout(ddp)
    ddp(torch.randn(8, 16)).sum().backward()
    unused = torch.nn.parallel.DistributedDataParallel(_model(), find_unused_parameters=True)  # never rebuilt
    static = torch.nn.parallel.DistributedDataParallel(_model(), static_graph=True)  # left as DDP made it
    return {"old_calls": len(calls), "pin_returns": [first_pin, second_pin, pin_bucket_layout(unused),
                                                     pin_bucket_layout(static)]}


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        result = {
            "plain": _train(rank, pin=False, relaunch_at=None),
            "plain_relaunched": _train(rank, pin=False, relaunch_at=RELAUNCH_AT),
            "pinned": _train(rank, pin=True, relaunch_at=None),
            "pinned_relaunched": _train(rank, pin=True, relaunch_at=RELAUNCH_AT),
            # several buckets, the gradients views into them
            "variants": _train(rank, pin=True, relaunch_at=None, **VARIANTS),
            "variants_relaunched": _train(rank, pin=True, relaunch_at=RELAUNCH_AT, **VARIANTS),
            **_old_reducer_is_unhooked(rank),
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        destroy_process_group()
    exit_process(0)  # past a gloo group, the interpreter's teardown can abort the rank (recipes.run.shutdown)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_relaunched_ddp_reduces_every_step_as_the_uninterrupted_one(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    reversed_names = [n for n, _ in reversed(list(_model().named_parameters()))]
    for result in ranks:
        # DDP's own layouts: the relaunched module's first step reduces differently (the bug this pins away)
        plain, relaunched = result["plain"]["grads"], result["plain_relaunched"]["grads"]
        assert plain[:RELAUNCH_AT] == relaunched[:RELAUNCH_AT] and plain[RELAUNCH_AT] != relaunched[RELAUNCH_AT]
        for variant in ("pinned", "variants"):
            assert result[variant]["grads"] == result[f"{variant}_relaunched"]["grads"], variant
            layouts = result[variant]["layouts"] + result[f"{variant}_relaunched"]["layouts"]
            assert all(layout == layouts[0] for layout in layouts), variant  # one layout, every step
            assert [n for bucket in layouts[0] for n in bucket] == reversed_names  # last layers first
        assert len(result["variants"]["layouts"][0]) >= 2  # 23.6 kB of gradients in buckets of 10 kB
        assert result["old_calls"] == 0 and result["pin_returns"] == [True, True, True, False]
    assert all(r["pinned"]["grads"] == ranks[0]["pinned"]["grads"] for r in ranks)  # the same reduction everywhere
