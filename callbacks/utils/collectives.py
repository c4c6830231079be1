"""Agreement across ranks in one small all-reduce: does any rank say yes, do all of them?

Outside a distributed run (one process, or the process group not started) a rank's own answer is
the answer. The flag travels as one float on the strategy's device (gloo: CPU, NCCL: the GPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_ranks", "any_rank"]


def _reduce(flag: bool, device: torch.device, op: dist.ReduceOp) -> bool:
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(tensor, op=op)
    return bool(tensor.item())


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if ``flag`` is true on any (an all-reduce of the maximum)."""
    return _reduce(flag, device, dist.ReduceOp.MAX)


def all_ranks(flag: bool, device: torch.device) -> bool:
    """True on every rank only if ``flag`` is true on all (an all-reduce of the minimum)."""
    return _reduce(flag, device, dist.ReduceOp.MIN)
