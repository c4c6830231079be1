"""Spot-safe as users launch: no ``--run_name``, loader workers, a signal to the whole process group.

A scheduler relaunches the job's exact command line, and a VM's shutdown (systemd), a SLURM preemption or a
terminal's Ctrl-C signals every process of the job: the main process, its loader workers, the DDP ranks Lightning
starts. Each case here launches a command with ``--data.num_workers 2`` and no run name in a new session, waits for
its first checkpoint, signals the whole group (``killpg``), and relaunches the identical command. Asserted: exit 75
with one ``atscale:`` line and no traceback, a checkpoint at the notice's step, and a relaunch that resumes it and
ends bitwise equal to the same command run uninterrupted elsewhere, in one FINISHED MLflow run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from callbacks.spot import CHECKPOINT_PATTERN, REQUEUE_EXIT_CODE
from callbacks.storage import ckpt_store
from recipes import prepare
from recipes.run.common import command_run_name
from tests.conftest import (
    CONFIGS,
    FAST,
    MadeOnFirstUse,
    assert_bitwise_equal,
    cli_env,
    final_weights,
    run_fit,
    runs_of,
    start_fit,
)

pytestmark = pytest.mark.timeout(900, func_only=True)

COMMON = ("--trainer.max_epochs", "2", "--spot.every_n_steps", "4", "--log_model", "false",
          "--data.num_workers", "2", *FAST)
RECIPES = {
    "memory": ("digits", ("--config", str(CONFIGS / "digits.yaml"))),
    "stream": ("digits-stream", ("--config", str(CONFIGS / "digits-stream.yaml"), "--data.url", "{data}",
                                 "--data.cache_dir", "cache")),
}
DDP = ("--config", str(CONFIGS / "strategy/ddp.yaml"))


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Digits prepared as chunks in a folder (300 items in chunks of 32), written once."""
    folder = tmp_path_factory.mktemp("stream") / "digits"
    assert prepare.main(["digits", "--output", str(folder), "--chunk_items", "32", "--max_items", "300"]) == 0
    return folder


def command(recipe: str, strategy: str, streamed: Path) -> tuple[str, list[str]]:
    experiment, args = RECIPES[recipe]
    return experiment, [a.replace("{data}", str(streamed)) for a in (*args, *(DDP if strategy == "ddp" else ()),
                                                                     *COMMON)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, streamed: Path) -> MadeOnFirstUse:
    """The same commands, uninterrupted, in a folder of their own."""
    def make(key: str) -> Path:
        recipe, strategy = key.split("-")
        workdir = tmp_path_factory.mktemp(f"ref-{key}")
        run_fit(workdir, *command(recipe, strategy, streamed)[1], check=True, timeout=600)
        return workdir

    return MadeOnFirstUse(make)


_KEPT = "tests/e2e/test_as_launched.py::test_a_signal_to_the_whole_group_saves_and_the_same_command_resumes_bitwise"


@pytest.mark.parametrize(("recipe", "strategy", "signal_name"), [
    ("memory", "single", "SIGTERM"),
    ("stream", "ddp", "SIGINT"),
    # the slow tier's: each differs from a kept case in one of data path, strategy and signal
    pytest.param("stream", "single", "SIGTERM", marks=pytest.mark.slow(covered_by=f"{_KEPT}[stream-ddp-SIGINT]")),
    pytest.param("memory", "ddp", "SIGTERM", marks=pytest.mark.slow(covered_by=f"{_KEPT}[memory-single-SIGTERM]")),
    pytest.param("memory", "single", "SIGINT", marks=pytest.mark.slow(covered_by=f"{_KEPT}[stream-ddp-SIGINT]")),
])
def test_a_signal_to_the_whole_group_saves_and_the_same_command_resumes_bitwise(
        reference: MadeOnFirstUse, streamed: Path, tmp_path: Path, recipe: str, strategy: str,
        signal_name: str) -> None:
    experiment, args = command(recipe, strategy, streamed)
    name = command_run_name(args)
    checkpoints = tmp_path / "runs" / experiment / name / "checkpoints"
    proc = start_fit(tmp_path, *args, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     text=True)
    try:
        deadline = time.monotonic() + 300
        while not list(checkpoints.glob("step=*.meta.json")):  # the first periodic save is published
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint before the signal"
            time.sleep(0.02)
        os.killpg(proc.pid, getattr(signal, signal_name))  # the main process, its loader workers, its ranks
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == REQUEUE_EXIT_CODE, err[-4000:]
    assert "Traceback" not in err and "killed by signal" not in err, err[-4000:]
    atscale = [line for line in err.splitlines() if line.startswith("atscale:")]
    assert len(atscale) == 1, err[-4000:]
    step = int(re.findall(r"Interruption notice \(signal\) -> checkpoint of step (\d+) on disk", err)[0])
    assert atscale[0] == (f"atscale: stopped at step {step} on an interruption notice, checkpoint saved (exit 75); "
                          f"to resume: python -m recipes.fit {' '.join(args)}")
    saved = ckpt_store.newest_good(checkpoints, CHECKPOINT_PATTERN)
    assert saved is not None and saved.global_step == step

    resumed = run_fit(tmp_path, *args)  # the identical command, no --run_name
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    # from the notice's checkpoint (or the epoch's best, when the notice fell on the epoch's last step)
    assert re.search(rf"Resuming from \S+/{name}/checkpoints/\S+\.ckpt \(step {step}\)\.", resumed.stderr)
    key = f"{recipe}-{strategy}"
    assert_bitwise_equal(final_weights(reference[key], name, experiment), final_weights(tmp_path, name, experiment))
    (run,) = runs_of(tmp_path, experiment)
    assert run.info.status == "FINISHED" and run.info.run_name == name


