"""callbacks.utils.comm_hooks: what is composed on a DDP module is kept beside it, not set on torch's object."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from callbacks.utils import comm_hooks


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_composed_hook_runs_each_wrapper_and_is_forgotten_with_its_module(one_rank: None) -> None:
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
    before = set(vars(ddp))
    assert comm_hooks.composed_hook(ddp) is None
    seen: list[str] = []

    def wrapper(name: str) -> Any:
        def wrap(bucket: Any, inner: Any) -> Any:
            seen.append(name)
            return inner(bucket)
        return wrap

    composed = comm_hooks.add_comm_hook_wrapper(ddp, wrapper("first"))
    assert comm_hooks.add_comm_hook_wrapper(ddp, wrapper("second")) is composed is comm_hooks.composed_hook(ddp)
    assert (len(composed.chain), composed.base_chosen, composed.compression, composed.timed) == (2, False, None, False)
    ddp(torch.ones(4, 3)).sum().backward()
    assert seen == ["second", "first"]  # the last added runs outermost, once per bucket (one bucket here)
    assert torch.equal(ddp.module.bias.grad, torch.tensor([4.0]))  # the mean all-reduce of one rank: unchanged
    # nothing of ours on torch's object beyond what its own register_comm_hook keeps
    assert not [name for name in set(vars(ddp)) - before if "atscale" in name]
    registered = len(comm_hooks._COMPOSED)
    del ddp
    gc.collect()
    assert len(comm_hooks._COMPOSED) == registered - 1
