"""The decisions a step boundary takes that change control flow, agreed by every rank in one collective.

A decision one rank takes alone is a hang at scale: ranks see different clocks, different notices (a cloud's
metadata notice reaches one node), different loads; a rank that decides to save enters the save's
collectives while the others enter the next step's, and both wait until the process group's timeout. So
every such decision is voted at the step boundary in a single ``all_reduce(MAX)`` of a few integers, and
every rank acts on the same outcome:

=====================  ===========================  ================================================
vote                   who decides                  why
=====================  ===========================  ================================================
``notice``             any rank                     a notice may reach one node only
``save_due``           global rank 0 alone          a clock-based save (``every_minutes``, ``auto``):
                                                    rank 0's clock, as Lightning's ModelCheckpoint
                                                    broadcasts its ``train_time_interval`` decision
``validation_follows`` every rank                   Lightning's own schedule, the same everywhere;
                                                    agreed anyway, at no extra cost
=====================  ===========================  ================================================

"All ranks" is a MAX over the negated vote. With one process no collective runs. ``torch.distributed``'s
``all_reduce`` is called directly: Lightning's ``strategy.reduce`` runs a barrier before it, a second
collective per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Agreed", "agree", "distributed_world"]


@dataclass(frozen=True)
class Agreed:
    """The outcome every rank acts on."""

    notice: bool
    save_due: bool
    validation_follows: bool


def agree(*, notice: bool, save_due: bool, validation_follows: bool, rank: int, device: torch.device,
          distributed: bool) -> Agreed:
    """Vote this rank's view of the step; return what all ranks decided (see the module docstring).

    Args:
        notice: this rank holds an interruption notice.
        save_due: this rank's clock says a timed save is due (counted on global rank 0 only).
        validation_follows: this rank's schedule validates after this batch.
        rank: this process's global rank.
        device: where the collective's tensor lives (the strategy's root device: NCCL needs CUDA tensors).
        distributed: whether a process group of several ranks exists.
    """
    if not distributed:
        return Agreed(notice, save_due, validation_follows)
    votes = torch.tensor([int(notice), int(save_due and rank == 0), int(not validation_follows)],
                         dtype=torch.int32, device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX)
    any_notice, rank0_save, any_not_validating = (bool(v) for v in votes.tolist())
    return Agreed(any_notice, rank0_save, not any_not_validating)


def distributed_world() -> bool:
    """Whether this process belongs to a process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
