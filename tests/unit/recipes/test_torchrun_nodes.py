"""Under torchrun's elastic mode the number of nodes is the rendezvous round's, not the command line's."""

from __future__ import annotations

import pytest

from recipes.run.context import torchrun_nodes

ELASTIC = {"TORCHELASTIC_RUN_ID": "job-7", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2"}


@pytest.mark.parametrize(("env", "nodes"), [
    (ELASTIC, 2),
    ({**ELASTIC, "WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1"}, 1),  # a node left: the next round has one
    ({k: v for k, v in ELASTIC.items() if k != "GROUP_WORLD_SIZE"}, 2),  # older torchrun: world / local world
    ({**ELASTIC, "TORCHELASTIC_RUN_ID": "none"}, None),  # torchrun's "no run id": not an elastic job
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}, None),  # not torchrun (SLURM, Lightning's own launcher)
    ({**ELASTIC, "WORLD_SIZE": "3", "GROUP_WORLD_SIZE": ""}, None),  # not a whole number of nodes: Lightning says
])
def test_nodes_of_the_round(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], nodes: int | None) -> None:
    for key in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        if value:
            monkeypatch.setenv(key, value)
    assert torchrun_nodes() == nodes


GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:43907: "
              "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
              "application. Check the logs of the remote worker before reporting an error. GLHF!")


@pytest.mark.parametrize(("error", "lost"), [
    (RuntimeError(GLOO_RESET), "Connection reset by peer at 127.0.0.1:43907"),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms "
                  "for recv operation to complete"), None),  # a slow peer is not a lost one
    (RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.2]:6001"),
     "Connection closed by peer at 10.0.0.2:6001"),
    (ValueError("Connection reset by peer"), None),  # not from a collective
    (RuntimeError("CUDA out of memory"), None),
])
def test_a_lost_peer_is_told_apart_from_other_failures(error: BaseException, lost: str | None) -> None:
    from recipes.run.errors import lost_peer

    assert lost_peer(error) == lost
    wrapped = RuntimeError("during the step")
    wrapped.__cause__ = error
    assert lost_peer(wrapped) == lost  # found through the causes, as Lightning re-raises
