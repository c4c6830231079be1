"""What a resume writes into the tracking run: the steps it redoes, and a change of world size.

Both read or write through the Lightning loggers' clients (MLflow's), and skip loggers without one. No
Lightning import.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ..analysis.keys import ELASTIC_TAG, TRAIN_LOSS_KEY

__all__ = ["ELASTIC_TAG", "lost_steps", "tag_elastic"]

log = logging.getLogger(__name__)

def _runs(loggers: Iterable[Any], needs: str) -> list[tuple[Any, str]]:
    out = []
    for logger in loggers:
        client, run_id = getattr(logger, "experiment", None), getattr(logger, "run_id", None)
        if run_id is not None and hasattr(client, needs):
            out.append((client, run_id))
    return out


def lost_steps(loggers: Iterable[Any], resumed_step: int, steps_run: int | None = None, saved_lost: int = 0) -> int:
    """Steps the attempts since the checkpoint resumed from ran beyond it (lost, redone now).

    The metric history alone is only as fine as the logging cadence: with ``log_every_n_steps=50`` an attempt
    killed at step 83 logged its loss last at step 50, and 33 lost steps read as 25 or fewer. CostTracker's
    steps file (``callbacks/utils/steps_file.py``) counts every step: pass its ``steps_run`` and the lost steps
    the resumed checkpoint already counted (CostTracker's ``lost_steps`` in that checkpoint) to get the exact
    figure, the increment of ``cost/lost_steps`` at this resume (the goodput ledger's count): summed over the
    resumes it is ``cost/lost_steps``.

    Args:
        loggers: the trainer's loggers (MLflow's are read).
        resumed_step: the global step of the checkpoint resumed from.
        steps_run: the steps file's count of every step run (redone ones included), if there is one.
        saved_lost: the lost steps counted up to that checkpoint.
    """
    furthest = resumed_step
    for client, run_id in _runs(loggers, "get_metric_history"):
        # the loss is logged every step; a metric logged after optimizer step k carries step k - 1 (from 0)
        steps = [m.step + 1 for m in client.get_metric_history(run_id, TRAIN_LOSS_KEY)]
        furthest = max([furthest, *steps])
    if steps_run is not None:
        furthest = max(furthest, steps_run - saved_lost)
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
