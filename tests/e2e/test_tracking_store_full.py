"""A full disk under the MLflow tracking store, on the real CLI: one line, exit 1, and a relaunch that loses nothing.

The store is a sqlite file on a small tmpfs (root only; skipped where mounting is not permitted, as in
``tests/e2e/test_run_integrity.py``). A run that meets the full store ends with one ``error:`` line naming the
store and the cause, exit code 1, no traceback, its MLflow run not left RUNNING where the store still takes the
status; once space is freed, the same command finishes the run and its metric history equals an uninterrupted
run's point for point (the clock keys aside, as in ``tests/e2e/test_metric_history.py``). A store that cannot
even be created is one line too, and leaves nothing behind.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from callbacks.spot import REQUEUE_EXIT_CODE
from tests.conftest import (
    CONFIGS,
    FAST,
    CliResult,
    cli_env,
    mlflow_template_bytes,
    run_fit,
    runs_of,
    seed_mlflow_db,
    start_fit,
)
from tests.e2e.test_metric_history import assert_same_history
from tests.e2e.test_run_integrity import small_mount, stderr_lines

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900, func_only=True)]

__all__ = ["small_mount"]  # the fixture, shared with test_run_integrity.py

# a save every 20 steps: a store that fills mid-run is met at a save soon after
ARGS = ("--config", str(CONFIGS / "digits.yaml"), "--trainer.max_epochs", "2", *FAST, "--log_model", "false",
        "--spot.every_n_steps", "20", "--run_name", "full")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("store-full-ref")
    run_fit(workdir, *ARGS, check=True)
    return workdir


def store_env(workdir: Path, store: Path, **extra: str) -> dict[str, str]:
    return cli_env(workdir, MLFLOW_TRACKING_URI=f"sqlite:///{store / 'mlflow.db'}", **extra)


def fill(folder: Path) -> None:
    """Take every byte left on ``folder``'s filesystem (a file named ``filler``)."""
    with open(folder / "filler", "wb", buffering=0) as filler:
        try:
            while True:
                filler.write(b"\0" * 4096)
                filler.flush()
        except OSError:
            pass


def store_mount(headroom_kib: int) -> str:
    """tmpfs options for a store with ``headroom_kib`` left once a migrated, empty store is copied in.

    Sized from the store itself: MLflow 3.18's migrated store alone (1,032,192 bytes) outgrew the fixed 1 MB
    mount that left ~90 KB under 3.17, and the run could not even be created.
    """
    return f"size={-(-mlflow_template_bytes() // 1024) + headroom_kib}k"


def run_status(store: Path) -> str:
    (run,) = runs_of(store, "digits")
    return run.info.status


