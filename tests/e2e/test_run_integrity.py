"""The edges of a run's life on the real CLI: kills from the first second, double and concurrent launches,
a changed config on resume, bad checkpoint inputs, a read-only or full disk, secrets in URLs.

Every case runs ``python -m recipes.fit`` as a subprocess with real signals against a real sqlite
MLflow store, and checks the promise: one MLflow run per run name, FINISHED at the end, never one
left RUNNING, no good checkpoint lost, one line on stderr for what went wrong.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from callbacks.spot import CHECKPOINT_PATTERN, REQUEUE_EXIT_CODE
from callbacks.storage import ckpt_store
from recipes.run.lock import LOCK_NAME
from tests.conftest import (
    CONFIGS,
    FAST,
    CliResult,
    cli_env,
    client_for,
    free_port,
    frozen,
    run_fit,
    runs_of,
    start_fit,
)

pytestmark = pytest.mark.e2e

SHORT = ("--config", str(CONFIGS / "digits.yaml"), *FAST, "--log_model", "false", "--trainer.max_epochs", "1",
         "--trainer.limit_val_batches", "2")
DDP = ("--config", str(CONFIGS / "strategy/ddp.yaml"))


def launch(workdir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start the CLI in its own process group (as a scheduler would), output to files in ``workdir``."""
    n = len(list(workdir.glob("launch-*.err")))
    out, err = open(workdir / f"launch-{n}.out", "w"), open(workdir / f"launch-{n}.err", "w")
    return start_fit(workdir, *args, env=env, start_new_session=True, stdout=out, stderr=err)


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the launch ended (rc {proc.returncode}) before the moment to kill it"
        assert time.monotonic() < deadline, "timed out waiting for the moment to kill"
        time.sleep(0.05)


def mlflow_run_exists(workdir: Path, experiment: str = "digits") -> Callable[[], bool]:
    def check() -> bool:
        try:
            return bool(runs_of(workdir, experiment))
        except Exception:  # the store is being created
            return False
    return check


