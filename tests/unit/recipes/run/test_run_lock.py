"""RunLock: one holder per run directory, its identity in the refusal, released with the process."""

from __future__ import annotations

import json
import os
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


def test_a_read_only_directory_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        RunLock(Path("/proc/atscale-cannot-exist")).acquire()
