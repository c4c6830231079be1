"""A published checkpoint implies its metrics are durable: kills and notices leave an uninterrupted run's history.

A SIGKILL the moment a checkpoint appears used to lose the metrics still in MLflow's 5 s async buffer (the
relaunch resumes past them and never logs them again), and a notice added a point at its step that an
uninterrupted run does not log (Lightning logs on ``should_stop``). Each test compares every metric key's
history, point for point, with an uninterrupted run's; the keys that measure the clock are exempt
(``recipes.reproduce``'s list), as they are in ``tests/e2e/test_exact_under_load.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from callbacks.spot import REQUEUE_EXIT_CODE
from tests.conftest import CONFIGS, FAST, MadeOnFirstUse, client_for, run_fit, runs_of, start_fit
from tests.e2e.test_exact_under_load import history, wall_clock

pytestmark = pytest.mark.timeout(900, func_only=True)

# keep 10: every checkpoint stays, so the test sees each one published (pruning is not what it checks)
BASE = ("--config", str(CONFIGS / "digits.yaml"), "--trainer.max_epochs", "2", *FAST, "--log_model", "false",
        "--spot.every_n_steps", "20", "--spot.keep", "10")
DDP = ("--config", str(CONFIGS / "strategy/ddp.yaml"))
STRATEGIES = {"single": (), "ddp": DDP}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> MadeOnFirstUse:
    """Uninterrupted runs per strategy (``STRATEGIES``), each made when first read."""
    def make(name: str) -> Path:
        workdir = tmp_path_factory.mktemp(f"history-ref-{name}")
        run_fit(workdir, *BASE, *STRATEGIES[name], "--run_name", "h", check=True)
        return workdir

    return MadeOnFirstUse(make)


def assert_same_history(expected_dir: Path, got_dir: Path) -> None:
    expected, got = history(expected_dir), history(got_dir)
    assert {k for k in got if not wall_clock(k)} == {k for k in expected if not wall_clock(k)}
    for key in expected:
        if not wall_clock(key):
            assert got[key] == expected[key], key
    (run,) = runs_of(got_dir, "digits")
    assert run.info.status == "FINISHED"


def kill_when_published(workdir: Path, args: tuple[str, ...], name: str) -> None:
    """Start the fit; SIGKILL its process group the moment ``checkpoints/<name>`` is published (its record)."""
    record = workdir / "runs" / "digits" / "h" / "checkpoints" / f"{name}.meta.json"
    proc = start_fit(workdir, *args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                     start_new_session=True)
    deadline = time.monotonic() + 600
    while not record.exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"{name} never appeared"
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize(("strategy", "checkpoint"), [
    ("single", "step=00000020.ckpt"),  # mid-epoch: steps 9 and 19 logged, maybe in MLflow's buffer
    ("single", "step=00000045.ckpt"),  # the epoch's end: its validation logged just before
    pytest.param("ddp", "step=00000023.ckpt", marks=pytest.mark.slow(  # DDP's epoch end (23 batches a rank)
        covered_by="tests/e2e/test_metric_history.py::test_a_sigkill_as_a_checkpoint_appears_loses_no_metric")),
])
def test_a_sigkill_as_a_checkpoint_appears_loses_no_metric(reference: dict[str, Path], tmp_path: Path,
                                                           strategy: str, checkpoint: str) -> None:
    args = (*BASE, *STRATEGIES[strategy], "--run_name", "h")
    kill_when_published(tmp_path, args, checkpoint)
    result = run_fit(tmp_path, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_history(reference[strategy], tmp_path)


@pytest.mark.parametrize("strategy", [
    "single",
    pytest.param("ddp", marks=pytest.mark.slow(
        covered_by="tests/e2e/test_rank_agreement.py::test_a_notice_seen_by_one_rank_stops_all_at_one_step")),
])
def test_a_notice_adds_no_point_at_its_step(reference: dict[str, Path], tmp_path: Path, strategy: str) -> None:
    """A notice at step 33 (off the logging cadence of 10 steps), then the relaunch: the history is the reference's."""
    args = (*BASE, *STRATEGIES[strategy], "--run_name", "h", "--spot.drill_steps", json.dumps([33]))
    first = run_fit(tmp_path, *args)
    assert first.returncode == REQUEUE_EXIT_CODE, first.stderr[-3000:]
    second = run_fit(tmp_path, *args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert_same_history(reference[strategy], tmp_path)
    (run,) = runs_of(tmp_path, "digits")
    assert [m.value for m in client_for(tmp_path).get_metric_history(run.info.run_id, "spot/interruptions")] == [1.0]
