"""Start-up decided once per job (recipes/run/agree.py): rank 0 decides, the others receive it over a real TCPStore."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import TCPStore

from recipes.run.agree import DecisionFailed, agent_store_available, decided_once
from recipes.run.common import UsageError


@pytest.fixture
def agent_store() -> TCPStore:
    """What torchrun's agent hosts: a TCPStore server the workers reach as clients."""
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def client(server: TCPStore) -> TCPStore:
    return TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))


def ranks(server: TCPStore, decide: Any, world: int = 3, accept: Any = None, timeout_s: float = 30.0) -> list[Any]:
    """Every rank's outcome (the decision, or the exception it raised), ranks started before rank 0 decides."""
    out: list[Any] = [None] * world

    def rank(r: int) -> None:
        try:
            out[r] = decided_once(decide, r, accept=accept and (lambda d: accept(r, d)), store=client(server),
                                  world=world, timeout_s=timeout_s)
        except BaseException as err:  # the outcome under test
            out[r] = err
    threads = [threading.Thread(target=rank, args=(r,)) for r in reversed(range(world))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return out


def test_rank_zero_decides_once_and_every_rank_gets_its_decision(agent_store: TCPStore) -> None:
    calls = []

    def decide() -> dict[str, Any]:
        calls.append(threading.current_thread().name)
        return {"ckpt_path": "runs/d/r/checkpoints/step=00000040.ckpt", "mlflow_run_id": "abc", "note": None}

    out = ranks(agent_store, decide, world=4)
    assert len(calls) == 1
    assert out == [{"ckpt_path": "runs/d/r/checkpoints/step=00000040.ckpt", "mlflow_run_id": "abc", "note": None}] * 4


def test_a_refusal_on_rank_zero_ends_every_rank_with_its_message(agent_store: TCPStore) -> None:
    def decide() -> dict[str, Any]:
        raise UsageError("run digits/r was started with another config")

    out = ranks(agent_store, decide)
    assert isinstance(out[0], UsageError)  # rank 0 raises its own
    for received in out[1:]:
        assert isinstance(received, DecisionFailed)
        assert (received.kind, str(received)) == ("UsageError", "run digits/r was started with another config")


def test_a_rank_that_cannot_act_on_the_decision_ends_every_rank_at_start_up(agent_store: TCPStore,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2's machine lacks the checkpoint rank 0 chose: all three end now, none waits in the group's set-up."""
    def accept(rank: int, decision: dict[str, Any]) -> str:
        if rank == 2:
            raise UsageError(f"rank 2 cannot find {decision['ckpt_path']}")
        return f"{decision['ckpt_path']} on rank {rank}"

    out = ranks(agent_store, lambda: {"ckpt_path": "step=8.ckpt"}, accept=accept)
    assert isinstance(out[2], UsageError) and str(out[2]) == "rank 2 cannot find step=8.ckpt"
    for received in (out[0], out[1]):
        assert isinstance(received, DecisionFailed)
        assert (received.kind, str(received)) == ("UsageError", "rank 2: rank 2 cannot find step=8.ckpt")
    # torchrun restarts the workers on the same agent store: the next round's keys are its own
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    accepted = ranks(agent_store, lambda: {"ckpt_path": "step=9.ckpt"}, accept=lambda r, d: f"{d['ckpt_path']}@{r}")
    assert accepted == ["step=9.ckpt@0", "step=9.ckpt@1", "step=9.ckpt@2"]


def test_no_decision_is_one_error_after_the_timeout(agent_store: TCPStore) -> None:
    with pytest.raises(DecisionFailed, match="no word from the ranks at start-up within 1 s") as failed:
        decided_once(lambda: {}, 1, store=client(agent_store), world=2, timeout_s=1.0)
    assert failed.value.kind == "NoDecision"


def test_without_torchruns_store_each_process_decides_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert decided_once(lambda: {"x": 1}, 0) == {"x": 1}
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "h", "MASTER_PORT": "1", "WORLD_SIZE": "2"}
    assert agent_store_available(env)
    assert not agent_store_available({**env, "WORLD_SIZE": "1"})  # one process: nobody to tell
    assert not agent_store_available({**env, "TORCHELASTIC_USE_AGENT_STORE": "False"})
