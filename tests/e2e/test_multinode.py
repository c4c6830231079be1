"""Two "nodes" on this machine under torchrun (one process each, gloo on 127.0.0.1): one run comes out."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

from callbacks.spot import CHECKPOINT_PATTERN
from callbacks.storage import ckpt_store
from datamodules.digits import DigitsDataModule
from tests.conftest import CONFIGS, FAST, cli_env, free_port, run_fit, runs_of
from tests.sample_trace import epoch_counts, split_counts


def test_torchrun_two_nodes_make_one_mlflow_run_and_one_checkpoint(tmp_path: Path) -> None:
    port = free_port()
    nodes = []
    for node_rank in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node_rank}",
                   "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
                   "-m", "recipes.fit", "--config", str(CONFIGS / "digits.yaml"),
                   "--trainer.strategy", "ddp", "--trainer.num_nodes", "2", "--trainer.devices", "1",
                   "--trainer.max_epochs", "2", "--run_name", "two-nodes", *FAST]
        nodes.append(subprocess.Popen(command, cwd=tmp_path, env=cli_env(tmp_path), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]

    runs = runs_of(tmp_path, "digits")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    manifest_world = runs[0].data.params  # the config is logged once, by global rank 0
    assert manifest_world["trainer.num_nodes"] == "2"
    ckpt_dir = tmp_path / "runs" / "digits" / "two-nodes" / "checkpoints"
    record = ckpt_store.newest_good(ckpt_dir, CHECKPOINT_PATTERN)
    assert record is not None and record.global_step == 2 * 23  # 2 epochs of ceil(1437 / 2 / 32) batches
    state = torch.load(record.path, map_location="cpu", weights_only=False)
    assert len(state["atscale"]["rng"]) == 2  # both ranks' RNG states
    assert state["atscale"]["mlflow_run_id"] == runs[0].info.run_id


def test_torchrun_elastic_job_goes_on_when_a_node_is_lost(tmp_path: Path) -> None:
    """``torchrun --nnodes 1:2``: two agents on 127.0.0.1; one is killed mid-run (agent and worker, SIGKILL).

    The survivor's worker fails on the lost peer, its agent restarts it in a round of one node, and the run
    resumes from its newest checkpoint on one process: one MLflow run, FINISHED, one checkpoint directory, every
    training sample trained once per epoch (what the lost node trained past the checkpoint trained again).
    """
    port, trace = free_port(), tmp_path / "trace"
    env = cli_env(tmp_path)
    # the second agent starts once the first listens, and its imports take seconds (tens on a busy machine): a
    # last call of 30 s puts both nodes in the first round, not a round of one then a restart when the second
    # joins (that restart's rank exchange timed out under load in CI); the round after the loss waits it out too
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-nodes",
               "--rdzv-conf=last_call_timeout=30", "--max-restarts=2", "--monitor-interval=0.5",
               "-m", "recipes.fit", "--config", str(CONFIGS / "digits.yaml"), *FAST, "--log_model", "false",
               "--trainer.strategy", "ddp", "--trainer.devices", "1", "--trainer.max_epochs", "2",
               "--spot.every_n_steps", "5", "--run_name", "elastic-nodes",
               "--trainer.callbacks+=tests.sample_trace.SampleTrace", f"--trainer.callbacks.path={trace}"]
    logs = [open(tmp_path / f"node{i}.log", "w") for i in range(2)]
    survivor = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=logs[0], stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + 180  # the survivor hosts the rendezvous store: the other agent starts once it listens
    while survivor.poll() is None and time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    lost = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=logs[1], stderr=subprocess.STDOUT,
                            start_new_session=True)
    ckpt_dir = tmp_path / "runs" / "digits" / "elastic-nodes" / "checkpoints"
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and survivor.poll() is None:  # both nodes trained past step 10
            record = ckpt_store.newest_good(ckpt_dir, CHECKPOINT_PATTERN) if ckpt_dir.exists() else None
            if record is not None and record.global_step >= 10:
                break
            time.sleep(0.2)
        assert survivor.poll() is None and lost.poll() is None, (tmp_path / "node0.log").read_text()[-3000:]
        # the node is lost: its agent and its worker (torchrun starts each worker in a session of its own)
        for proc in [*psutil.Process(lost.pid).children(recursive=True), psutil.Process(lost.pid)]:
            proc.send_signal(signal.SIGKILL)
        lost.wait(30)
        survivor.wait(600)
    finally:
        for proc in (survivor, lost):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for log in logs:
            log.close()
    output = (tmp_path / "node0.log").read_text()
    assert survivor.returncode == 0, output[-5000:]
    # the first round had both nodes (the command says 1); the restart after the loss has one: nothing to say
    assert output.count("torchrun: this rendezvous round has 2 node(s); training on 2 (trainer.num_nodes was 1).") == 1
    assert "Resumed on 1 rank(s) from a checkpoint of 2" in output, output[-5000:]
    # the survivor's failed collective is one line (a stop: exit 75, the agent restarts it), not a traceback
    assert output.count("error: a peer process was lost (Connection ") == 1, output[-5000:]
    assert "Traceback" not in output, output[-5000:]

    (run,) = runs_of(tmp_path, "digits")
    assert run.info.status == "FINISHED"
    assert run.data.tags["atscale.elastic"].startswith("2->1@")
    assert sorted(p.name for p in (tmp_path / "runs" / "digits").iterdir()) == ["elastic-nodes"]
    record = ckpt_store.newest_good(ckpt_dir, CHECKPOINT_PATTERN)
    assert record is not None and record.extra["mlflow_run_id"] == run.info.run_id
    data = DigitsDataModule()
    data.setup("fit")
    split = split_counts(data.train_set)
    counts = epoch_counts(trace)
    assert sorted(counts) == [0, 1] and all(counts[epoch] == split for epoch in counts), \
        {epoch: sum((c - split).values()) + sum((split - c).values()) for epoch, c in counts.items()}


def test_a_node_without_the_checkpoint_ends_the_job_at_start_up(tmp_path: Path) -> None:
    """Two torchrun "nodes" whose --runs_root is each one's own disk: only node 0 holds the run's checkpoint.

    Global rank 0 decides where the run starts and the other ranks receive that decision (recipes/run/agree.py):
    node 1 cannot find the checkpoint, says so in one line, and both nodes end at start-up. Each rank deciding
    alone, node 1 started from step 0 beside node 0 at step 3: two ranks in different places of one training run.
    """
    node_dirs = [tmp_path / "node0", tmp_path / "node1"]
    for node_dir in node_dirs:
        node_dir.mkdir()
    env = cli_env(node_dirs[0])  # one tracking store for the job, as a team's server would be
    digits = ["-m", "recipes.fit", "--config", str(CONFIGS / "digits.yaml"), "--run_name", "split", *FAST,
              "--log_model", "false", "--system_metrics", "false"]
    first = run_fit(node_dirs[0], *digits[2:], "--trainer.max_steps", "3", env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    port = free_port()
    nodes = []
    for node_rank, node_dir in enumerate(node_dirs):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node_rank}",
                   "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", *digits,
                   "--trainer.strategy", "ddp", "--trainer.num_nodes", "2", "--trainer.devices", "1",
                   "--trainer.max_steps", "6"]
        nodes.append(subprocess.Popen(command, cwd=node_dir, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    shown = outputs[0][-2500:] + outputs[1][-2500:]
    assert all(node.returncode != 0 for node in nodes), shown
    refusal = ("error: rank 1 cannot find runs/digits/split/checkpoints/step=00000003.ckpt, the checkpoint global "
               "rank 0 resumes from, on this machine")
    assert refusal in outputs[1], shown
    assert "error: rank 1: rank 1 cannot find" in outputs[0], shown  # node 0 ends on node 1's word, not a timeout
    assert not (node_dirs[1] / "runs" / "digits" / "split" / "checkpoints").exists() or not any(
        (node_dirs[1] / "runs" / "digits" / "split" / "checkpoints").glob("step=*.ckpt"))  # node 1 trained nothing


def test_srun_tasks_that_would_start_apart_stop_together(tmp_path: Path) -> None:
    """Two SLURM tasks (srun's environment, no torchrun) whose --runs_root is each one's own disk: each applies
    the resume policy alone, task 0 finds the run's checkpoint, task 1 none. Once the process group exists, the
    ranks compare their starts (recipes/run/cli_callbacks.py's AgreedStart) and both stop with the same line."""
    node_dirs = [tmp_path / "node0", tmp_path / "node1"]
    for node_dir in node_dirs:
        node_dir.mkdir()
    env = cli_env(node_dirs[0])  # one tracking store for the job
    digits = ["-m", "recipes.fit", "--config", str(CONFIGS / "digits.yaml"), "--run_name", "apart", *FAST,
              "--log_model", "false", "--system_metrics", "false"]
    first = run_fit(node_dirs[0], *digits[2:], "--trainer.max_steps", "3", env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "atscale-digits", "SLURM_NTASKS": "2",
             "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
             "SLURM_NODELIST": "localhost", "SLURM_JOB_NODELIST": "localhost", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(free_port())}
    tasks = [subprocess.Popen([sys.executable, *digits, "--trainer.strategy", "ddp", "--trainer.devices", "2",
                               "--trainer.max_steps", "6"], cwd=node_dir,
                              env={**env, **slurm, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for rank, node_dir in enumerate(node_dirs)]
    try:
        outputs = [task.communicate(timeout=240)[0] for task in tasks]
    finally:
        for task in tasks:
            if task.poll() is None:
                os.killpg(task.pid, signal.SIGKILL)
    shown = outputs[0][-2500:] + outputs[1][-2500:]
    assert [task.returncode for task in tasks] == [2, 2], shown
    line = ("error: the ranks would start apart: rank 0 starts run apart from step=00000003.ckpt, rank 1 starts run "
            "apart from scratch. Give every node the same --runs_root")
    assert line in outputs[0] and line in outputs[1], shown
    assert not any((node_dirs[1] / "runs" / "digits" / "apart").glob("checkpoints/step=*.ckpt"))  # none trained
    # the relaunch had reopened the run when the ranks compared their starts: it ends FAILED, never RUNNING
    assert [r.info.status for r in runs_of(node_dirs[0], "digits") if r.info.run_name == "apart"] == ["FAILED"]
