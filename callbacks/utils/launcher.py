"""What a rank reports when it stops in order: its own code, but 0 in a rank Lightning's launcher started.

Lightning's own launcher (the ``python -m ...`` process, global rank 0, starts the other ranks of its node)
SIGKILLs every rank, itself included, as soon as a rank it started exits non-zero. A started rank that stops in
order (an interruption notice, a hang its watchdog ended, a lost peer, Ctrl-C) therefore exits 0 and leaves the
stop to the launching process, which reports it to whoever relaunches (75: relaunch, 130: Ctrl-C) and marks the
MLflow run: had the started rank exited 75 first, the launch's 75 would have become -9 and the run stayed
RUNNING. Under torchrun or SLURM no rank starts another and every rank reports its own code (their agents read
each one). A failure is never an orderly stop: a started rank that fails exits with its code, and Lightning's
launcher ends the others.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any


def reported_exit_code(code: int, started_by_lightning: bool, orderly: Collection[int]) -> int:
    """``code``, or 0 when it is an orderly stop (one of ``orderly``) of a rank Lightning's launcher started."""
    return 0 if started_by_lightning and code in orderly else code


def started_by_lightning(trainer: Any) -> bool:
    """Whether Lightning's launcher started this rank from another rank's process (not torchrun, not SLURM)."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    return trainer.local_rank > 0 and environment is not None and not environment.creates_processes_externally
