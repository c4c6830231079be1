"""Exactness whatever the machine is doing: the default recipe beside real CPU-bound work, and relaunch histories.

No thread pin anywhere in this module: the runs use the default ``--cpu_threads auto`` with whatever
thread count torch starts with, while processes started by the test hold every core. A run interrupted
by real SIGTERMs and relaunched must end bitwise equal to an uninterrupted run started beside the same
load, ``recipes.reproduce`` must find identical metrics, and a relaunch after a SIGKILL must leave the
MLflow history of every non-wall-clock key exactly as an uninterrupted run's (one point per step).
"""

from __future__ import annotations

import fnmatch
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from callbacks.spot import CHECKPOINT_PATTERN, REQUEUE_EXIT_CODE
from callbacks.storage import ckpt_store
from recipes.reproduce import DEFAULT_IGNORE
from tests.conftest import CONFIGS, FAST, cli_env, client_for, run_fit, run_module, runs_of, start_fit

EPOCHS = 3  # 45 steps an epoch
BASE = ("--config", str(CONFIGS / "digits.yaml"), "--trainer.max_epochs", str(EPOCHS),
        "--trainer.log_every_n_steps", "1", *FAST,
        "--log_model", "false")  # logged once training ends: not what these tests check
DDP = ("--config", str(CONFIGS / "strategy/ddp.yaml"))
pytestmark = pytest.mark.timeout(900, func_only=True)
_BUSY = "while True:\n    pass\n"


def unpinned_env(workdir: Path) -> dict[str, str]:
    """A CLI subprocess's environment with no OpenMP setting of the suite's: torch picks its own thread count."""
    env = cli_env(workdir)
    for key in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS"):
        env.pop(key, None)
    return env


@pytest.fixture(scope="module")
def busy_machine() -> Iterator[int]:
    """One busy-loop process per core, for the module's whole life (references and interrupted runs alike)."""
    cores = os.cpu_count() or 1
    hogs = [subprocess.Popen([sys.executable, "-c", _BUSY]) for _ in range(cores)]
    try:
        yield cores
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def final_weights(workdir: Path, run_name: str) -> dict[str, torch.Tensor]:
    record = ckpt_store.newest_good(workdir / "runs" / "digits" / run_name / "checkpoints", CHECKPOINT_PATTERN)
    assert record is not None
    return torch.load(record.path, map_location="cpu", weights_only=False)["state_dict"]


def differing_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def run_id_of(workdir: Path) -> str | None:
    runs = runs_of(workdir, "digits")
    return runs[0].info.run_id if runs else None


def logged_steps(workdir: Path, key: str = "train/loss") -> list[int]:
    run_id = run_id_of(workdir)
    return [] if run_id is None else [m.step for m in client_for(workdir).get_metric_history(run_id, key)]


