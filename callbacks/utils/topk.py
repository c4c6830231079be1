"""Top-k gradient sparsification with error feedback, as a DDP communication hook (gloo and NCCL).

Stich et al. 2018 ("Sparsified SGD with memory"); Lin et al. 2018 (Deep Gradient Compression). Each
rank adds its residual to the bucket's gradient, keeps the ``k = ceil(ratio x numel)`` entries of largest
magnitude of each parameter (layer-wise, as DGC does, so the selection does not depend on how DDP groups
parameters into buckets — it rebuilds them after the first step and again after a resume), sends their
values and indices, and keeps the rest as its new residual. The reduced gradient is the sum of every
rank's sparse part divided by the world size.

Values (fp32) and indices (int32, carried bit-for-bit in the same fp32 tensor) travel in one
``all_gather``, a collective gloo and NCCL both have; each rank puts ``8 k`` bytes on the wire per bucket
against ``4 x numel`` for a dense fp32 all-reduce, but an all-gather delivers every rank's part to every
rank, so its traffic grows with the world size where a ring all-reduce's does not
(:func:`callbacks.analysis.comm_model.topk_allgather_time`).

With ``ratio = 1`` every entry is sent and the result equals the dense mean all-reduce (bitwise on two
ranks: halving is exact, and the two halves are added in one order). The residuals are per parameter;
:meth:`TopKState.flat_residual` / :meth:`TopKState.load_flat_residual` carry them through a checkpoint.
torch only (imported when used); no Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

__all__ = ["TopKState", "make_meter", "topk_hook"]


class TopKState:
    """What the hook keeps between steps: the ratio, the group and each parameter's residual.

    Args:
        parameters: The module's parameters in a fixed order (``ddp.module.parameters()``): they name the
            residuals in a checkpoint.
        ratio: Fraction of each parameter's entries sent per step, in (0, 1].
        process_group: The DDP process group (None: the default group).

    Raises:
        ValueError: If ``ratio`` is not in (0, 1].
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter], ratio: float, process_group: Any = None) -> None:
        if isinstance(ratio, bool) or not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
            raise ValueError(f"top-k ratio {ratio!r} must be in (0, 1].")
        self.ratio = float(ratio)
        self.process_group = process_group
        self.params = list(parameters)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.residuals: dict[int, torch.Tensor] = {}
        self.sent_bytes = 0  # payload bytes this rank put on the wire, all buckets so far

    def k_of(self, numel: int) -> int:
        """Entries sent of a parameter with ``numel`` entries: ``ceil(ratio x numel)``, at least 1."""
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def bucket_bytes(self, bucket: dist.GradBucket) -> int:
        """Payload bytes one rank sends for ``bucket``: 4 per value + 4 per index."""
        return 8 * sum(self.k_of(p.numel()) for p in bucket.parameters())

    def flat_residual(self) -> torch.Tensor:
        """Every parameter's residual, in parameter order, as one fp32 vector (zeros where none yet)."""
        import torch

        parts = [self.residuals.get(i, torch.zeros(p.numel(), dtype=torch.float32, device=p.device)).reshape(-1)
                 for i, p in enumerate(self.params)]
        return torch.cat(parts) if parts else torch.zeros(0)

    def load_flat_residual(self, flat: torch.Tensor) -> None:
        """Restore residuals saved by :meth:`flat_residual` (on this rank)."""
        import torch

        total = sum(p.numel() for p in self.params)
        if flat.numel() != total:
            raise ValueError(f"top-k residual has {flat.numel()} entries; the model has {total} parameters' worth.")
        offset = 0
        for i, p in enumerate(self.params):
            self.residuals[i] = flat[offset:offset + p.numel()].to(device=p.device, dtype=torch.float32).clone()
            offset += p.numel()


def topk_hook(state, bucket):  # no annotations: DDP inspects the hook's signature for dist.GradBucket
    """DDP comm hook: layer-wise top-k of (gradient + residual), exchanged by one all_gather, averaged.

    ``state`` is a :class:`TopKState`, ``bucket`` a ``dist.GradBucket``; returns a future of the bucket's
    averaged tensor.

    Register with ``ddp.register_comm_hook(state, topk_hook)`` or as the base of
    :func:`callbacks.utils.comm_hooks.add_comm_hook_wrapper`.
    """
    import torch
    import torch.distributed as dist

    group = state.process_group
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    params = bucket.parameters()
    sizes = [p.numel() for p in params]
    if sum(sizes) != buffer.numel():
        raise RuntimeError(f"top-k hook: bucket {bucket.index()} holds {buffer.numel()} entries, its parameters "
                           f"{sum(sizes)}: an unexpected bucket layout.")
    values, indices = [], []
    offset = 0
    for p, n in zip(params, sizes, strict=True):
        key = state._index[id(p)]
        acc = buffer[offset:offset + n].float()
        residual = state.residuals.get(key)
        if residual is not None:
            acc = acc + residual
        k = state.k_of(n)
        if k == n:
            idx = torch.arange(n, device=acc.device)
            kept = acc
            new_residual = torch.zeros_like(acc)
        else:
            idx = torch.topk(acc.abs(), k, sorted=False).indices
            kept = acc[idx]
            new_residual = acc.clone()
            new_residual[idx] = 0
        state.residuals[key] = new_residual
        values.append(kept)
        indices.append(idx + offset)
        offset += n
    values_t = torch.cat(values).float()
    indices_t = torch.cat(indices).to(torch.int32)
    packed = torch.cat([values_t, indices_t.view(torch.float32)])  # one collective, indices bit-for-bit
    state.sent_bytes += packed.numel() * 4
    gathered = [torch.empty_like(packed) for _ in range(world)]
    work = dist.all_gather(gathered, packed, group=group, async_op=True)
    half = values_t.numel()

    def combine(fut: torch.futures.Future) -> torch.Tensor:
        out = torch.zeros(buffer.numel(), dtype=torch.float32, device=buffer.device)
        for part in gathered:  # rank order: the same sum on every rank
            out.index_add_(0, part[half:].view(torch.int32).long(), part[:half] / world)
        return out.to(buffer.dtype)

    return work.get_future().then(combine)


def make_meter(state: TopKState) -> Callable[[dist.GradBucket], Callable[[], int]]:
    """A :data:`callbacks.utils.comm_hooks.WireMeter`: 8 bytes per entry sent (value + index)."""

    def meter(bucket: dist.GradBucket) -> Callable[[], int]:
        sent = state.bucket_bytes(bucket)
        return lambda: sent

    return meter
