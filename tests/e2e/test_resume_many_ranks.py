"""Exact resume at 3 and 4 DDP ranks: interrupted, relaunched, bitwise equal to an uninterrupted run.

With two ranks an all-reduce sums ``a + b``, which is the same whatever the order; from three on, the
summation order of each gradient element depends on where it sits in DDP's flat bucket, and DDP lays its
buckets out in one order for a process's first step and in another after it (``callbacks/utils/comm_hooks.py``,
``pin_bucket_layout``). A relaunched process must reduce its first step the way the uninterrupted run reduced
that step. Every tensor of the final checkpoint counts: the model, the optimizer's state, the LR scheduler's.

The CLI as a user runs it, on the digits recipe: Lightning's own launcher with ``--oversubscribe true`` (3 and
4 processes on this 2-core machine), and torchrun with two agents of two processes stopped by a SIGTERM to both
agents. One uninterrupted run per world size serves every test of this module. Each launch of 3 or 4 processes
costs about 20-35 s here (the ranks' interpreters start on 2 cores), so each test keeps to 2 or 3 launches.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from callbacks.spot import CHECKPOINT_PATTERN, REQUEUE_EXIT_CODE
from callbacks.storage import ckpt_store
from tests.conftest import CONFIGS, FAST, cli_env, free_port, run_fit

pytestmark = pytest.mark.timeout(600, func_only=True)

EPOCHS = 2
DIGITS = ("--config", str(CONFIGS / "digits.yaml"), "--config", str(CONFIGS / "strategy/ddp.yaml"),
          "--trainer.max_epochs", str(EPOCHS), *FAST, "--log_model", "false", "--system_metrics", "false")
#: digits' 1,437 training images in batches of 32 a rank: ceil(1437 / 96) and ceil(1437 / 128) steps an epoch
STEPS_PER_EPOCH = {3: 15, 4: 12}
SIGNAL_STEP = 7  # torchrun's agents are stopped after this step (mid-epoch 0)
RUN_TIMEOUT_S = 400


def launcher(world: int) -> tuple[str, ...]:
    """Lightning's own launcher with ``world`` processes on this machine's 2 cores."""
    return (*DIGITS, "--trainer.devices", str(world), "--oversubscribe", "true")


def relaunch_until_done(workdir: Path, *args: str, env: dict[str, str] | None = None, max_launches: int = 4
                        ) -> list[int]:
    codes = []
    for _ in range(max_launches):
        result = run_fit(workdir, *args, env=env, timeout=RUN_TIMEOUT_S)
        codes.append(result.returncode)
        if result.returncode != REQUEUE_EXIT_CODE:
            assert result.returncode == 0, result.stderr[-4000:]
            return codes
    raise AssertionError(f"not done after {max_launches} launches: {codes}")


def training_state(workdir: Path, run_name: str, experiment: str = "digits") -> dict[str, Any]:
    """Every leaf of the newest good checkpoint's model, optimizer and LR scheduler state, by its path."""
    record = ckpt_store.newest_good(workdir / "runs" / experiment / run_name / "checkpoints", CHECKPOINT_PATTERN)
    assert record is not None, f"no checkpoint of {run_name}"
    checkpoint = torch.load(record.path, map_location="cpu", weights_only=False)
    leaves: dict[str, Any] = {"global_step": checkpoint["global_step"]}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{prefix}.{index}", item)
        else:
            leaves[prefix] = value

    for part in ("state_dict", "optimizer_states", "lr_schedulers"):
        walk(part, checkpoint[part])
    return leaves


def assert_same_training_state(expected: dict[str, Any], actual: dict[str, Any]) -> None:
    """Same leaves; each tensor ``torch.equal`` to its counterpart, other values ``==`` (names the ones that differ)."""
    assert expected.keys() == actual.keys()
    tensors = [k for k, v in expected.items() if isinstance(v, torch.Tensor)]
    assert any(k.startswith("optimizer_states.") for k in tensors)  # the optimizer's moments are compared too
    different = [k for k in expected if not (torch.equal(expected[k], actual[k]) if k in tensors
                                             else expected[k] == actual[k])]
    assert not different, f"{len(different)} of {len(expected)} differ: {different[:8]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``reference(world)``: the workdir of an uninterrupted digits run (``ref``) on ``world`` ranks, made once."""
    made: dict[int, Path] = {}

    def get(world: int) -> Path:
        if world not in made:
            workdir = tmp_path_factory.mktemp(f"ref{world}")
            run_fit(workdir, *launcher(world), "--run_name", "ref", check=True, timeout=RUN_TIMEOUT_S)
            made[world] = workdir
        return made[world]

    return get


