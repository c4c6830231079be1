"""What a resume writes into the tracking run: the steps it redoes, and a change of world size.

Both read or write through the Lightning loggers' clients (MLflow's), and skip loggers without one. No
Lightning import.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

__all__ = ["ELASTIC_TAG", "LOSS_KEY", "lost_steps", "tag_elastic"]

log = logging.getLogger(__name__)

#: MLflow tag of a run resumed on another world size: ``"2->1@12"`` (saved ranks -> ranks, at step), ``; ``-joined.
ELASTIC_TAG = "atscale.elastic"
#: The metric every step logs: its history says how far the interrupted attempt got.
LOSS_KEY = "train/loss"


def _runs(loggers: Iterable[Any], needs: str) -> list[tuple[Any, str]]:
    out = []
    for logger in loggers:
        client, run_id = getattr(logger, "experiment", None), getattr(logger, "run_id", None)
        if run_id is not None and hasattr(client, needs):
            out.append((client, run_id))
    return out


def lost_steps(loggers: Iterable[Any], resumed_step: int) -> int:
    """Steps the previous attempt logged beyond the checkpoint resumed from (redone now)."""
    furthest = resumed_step
    for client, run_id in _runs(loggers, "get_metric_history"):
        # a metric logged after optimizer step k carries step k - 1 (Lightning counts from 0)
        steps = [m.step + 1 for m in client.get_metric_history(run_id, LOSS_KEY)]
        furthest = max([furthest, *steps])
    return furthest - resumed_step


def tag_elastic(loggers: Iterable[Any], saved_world: int, world: int, step: int) -> None:
    """Say (rank zero) that the run came back on another world size, and add it to the ``atscale.elastic`` tag."""
    log.warning("Resumed on %d rank(s) from a checkpoint of %d (step %d): the epoch goes on from its global "
                "sample cursor; rank r continues rank r mod %d's RNG streams; not bitwise equal to an "
                "uninterrupted run (gradients are reduced over another world).", world, saved_world, step,
                saved_world)
    for client, run_id in _runs(loggers, "set_tag"):
        before = client.get_run(run_id).data.tags.get(ELASTIC_TAG)
        client.set_tag(run_id, ELASTIC_TAG, "; ".join(filter(None, [before, f"{saved_world}->{world}@{step}"])))