@pytest.mark.serial  # it compares a bill with the wall clock: alone, not beside another worker's load
def test_a_launch_a_shell_execd_after_other_work_is_billed_from_its_own_start(tmp_path: Path) -> None:
    """``bash -c 'sleep 5 && python -m recipes.fit ...'``: the shell exec's Python as its last command, so the process
    keeps the shell's start time; the bill starts when the launch did, not 5 s earlier."""
    args = ["--config", str(CONFIGS / "digits.yaml"), "--trainer.max_epochs", "1", "--log_model", "false",
            "--system_metrics", "false", *FAST]
    started = time.monotonic()
    result = subprocess.run(["bash", "-c", 'sleep 5 && exec "$0" -m recipes.fit "$@"', sys.executable, *args],
                            cwd=tmp_path, env=cli_env(tmp_path), capture_output=True, text=True, timeout=600)
    launch_wall = time.monotonic() - started - 5.0
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs_of(tmp_path, "digits")
    billed, startup = run.data.metrics["cost/billed_s"], run.data.metrics["goodput/startup_s"]
    # billed: from the launch's start to its last log at train end, never from the shell's start (5 s earlier);
    # the rest of the launch is its wrap-up (the baselines and the plots, made after training) and its exit
    assert launch_wall - 3.0 < billed <= launch_wall, (billed, launch_wall)
    assert startup < launch_wall - (run.data.metrics["goodput/productive_s"] or 0), (startup, launch_wall)


@pytest.mark.serial  # it compares a bill with the wall clock: alone, not beside another worker's load
def test_launches_killed_before_and_after_a_checkpoint_and_a_relaunch_elsewhere_are_all_billed(tmp_path: Path) -> None:
    """Launch 1 (a2-highgpu-1g spot) is SIGKILLed at step 20, before any checkpoint; launch 2 (the same) at step 60,
    after epoch 0's checkpoint (step 45); launch 3 comes back on a3-highgpu-1g and finishes. The bill covers the wall
    clock from launch 1's start to launch 3's end, and its dollars are the launches' segments, each at its rate."""
    kills = [json.dumps({"class_path": "tests.faults.KillOnce",
                         "init_args": {"step": step, "marker": str(tmp_path / f"killed-{step}")}}) for step in (20, 60)]
    base = ["--config", str(CONFIGS / "digits.yaml"), "--trainer.max_epochs", "2", "--log_model", "false",
            "--system_metrics", "false", "--run_name", "k", "--cost.market", "spot", *FAST,
            *(f"--trainer.callbacks+={k}" for k in kills)]
    started = time.monotonic()
    for instance in ("a2-highgpu-1g", "a2-highgpu-1g"):
        # new interpreters, as users launch: a fork of the test zygote would start after the zygote's own imports
        proc = start_fit(tmp_path, *base, "--cost.instance", instance, start_new_session=True, real=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == -signal.SIGKILL, err[-3000:]
        time.sleep(2.0)  # down
    last = run_fit(tmp_path, *base, "--cost.instance", "a3-highgpu-1g", real=True)
    wall = time.monotonic() - started
    assert last.returncode == 0, last.stderr[-3000:]
    assert "(step 45)." in last.stderr  # resumed from epoch 0's checkpoint, written by launch 2
    (run,) = runs_of(tmp_path, "digits")
    metrics = run.data.metrics
    # the clock runs from launch 1's start to launch 3's last log; only launch 3's exit is outside it
    assert wall - 2.0 < metrics["cost/billed_s"] <= wall, (metrics["cost/billed_s"], wall)
    # launch 1's steps and launch 2's after its checkpoint (the steps file is written after each step's callbacks:
    # the one in flight at a kill may be missing)
    assert 19 + 14 <= metrics["cost/lost_steps"] <= 20 + 15
    segments = json.loads(run.data.tags["atscale.cost_segments"])
    assert [(s["instance"], s["market"]) for s in segments] == [("a2-highgpu-1g", "spot"), ("a3-highgpu-1g", "spot")]
    assert sum(s["billed_s"] for s in segments) == pytest.approx(metrics["cost/billed_s"], rel=1e-9)
    assert sum(s["usd"] for s in segments) == pytest.approx(metrics["cost/usd"], rel=1e-9)
    assert segments[0]["usd"] == pytest.approx(segments[0]["billed_s"] / 3600 * 1.293, rel=1e-9)
    assert segments[1]["usd"] == pytest.approx(segments[1]["billed_s"] / 3600 * 4.42, rel=1e-9)