def kill_group(proc: subprocess.Popen, sig: int) -> int:
    os.killpg(proc.pid, sig)
    return proc.wait(timeout=120)


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``signum`` (the kernel's ``SigCgt`` mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    raise AssertionError(f"/proc/{pid}/status has no SigCgt line")




def statuses(workdir: Path, experiment: str = "digits") -> list[tuple[str, str]]:
    return sorted((r.info.run_name, r.info.status) for r in runs_of(workdir, experiment))


def stderr_lines(result: subprocess.CompletedProcess | CliResult) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


# ----------------------------------------------------------------- 1. kills before the first checkpoint
_KILLED_BEFORE_FIRST_CHECKPOINT = ("tests/e2e/test_run_integrity.py::"
                                   "test_kill_after_run_creation_before_first_checkpoint_keeps_one_run")


@pytest.mark.parametrize(("strategy", "sig"), [
    ("single", signal.SIGKILL),
    pytest.param("single", signal.SIGTERM,
                 marks=pytest.mark.slow(covered_by=f"{_KILLED_BEFORE_FIRST_CHECKPOINT}[single-9]")),
    ("ddp", signal.SIGKILL),
    pytest.param("ddp", signal.SIGTERM, marks=pytest.mark.slow(covered_by=f"{_KILLED_BEFORE_FIRST_CHECKPOINT}[ddp-9]")),
])
def test_kill_after_run_creation_before_first_checkpoint_keeps_one_run(tmp_path: Path, strategy: str,
                                                                       sig: int) -> None:
    args = (*SHORT, *(DDP if strategy == "ddp" else ()), "--run_name", "k")
    proc = launch(tmp_path, *args)
    wait_for(mlflow_run_exists(tmp_path), proc)  # the MLflow run exists; no checkpoint yet
    assert not ckpt_store.candidates(tmp_path / "runs/digits/k/checkpoints")
    code = kill_group(proc, sig)
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL
    elif strategy == "single":  # stopped in an orderly way: marked KILLED, exit 75
        assert code == REQUEUE_EXIT_CODE
        assert statuses(tmp_path) == [("k", "KILLED")]
    else:  # DDP: a rank killed while the ranks meet makes Lightning SIGKILL the others (RUNNING until relaunched)
        assert code in (REQUEUE_EXIT_CODE, -signal.SIGKILL)
        # an orderly stop marks the run KILLED; after the launcher's SIGKILL nothing could mark it
        assert statuses(tmp_path) == [("k", "KILLED" if code == REQUEUE_EXIT_CODE else "RUNNING")]
    run_fit(tmp_path, *args, check=True)
    assert statuses(tmp_path) == [("k", "FINISHED")]


@pytest.mark.parametrize("moment", ["before-handlers", "after-handlers"])
def test_kill_in_the_first_second_then_relaunch(tmp_path: Path, moment: str) -> None:
    """A SIGTERM in the launch's first second, at a moment the test holds the process at: before the CLI installs
    its stop handlers (``recipes.run.process.install_stop_signals``) SIGTERM's default action ends it (-15, nothing
    written); after, the CLI unwinds, says so in one line and asks to be relaunched (75), no run left RUNNING.
    Either way the relaunch finishes the one run."""
    proc = launch(tmp_path, *SHORT, "--run_name", "k")
    if moment == "after-handlers":  # the kernel's view of the process: its SIGTERM handler is in place
        wait_for(lambda: catches(proc.pid, signal.SIGTERM), proc, timeout=60)
    with frozen(proc):  # held still: the handler state read below is the one the signal meets
        assert catches(proc.pid, signal.SIGTERM) == (moment == "after-handlers")
        os.killpg(proc.pid, signal.SIGTERM)
    code = proc.wait(timeout=120)
    err = (tmp_path / "launch-0.err").read_text()
    if moment == "before-handlers":
        assert code == -signal.SIGTERM, err[-3000:]
        assert statuses(tmp_path) == []
    else:
        assert code == REQUEUE_EXIT_CODE, err[-3000:]
        assert "interrupted (SIGTERM): the run stopped; relaunch the same command to resume it." in err.splitlines()
        assert "Traceback" not in err
        assert statuses(tmp_path) in ([], [("k", "KILLED")])  # stopped before or after its run was opened
    run_fit(tmp_path, *SHORT, "--run_name", "k", check=True)
    assert statuses(tmp_path) == [("k", "FINISHED")]


# ---------------------------------------------------------------------------------- 2. double launches
def test_second_launch_of_a_live_run_is_refused(tmp_path: Path, fit_in_process: Callable[..., CliResult]) -> None:
    args = (*SHORT, "--trainer.max_epochs", "200", "--run_name", "twice")  # long enough to be live throughout
    first = launch(tmp_path, *args)
    lock = tmp_path / "runs/digits/twice" / LOCK_NAME
    wait_for(lambda: lock.exists() and bool(lock.read_text()), first)
    wait_for(mlflow_run_exists(tmp_path), first)  # and its MLflow run is open: the one the relaunch must not touch
    second = fit_in_process(*args)
    assert first.poll() is None  # the first one was live during the whole second launch
    assert second.returncode == 2
    (line,) = stderr_lines(second)
    assert line.startswith("error: run digits/twice is already running (host ")
    assert f"{socket.gethostname()}, pid {first.pid}, since " in line
    assert kill_group(first, signal.SIGTERM) == REQUEUE_EXIT_CODE
    assert statuses(tmp_path) == [("twice", "KILLED")]  # one run: the second launch opened none


def test_a_lock_left_by_a_dead_process_does_not_block(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs/digits/stale"
    run_dir.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (run_dir / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout)}))
    run_fit(tmp_path, *SHORT, "--run_name", "stale", check=True)
    assert statuses(tmp_path) == [("stale", "FINISHED")]


# ----------------------------------------------------------------------- 3. a new sqlite store, raced
#: Launches a test may start to catch its moment (a kill inside a window of a few seconds) before it fails.
MOMENT_TRIES = 5


def fresh_store_env(workdir: Path) -> dict[str, str]:
    env = cli_env(workdir)
    (workdir / "mlflow.db").unlink()  # cli_env seeds a migrated store: these tests start without one
    return env


def test_eight_runs_started_at_once_on_a_new_store_all_finish(tmp_path: Path) -> None:
    env = fresh_store_env(tmp_path)
    procs = [launch(tmp_path, *SHORT, "--trainer.max_steps", "3", "--run_name", f"r{i}", env=env) for i in range(8)]
    codes = [p.wait(timeout=600) for p in procs]
    errors = [(tmp_path / f"launch-{i}.err").read_text()[-2000:] for i, c in enumerate(codes) if c != 0]
    assert codes == [0] * 8, errors
    assert statuses(tmp_path) == [(f"r{i}", "FINISHED") for i in range(8)]
    assert not list(tmp_path.glob(".mlflow.db.creating-*"))


def migrating(workdir: Path) -> list[Path]:
    """The journals of the temporary stores being migrated in ``workdir`` (one exists while a write is open)."""
    return list(workdir.glob(".mlflow.db.creating-*-journal"))


def store_made(workdir: Path) -> bool:
    """Whether the store exists under its real name and no temporary one is left: its making is over."""
    return (workdir / "mlflow.db").exists() and not list(workdir.glob(".mlflow.db.creating-*"))