def launch_and_signal(workdir: Path, args: tuple[str, ...], env: dict[str, str], past_step: int,
                      signum: int = signal.SIGTERM) -> subprocess.Popen:
    """Start a fit; once MLflow holds a ``train/loss`` point past ``past_step`` logged by it, send it ``signum``.

    "By it": past what the store held when it started. A relaunch's store already holds the previous launch's
    points, which can reach past ``past_step`` (metrics are flushed after the stop); signalled on those, the
    relaunch got the signal while still importing (exit -15, no handler yet) instead of in training.
    """
    before = max(logged_steps(workdir), default=-1)
    # the store is how this test sees the step: metrics written as they come, not in MLflow's 1 s batches, or a
    # fast relaunch ends its 35 steps before any shows (the points and their values are the same either way)
    env = {**env, "MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS": "0"}
    proc = start_fit(workdir, *args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if max(logged_steps(workdir), default=-1) > max(past_step, before):
            os.kill(proc.pid, signum)
            break
        time.sleep(0.1)
    proc.wait(timeout=600)
    return proc


def history(workdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every metric key of the run's history, as (step, value) points in step order."""
    client = client_for(workdir)
    run_id = run_id_of(workdir)
    assert run_id is not None
    keys = client.get_run(run_id).data.metrics
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in keys}


def wall_clock(key: str) -> bool:
    """Keys that measure time or the machine (reproduce's list), or an interruption the reference never had."""
    return any(fnmatch.fnmatch(key, pattern) for pattern in DEFAULT_IGNORE)


@pytest.fixture(scope="module")
def busy_reference(busy_machine: int, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default recipe, uninterrupted, beside the load."""
    workdir = tmp_path_factory.mktemp("busy-ref")
    run_fit(workdir, *BASE, "--run_name", "ref", env=unpinned_env(workdir), check=True, timeout=900)
    return workdir


# serial: the busy loops would slow whatever test a second pytest-xdist worker runs beside these
@pytest.mark.serial
def test_sigterms_beside_busy_work_resume_bitwise(busy_reference: Path, tmp_path: Path) -> None:
    """Two real SIGTERMs at seeded moments, each followed by a relaunch, all beside the same load."""
    env = unpinned_env(tmp_path)
    args = (*BASE, "--run_name", "spot")
    moments = sorted(random.Random(27).sample(range(10, 45 * EPOCHS - 40), 2))
    for past_step in moments:
        proc = launch_and_signal(tmp_path, args, env, past_step)
        assert proc.returncode == REQUEUE_EXIT_CODE, proc.stderr.read()[-3000:] if proc.stderr else ""
    result = run_fit(tmp_path, *args, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert differing_tensors(final_weights(busy_reference, "ref"), final_weights(tmp_path, "spot")) == []
    (run,) = runs_of(tmp_path, "digits")
    assert run.info.status == "FINISHED"
    # the thread count the run started with held through every launch (one point: logged once per step): the
    # reference's, unpinned beside the same load (not this test process's, which pytest-xdist may pin to one)
    def thread_counts(workdir: Path, run_id: str) -> set[float]:
        return {m.value for m in client_for(workdir).get_metric_history(run_id, "cpu/threads")}

    started_with = thread_counts(busy_reference, run_id_of(busy_reference))
    assert len(started_with) == 1
    assert thread_counts(tmp_path, run.info.run_id) == started_with


@pytest.mark.serial
@pytest.mark.slow(covered_by="tests/e2e/test_exact_under_load.py::test_sigterms_beside_busy_work_resume_bitwise")
def test_reproduce_beside_busy_work_is_identical(busy_reference: Path) -> None:
    env = unpinned_env(busy_reference)
    run_id = run_id_of(busy_reference)
    result = run_module("recipes.reproduce", str(run_id), "--run_name", "again", cwd=busy_reference, env=env,
                        timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Reproduced: " in result.stdout and "metrics identical within 0" in result.stdout


@pytest.mark.parametrize("strategy", [
    "single",
    pytest.param("ddp", marks=pytest.mark.slow(
        covered_by="tests/e2e/test_metric_history.py::test_a_sigkill_as_a_checkpoint_appears_loses_no_metric")),
])
def test_sigkill_past_the_checkpoint_leaves_the_history_of_an_uninterrupted_run(
        tmp_path_factory: pytest.TempPathFactory, strategy: str) -> None:
    """A real SIGKILL 14 steps past the newest checkpoint, once those steps' metrics are in the store.

    Every key the reference logged appears with the same (step, value) points; the keys that measure the
    machine (time, throughput, cost, system) keep one point per step, since their values are the clock's.
    """
    extra = DDP if strategy == "ddp" else ()
    ref, killed = tmp_path_factory.mktemp(f"hist-ref-{strategy}"), tmp_path_factory.mktemp(f"hist-{strategy}")
    # checkpoints every 20 steps; the kill after step 34 of 46 (DDP) or 90, with the redone steps' metrics stored
    args = (*BASE, *extra, "--trainer.max_epochs", "2", "--spot.every_n_steps", "20", "--run_name", "h")
    run_fit(ref, *args, check=True)
    marker = killed / "killed-at"
    kill = json.dumps({"class_path": "tests.faults.KillOnce", "init_args": {"step": 34, "marker": str(marker)}})
    proc = start_fit(killed, *args, f"--trainer.callbacks+={kill}", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                     text=True, start_new_session=True)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL and marker.read_text() == "34", stderr[-3000:]
    assert max(logged_steps(killed)) >= 30  # metrics well past the step-20 checkpoint were stored before the kill
    result = run_fit(killed, *args, f"--trainer.callbacks+={kill}")
    assert result.returncode == 0, result.stderr[-3000:]

    expected, got = history(ref), history(killed)
    assert {k for k in got if not wall_clock(k)} == {k for k in expected if not wall_clock(k)}
    for key in got:
        steps = [step for step, _ in got[key]]
        if wall_clock(key):
            # the clock's values (and the cost of the interruption itself): one point per step all the same
            assert len(steps) == len(set(steps)), f"{key}: a step logged twice: {steps}"
        else:
            assert got[key] == expected[key], key
    (run,) = runs_of(killed, "digits")
    assert run.info.status == "FINISHED"
