"""Two "nodes" on this machine under torchrun (one process each, gloo on 127.0.0.1): one run comes out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from callbacks.spot import CHECKPOINT_PATTERN
from callbacks.storage import ckpt_store
from tests.conftest import CONFIGS, FAST, cli_env, free_port, runs_of


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