def test_a_kill_while_the_new_store_is_migrated_leaves_a_usable_store(tmp_path: Path) -> None:
    """A SIGKILL that lands inside MLflow's migration of a new store (one of its write transactions open on the
    temporary database: its journal exists) leaves no store under the real name, only the temporary one's debris;
    the relaunch clears the debris, makes the store whole and finishes the run."""
    for attempt in range(MOMENT_TRIES):
        workdir = tmp_path / f"launch{attempt}"  # a new folder, a new store, for each try
        workdir.mkdir()
        store, env = workdir / "mlflow.db", fresh_store_env(workdir)
        proc = launch(workdir, *SHORT, "--run_name", "m", env=env)
        journals: list[Path] = []
        while not journals:
            wait_for(lambda w=workdir: bool(migrating(w)) or store_made(w), proc)
            with frozen(proc):  # the migration holds still while the test looks at it, and the kill meets that
                journals = migrating(workdir)
                if journals:
                    os.killpg(proc.pid, signal.SIGKILL)
                elif store_made(workdir):
                    break
        if not journals:  # a miss: the store was made before a look found one of its writes open
            os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=120) == -signal.SIGKILL
        if journals:
            break
    else:
        pytest.fail(f"no kill landed inside the store's migration in {MOMENT_TRIES} launches")
    assert not store.exists()  # never a half-migrated store under the real name
    (journal,) = journals
    assert journal.exists() and Path(str(journal).removesuffix("-journal")).exists()  # the dead launch's debris
    run_fit(workdir, *SHORT, "--run_name", "m", env=env, check=True)
    assert statuses(workdir) == [("m", "FINISHED")]
    assert {e.name for e in client_for(workdir).search_experiments()} == {"Default", "digits"}
    assert not list(workdir.glob(".mlflow.db.creating-*"))  # the dead launch's debris was cleared


# --------------------------------------------------------------------- 4. a changed config on resume
def test_a_resume_that_would_ignore_a_changed_config_is_refused(tmp_path: Path) -> None:
    run_fit(tmp_path, *SHORT, "--run_name", "c", check=True)
    # a real process: the refused launch held the run's lock, which its exit releases
    changed = run_fit(tmp_path, *SHORT, "--run_name", "c", "--trainer.max_epochs", "2",
                      "--model.init_args.optimizer.init_args.lr", "0.01")
    assert changed.returncode == 2
    (line,) = [line for line in stderr_lines(changed) if line.startswith("error:")]
    assert len(stderr_lines(changed)) <= 2  # the error, and the "Resuming from" line it was about
    assert "model.init_args.optimizer.init_args.lr (0.003 -> 0.01)" in line
    assert "--fresh true" in line and "--run_name" in line
    assert statuses(tmp_path) == [("c", "FINISHED")]
    # a change that takes effect on resume (more epochs) is applied and recorded
    run_fit(tmp_path, *SHORT, "--run_name", "c", "--trainer.max_epochs", "2", check=True)
    (run,) = runs_of(tmp_path, "digits")
    assert run.data.tags["config_changed.trainer.max_epochs"] == "2"
    assert run.info.status == "FINISHED"
    record = ckpt_store.newest_good(tmp_path / "runs/digits/c/checkpoints", CHECKPOINT_PATTERN)
    assert record is not None and record.epoch == 1  # the second epoch ran


# ------------------------------------------------------------------------ 5. bad checkpoint inputs
@pytest.fixture(scope="module")
def source_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with one finished run, ``src`` (its MLflow store and run directory), trained once for the module."""
    workdir = tmp_path_factory.mktemp("source-run")
    run_fit(workdir, *SHORT, "--run_name", "src", check=True)
    return workdir


def _finished_run(source: Path, workdir: Path) -> Path:
    """A copy of ``source``'s finished run in ``workdir``; the path of its newest good checkpoint there."""
    for name in ("mlflow.db", "runs"):
        (shutil.copytree if (source / name).is_dir() else shutil.copy)(source / name, workdir / name)
    record = ckpt_store.newest_good(workdir / "runs/digits/src/checkpoints", CHECKPOINT_PATTERN)
    assert record is not None
    return record.path


@pytest.mark.parametrize("kind", ["text", "truncated", "truncated-with-record"])
def test_a_bad_ckpt_path_is_one_line_and_exit_2(source_run: Path, tmp_path: Path, kind: str,
                                               fit_in_process: Callable[..., CliResult]) -> None:
    good = _finished_run(source_run, tmp_path)
    bad = tmp_path / "bad.ckpt"
    if kind == "text":
        bad.write_text("this is not a checkpoint\n")
    else:
        bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
        if kind == "truncated-with-record":
            shutil.copy(ckpt_store.meta_path(good), ckpt_store.meta_path(bad))
    result = fit_in_process(*SHORT, "--run_name", "bad", "--ckpt_path", str(bad))
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in stderr_lines(result) if line.startswith("error:")]
    assert len(errors) == 1 and str(bad) in errors[0]
    assert "Traceback" not in result.stderr
    assert len(stderr_lines(result)) <= 3
    assert statuses(tmp_path) == [("src", "FINISHED")]  # no run opened for "bad"
    assert ckpt_store.read_record(good) is not None


