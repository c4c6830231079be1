"""One decision for the whole job at start-up: global rank 0 decides, every other rank receives it.

A run's start-up decisions (its name, the checkpoint it resumes from, its MLflow run, a refusal) read files, a
bucket and the tracking store, which ranks on different machines, or a moment apart, may see differently: two
ranks resuming from different checkpoints train apart without an error. Where the launcher gives the ranks
no shared store (a single process; Lightning's own launcher, whose further ranks re-run the command after the
first decided and read the decision from its environment) the process decides alone. Under torchrun every
rank starts the command; rank 0 decides and publishes the outcome in torchrun's own key-value store (the
agent's ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``, which each worker reaches as a client before any process
group exists), and the others wait for it; then every rank says whether it can act on it (its machine has the
checkpoint) and waits for the others' word. A refusal or failure anywhere is published too, so every rank ends
the same way at start-up instead of waiting, inside the process group's set-up, for a rank that is gone.

Written here because neither torch nor Lightning shares a value from rank 0 before the process group exists;
``torch.distributed.TCPStore`` (public) carries it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

__all__ = ["DECISION_TIMEOUT_S", "DecisionFailed", "agent_store_available", "decided_once"]

#: How long a rank waits for rank 0's decision: rank 0 may migrate a tracking store or fetch from a bucket first.
DECISION_TIMEOUT_S = 600.0
_KEY = "atscale/run-decision/{restart}"
T = TypeVar("T")


class DecisionFailed(Exception):
    """Rank 0's decision ended in an exception: ``kind`` is its class name, ``message`` its text."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def agent_store_available(env: dict[str, str] | None = None) -> bool:
    """Whether torchrun started this process with its agent's store at ``MASTER_ADDR:MASTER_PORT`` to share."""
    env = dict(os.environ) if env is None else env
    return (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_ADDR" in env and "MASTER_PORT" in env
            and int(env.get("WORLD_SIZE", "1")) > 1)


def _agent_store(timeout_s: float) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def decided_once(decide: Callable[[], dict[str, Any]], rank: int, accept: Callable[[dict[str, Any]], T] | None = None,
                 store: Any = None, world: int | None = None, timeout_s: float = DECISION_TIMEOUT_S) -> T:
    """``decide()`` on rank 0, then ``accept(decision)`` on every rank, and every rank's verdict on every rank.

    Args:
        decide: what rank 0 runs; returns a JSON-serialisable dict.
        rank: this process's global rank.
        accept: what each rank makes of the decision on its own machine (e.g. find the checkpoint there); its
            return value is this function's. A rank whose ``accept`` raises ends every rank.
        store: a ``torch.distributed.Store`` the ranks share; None: torchrun's agent store when there is one,
            else this process decides and accepts alone.
        world: the number of ranks (default ``WORLD_SIZE``).

    Raises:
        DecisionFailed: on every other rank, when rank 0's ``decide`` or any rank's ``accept`` raised (that rank
            re-raises its own), or no verdict came within ``timeout_s``.
    """
    accept = accept or (lambda decision: decision)  # type: ignore[assignment,return-value]
    if store is None:
        if not agent_store_available():
            return accept(decide())
        store = _agent_store(timeout_s)
    world = world if world is not None else int(os.environ["WORLD_SIZE"])
    prefix = _KEY.format(restart=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == 0:
        try:
            decision = decide()
        except BaseException as err:
            store.set(prefix, json.dumps({"failed": type(err).__name__, "message": str(err)}))
            raise
        store.set(prefix, json.dumps({"decision": decision}))
    else:
        published = json.loads(_get(store, prefix, timeout_s))
        if "failed" in published:
            raise DecisionFailed(published["failed"], published["message"])
        decision = published["decision"]
    try:
        accepted = accept(decision)
    except BaseException as err:
        store.set(f"{prefix}/rank{rank}", json.dumps({"failed": type(err).__name__, "message": str(err)}))
        raise
    store.set(f"{prefix}/rank{rank}", json.dumps({}))
    for other in range(world):
        verdict = json.loads(_get(store, f"{prefix}/rank{other}", timeout_s))
        if "failed" in verdict:
            raise DecisionFailed(verdict["failed"], f"rank {other}: {verdict['message']}")
    return accepted


def _get(store: Any, key: str, timeout_s: float) -> bytes:
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except RuntimeError as err:  # torch's DistStoreError (a RuntimeError): the wait timed out, or the store is gone
        raise DecisionFailed("NoDecision", f"no word from the ranks at start-up within {timeout_s:.0f} s "
                             f"({key}: {err})") from err
    return store.get(key)