@pytest.mark.parametrize("world", [
    pytest.param(3, marks=pytest.mark.slow(covered_by="tests/e2e/test_resume_many_ranks.py::"
                                                      "test_ddp_resume_is_bitwise_at_3_and_4_ranks[4]")),
    4,
])
def test_ddp_resume_is_bitwise_at_3_and_4_ranks(reference: Any, tmp_path: Path, world: int) -> None:
    """A fire drill (a real SIGTERM) at step 5, mid-epoch; the relaunch runs to the end of epoch 2."""
    codes = relaunch_until_done(tmp_path, *launcher(world), "--spot.drill_steps", "[5]", "--run_name", "cut")
    assert codes == [REQUEUE_EXIT_CODE, 0]
    expected = training_state(reference(world), "ref")
    assert expected["global_step"] == EPOCHS * STEPS_PER_EPOCH[world]
    assert_same_training_state(expected, training_state(tmp_path, "cut"))


class SignalAgents(Callback):
    """At global step ``step``, each node's first process sends SIGTERM to its torchrun agent (its parent).

    A scheduler stopping a job signals every node's launcher; sent from inside, it lands at a known step
    whatever the machine's load (a test that polls for a checkpoint and then signals raced the run's end).
    The agents forward it to their processes, which agree, save and stop.
    """

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.local_rank == 0 and "TORCHELASTIC_RUN_ID" in os.environ:
            os.kill(os.getppid(), signal.SIGTERM)


def start_torchrun_agents(workdir: Path, port: int, run_name: str) -> list[subprocess.Popen]:
    """Two torchrun agents on 127.0.0.1 ("nodes"), 2 processes each: the 4-rank world of ``launcher(4)``."""
    agents = []
    for node_rank in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node_rank}",
                   "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={port}",
                   "-m", "recipes.fit", *DIGITS, "--trainer.num_nodes", "2", "--trainer.devices", "2",
                   f"--trainer.callbacks+={__name__}.SignalAgents", f"--trainer.callbacks.step={SIGNAL_STEP}",
                   "--run_name", run_name]
        with open(workdir / f"agent{node_rank}.log", "a") as log:  # the agent writes to its own copy
            agents.append(subprocess.Popen(command, cwd=workdir, env=cli_env(workdir), stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True))
    return agents


def wait_all(agents: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [agent.wait(max(1.0, deadline - time.monotonic())) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()


@pytest.mark.slow(covered_by="tests/e2e/test_multinode.py::test_torchrun_two_nodes_make_one_mlflow_run_and_one_checkpoint")
def test_torchrun_two_agents_of_two_resume_bitwise(reference: Any, tmp_path: Path) -> None:
    """A SIGTERM to both agents mid-epoch 0, as a scheduler stops a job; the same command again finishes it.

    Two agents of two processes make the same 4-rank world as Lightning's launcher (ranks, data shards, one
    thread each), so the uninterrupted run of ``launcher(4)`` is the reference.
    """
    run_dir = tmp_path / "runs" / "digits" / "tr"
    codes = wait_all(start_torchrun_agents(tmp_path, free_port(), "tr"), RUN_TIMEOUT_S)
    logs = "".join((tmp_path / f"agent{i}.log").read_text()[-3000:] for i in (0, 1))
    first = ckpt_store.newest_good(run_dir / "checkpoints", CHECKPOINT_PATTERN)
    # the processes saved on the notice (at the signal's step or the next) and stopped; the agents end on the signal
    assert first is not None and SIGNAL_STEP <= first.global_step < STEPS_PER_EPOCH[4], logs
    assert "INTERRUPTED" in (tmp_path / "agent0.log").read_text() and 0 not in codes, logs

    codes = wait_all(start_torchrun_agents(tmp_path, free_port(), "tr"), RUN_TIMEOUT_S)
    logs = "".join((tmp_path / f"agent{i}.log").read_text()[-3000:] for i in (0, 1))
    assert codes == [0, 0], logs
    expected = training_state(reference(4), "ref")
    assert_same_training_state(expected, training_state(tmp_path, "tr"))