@pytest.fixture
def small_mount(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Mount real tmpfs filesystems under ``tmp_path`` (root only); unmounted afterwards."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        target = tmp_path / f"mnt{len(mounted)}"
        target.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True,
                                text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}): needs root")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        subprocess.run(["umount", "-l", str(target)], check=False)


def test_a_read_only_runs_root_is_one_line_and_exit_2(tmp_path: Path, small_mount: Callable[[str], Path],
                                                      fit_in_process: Callable[..., CliResult]) -> None:
    root = small_mount("ro,size=1m")
    result = fit_in_process(*SHORT, "--run_name", "ro", "--runs_root", str(root))
    assert result.returncode == 2
    (line,) = stderr_lines(result)
    assert line.startswith(f"error: --runs_root {root}: cannot write the run directory")
    assert "Read-only file system" in line
    assert statuses(tmp_path) == []


# ----------------------------------------------------------------------------------- 6. a full disk
def test_a_full_disk_during_a_checkpoint_keeps_the_last_one_and_resumes_exactly(
        tmp_path: Path, small_mount: Callable[[str], Path]) -> None:
    args = (*SHORT, "--trainer.max_epochs", "2", "--spot.every_n_steps", "10", "--trainer.log_every_n_steps", "1")
    reference = tmp_path / "ref"
    reference.mkdir()
    run_fit(reference, *args, "--run_name", "disk", check=True)

    root = small_mount("size=64m")
    work = tmp_path / "work"
    work.mkdir()
    checkpoints = root / "digits/disk/checkpoints"
    proc = launch(work, *args, "--run_name", "disk", "--runs_root", str(root))
    wait_for(lambda: any(p.name.startswith("step=") for p in ckpt_store.candidates(checkpoints)), proc)
    with open(root / "filler", "wb") as filler:  # take every byte left
        try:
            while True:
                filler.write(b"\0" * 65536)
                filler.flush()
        except OSError:
            pass
    assert proc.wait(timeout=300) == 1
    err = (work / "launch-0.err").read_text()
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "No space left on device" in lines[0] and "previous checkpoints are intact" in lines[0]
    assert "Traceback" not in err
    assert statuses(work) == [("disk", "FAILED")]
    kept = ckpt_store.newest_good(checkpoints, CHECKPOINT_PATTERN)
    assert kept is not None and not list(checkpoints.glob(".*.tmp-*"))

    (root / "filler").unlink()
    run_fit(work, *args, "--run_name", "disk", "--runs_root", str(root), check=True)
    assert statuses(work) == [("disk", "FINISHED")]

    def final(directory: Path) -> dict[str, torch.Tensor]:
        record = ckpt_store.newest_good(directory, CHECKPOINT_PATTERN)
        assert record is not None
        return torch.load(record.path, map_location="cpu", weights_only=True)["state_dict"]

    a, b = final(reference / "runs/digits/disk/checkpoints"), final(checkpoints)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------- 8. secrets in URLs
SECRET = "s3cr3t-PASSWORD"


def test_a_password_in_a_url_reaches_no_file_param_tag_artifact_or_message(tmp_path: Path) -> None:
    result = run_fit(tmp_path, *SHORT, "--run_name", "sec", "--spot.metadata_url",
                     f"http://user:{SECRET}@127.0.0.1:9/", check=True)
    assert SECRET not in result.stdout + result.stderr
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.suffix in (".yaml", ".json", ".txt", ".log", ""):
            assert SECRET.encode() not in path.read_bytes(), path
    (run,) = runs_of(tmp_path, "digits")
    assert "user:***@127.0.0.1" in run.data.params["spot.metadata_url"]
    assert not [k for k, v in {**run.data.params, **run.data.tags}.items() if SECRET in v]
    assert "user:***@" in (tmp_path / "runs/digits/sec/config.yaml").read_text()


def test_a_password_in_the_tracking_uri_is_never_printed(fit_in_process: Callable[..., CliResult]) -> None:
    port = free_port()
    result = fit_in_process(*SHORT, "--run_name", "sec", MLFLOW_TRACKING_URI=f"http://alice:{SECRET}@127.0.0.1:{port}")
    assert result.returncode == 2
    (line,) = stderr_lines(result)
    assert line == f"error: MLflow tracking server http://127.0.0.1:{port} is unreachable ([Errno 111] Connection " \
                   "refused); start it or fix MLFLOW_TRACKING_URI."