def first_launch(workdir: Path, store: Path, when: str) -> subprocess.CompletedProcess:
    """The launch that meets the full store (see the test's docstring for ``when``)."""
    # at_the_end: one write, at the end (the run is shorter than the buffer); otherwise each point as it comes
    env = store_env(workdir, store, MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS="600" if when == "at_the_end" else "0")
    if when != "filled_by_another":
        return run_fit(workdir, *ARGS, env=env)
    proc = start_fit(workdir, *ARGS, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    checkpoints = workdir / "runs" / "digits" / "full" / "checkpoints"
    deadline = time.monotonic() + 300
    while not any(checkpoints.glob("step=*.meta.json")):  # a checkpoint is published: fill every byte left
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was published"
        time.sleep(0.02)
    fill(store)
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("when", ["at_the_end", "mid_run", "filled_by_another"])
def test_a_full_store_is_one_line_exit_1_and_the_relaunch_restores_every_point(
        reference: Path, tmp_path: Path, small_mount: Callable[[str], Path], when: str) -> None:
    """``at_the_end`` and ``mid_run``: the store has 96 KiB left once its tables exist (a migrated store on a
    tmpfs sized to it). ``filled_by_another``: something else takes every byte left once the first checkpoint is
    published.

    ``at_the_end``: MLflow's async queue writes what gathered once per buffering interval, here longer than the
    run, so the whole run is written by the last flush, which the store refuses after training has ended (Lightning
    had marked the run FINISHED already: the run said "finished", exit 0, and held no point of train/* or val/*).
    ``mid_run``: written as they come, the points fill the store during the first epoch and a save soon after
    stops the run. Seen here: in both the run's status still fits (a row updated in place) and the run ends FAILED;
    a store with no byte left (``filled_by_another``) cannot take even that, and the line says so.
    """
    store = small_mount(store_mount(3072 if when == "filled_by_another" else 96))
    seed_mlflow_db(store)  # a migrated, empty store: what the first launch would create, in a fraction of the time
    uri = f"sqlite:///{store / 'mlflow.db'}"
    first = first_launch(tmp_path, store, when)
    assert first.returncode == 1, first.stderr[-5000:]
    assert "Traceback" not in first.stderr and " ERROR " not in first.stderr, first.stderr[-5000:]
    errors = [line for line in stderr_lines(first) if line.startswith("error:")]
    assert len(errors) == 1, first.stderr[-5000:]
    (line,) = errors
    assert line.startswith(f"error: the tracking store {uri} is full (database or disk is full): training "
                           "stopped at step "), line
    assert "relaunch the same command to resume" in line
    assert "atscale run — finished" not in first.stdout
    if when == "filled_by_another":
        # mostly the status cannot be written either, and the line says so; once in CI the failed writes' own
        # pages (the rollback journal) were freed first and FAILED fitted: either way, the line is the store's truth
        unwritten = ("its MLflow run's status could not be written either (it shows RUNNING until the "
                     "relaunch)")
        status = run_status(store)
        assert status in ("RUNNING", "FAILED"), status
        assert line.endswith(unwritten) == (status == "RUNNING"), (status, line)
        (store / "filler").unlink()  # space freed
    else:
        assert run_status(store) == "FAILED"
        subprocess.run(["mount", "-o", "remount,size=8m", str(store)], check=True)  # space freed
    second = run_fit(tmp_path, *ARGS, env=store_env(tmp_path, store))
    assert second.returncode == 0, second.stderr[-5000:]
    assert "Traceback" not in second.stderr and "could not be restored" not in second.stderr, second.stderr[-5000:]
    assert_same_history(reference, store)  # one FINISHED run, every key's history the reference's


def test_lost_points_that_no_checkpoint_kept_are_named_by_the_relaunch(tmp_path: Path) -> None:
    """A store that lost points no checkpoint's record carries (say, restored from an older backup): the relaunch
    cannot log them again, and says in one warning which keys and steps are missing."""
    args = (*ARGS, "--spot.drill_steps", "[50]")
    first = run_fit(tmp_path, *args)
    assert first.returncode == REQUEUE_EXIT_CODE, first.stderr[-5000:]
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        db.execute("DELETE FROM metrics WHERE key IN ('train/loss', 'train/acc') AND step IN (9, 19)")
    for record in (tmp_path / "runs/digits/full/checkpoints").glob("*.meta.json"):
        data = json.loads(record.read_text())
        data["extra"].pop("metrics_pending", None)
        record.write_text(json.dumps(data))

    second = run_fit(tmp_path, *args)
    assert second.returncode == 0, second.stderr[-5000:]
    (warning,) = [line for line in stderr_lines(second) if "could not be restored" in line]
    assert warning.endswith(": train/acc at steps 9, 19; train/loss at steps 9, 19."), warning


def test_a_store_that_cannot_be_created_on_a_full_disk_is_one_line_and_leaves_nothing(
        tmp_path: Path, small_mount: Callable[[str], Path], fit_in_process: Callable[..., CliResult]) -> None:
    store = small_mount(store_mount(3072))  # the relaunch after the filler goes needs room for a whole run
    fill(store)
    uri = f"sqlite:///{store / 'mlflow.db'}"
    result = fit_in_process(*ARGS, MLFLOW_TRACKING_URI=uri)
    assert result.returncode == 1, result.stderr[-5000:]
    (line,) = stderr_lines(result)
    assert line.startswith(f"error: the tracking store {uri} is full (database or disk is full): it could not be "
                           "created"), line
    assert sorted(p.name for p in store.iterdir()) == ["filler"]  # no half-created store, no temporary one
    assert not (tmp_path / "runs").exists()  # no run directory, no lock

    (store / "filler").unlink()
    again = run_fit(tmp_path, *ARGS, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3",
                    "--trainer.limit_val_batches", "1", env=store_env(tmp_path, store))
    assert again.returncode == 0, again.stderr[-5000:]
    with sqlite3.connect(store / "mlflow.db") as db:
        assert db.execute("SELECT status FROM runs").fetchall() == [("FINISHED",)]
