"""RunLock: one holder per run directory, its identity in the refusal, released with the process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.run.lock import LOCK_NAME, RunLock, RunLocked


def test_second_holder_is_refused_with_the_first_ones_identity(tmp_path: Path) -> None:
    first = RunLock(tmp_path / "run")
    first.acquire()
    holder = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid()
    with pytest.raises(RunLocked) as refused:
        RunLock(tmp_path / "run").acquire()
    assert str(refused.value).startswith(f"host {socket.gethostname()}, pid {os.getpid()}, since ")
    first.release()
    again = RunLock(tmp_path / "run")
    again.acquire()
    assert again.held
    again.release()


def test_the_lock_dies_with_its_process(tmp_path: Path) -> None:
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from recipes.run.lock import RunLock; "
            "lock = RunLock(sys.argv[2]); lock.acquire(); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(Path(__file__).resolve().parents[4]), str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked, match=f"pid {proc.pid}"):
            RunLock(tmp_path).acquire()
    finally:
        proc.kill()
        proc.wait()
    lock = RunLock(tmp_path)
    lock.acquire()  # the killed holder's lock is gone with it
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_worker_forked_by_the_holder_does_not_keep_the_lock_after_the_holder_dies(tmp_path: Path) -> None:
    """A dataloader worker forked by the run inherits the lock's descriptor: filelock closes it in the child, so the
    holder's SIGKILL still frees the run while the worker lives on (an inherited flock held it before)."""
    code = ("import os, sys, time; sys.path.insert(0, sys.argv[1]); from recipes.run.lock import RunLock; "
            "lock = RunLock(sys.argv[2]); lock.acquire(); worker = os.fork()\n"
            "if worker == 0: time.sleep(60); os._exit(0)\n"
            "print(worker, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(Path(__file__).resolve().parents[4]), str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    worker = 0
    try:
        assert proc.stdout is not None
        worker = int(proc.stdout.readline())
        proc.kill()
        proc.wait()
        assert Path(f"/proc/{worker}").exists()  # the worker outlives the holder
        lock = RunLock(tmp_path)
        lock.acquire()
        lock.release()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if worker:
            os.kill(worker, signal.SIGKILL)


def test_a_read_only_directory_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        RunLock(Path("/proc/atscale-cannot-exist")).acquire()


def test_release_leaves_no_lock_file_and_no_folder_it_made(tmp_path: Path) -> None:
    lock = RunLock(tmp_path / "runs" / "exp" / "run")
    lock.acquire()
    assert (tmp_path / "runs" / "exp" / "run" / LOCK_NAME).exists()
    lock.release()
    assert list(tmp_path.iterdir()) == []  # runs/exp/run were this lock's: gone again


def test_release_keeps_folders_that_hold_anything_else(tmp_path: Path) -> None:
    (tmp_path / "runs" / "exp" / "other").mkdir(parents=True)
    lock = RunLock(tmp_path / "runs" / "exp" / "run")
    lock.acquire()
    (lock.run_dir / "config.yaml").write_text("x")  # the run wrote its files
    lock.release()
    assert sorted(p.name for p in lock.run_dir.iterdir()) == ["config.yaml"]
    assert (tmp_path / "runs" / "exp" / "other").is_dir()


def test_a_lock_file_removed_while_being_opened_is_not_held_twice(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """B opens the lock file, A (the holder) removes it and lets go, B's flock then wins the orphaned file: B must
    see that and lock the file at the path instead, else B and a third launch C would both hold the run."""
    first = RunLock(tmp_path)
    first.acquire()
    stale = os.open(tmp_path / LOCK_NAME, os.O_RDWR)  # B opens it, before A releases
    first.release()
    real_open, handed = os.open, []

    def open_stale_first(path: str, flags: int, *args: int, **kwargs: int) -> int:
        if not handed and Path(path) == tmp_path / LOCK_NAME:
            handed.append(stale)
            return stale
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_stale_first)
    second = RunLock(tmp_path)
    second.acquire()
    assert handed == [stale]  # B did open the orphan first
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()  # and holds the file in its place
    third = RunLock(tmp_path)
    with pytest.raises(RunLocked):
        third.acquire()
    second.release()
