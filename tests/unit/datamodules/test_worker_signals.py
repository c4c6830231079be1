"""Loader workers outlive a notice sent to the whole process group; a worker that really dies still fails the run.

Each case runs a real resumable loader with 2 workers in a new session (so that the group signal reaches no pytest
process), sends the signal to that whole group mid-pass, and reads what the main process saw.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from datamodules.worker_signals import NOTICE_SIGNALS, notices_blocked
from tests.conftest import REPO

# The main process takes the notice as the callbacks do (a flag), and goes on reading the pass to its end.
SCRIPT = r"""
import json, os, signal, sys, time
import torch
from torch.utils.data import Dataset
from datamodules.loaders import stateful_train_loader

class Slow(Dataset):
    def __len__(self): return 64
    def __getitem__(self, i):
        time.sleep(0.02)
        return torch.tensor([float(i)])

noticed = []
for name in ("SIGTERM", "SIGINT", "SIGUSR1"):
    signal.signal(getattr(signal, name), lambda signum, frame: noticed.append(signal.Signals(signum).name))
loader = stateful_train_loader(Slow(), 4, seed=0, trainer=None, num_workers=2)
seen = []
for batch in loader:
    seen += batch.flatten().long().tolist()
    if len(seen) in (8, 24, 40):
        print("READY", flush=True)  # the test signals the group now
        time.sleep(0.5)
print(json.dumps({"samples": sorted(seen), "noticed": noticed}), flush=True)
"""


def run_loader_and_signal(signums: list[int], whole_group: bool) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Start the loader; at each of its pauses send the next signal (to the whole group, or to one worker)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    assert proc.stdout is not None
    try:
        for signum in signums:
            assert proc.stdout.readline().strip() == "READY"
            if whole_group:
                os.killpg(proc.pid, signum)
            else:  # one worker, as the OOM killer picks it
                worker = next(int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split())
                os.kill(worker, signum)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    last = out.strip().splitlines()[-1] if out.strip() else ""
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return result, json.loads(last) if last.startswith("{") else None


def test_notices_to_the_whole_group_reach_the_main_process_and_no_worker_dies() -> None:
    """SIGTERM, SIGUSR1 and SIGINT in turn, each to the whole group, in one pass (one process: the suite's time)."""
    result, outcome = run_loader_and_signal([signal.SIGTERM, signal.SIGUSR1, signal.SIGINT], whole_group=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "killed by signal" not in result.stderr and "Traceback" not in result.stderr
    # the pass whole, each notice taken once, by the main process
    assert outcome == {"samples": list(range(64)), "noticed": ["SIGTERM", "SIGUSR1", "SIGINT"]}


def test_a_worker_that_really_dies_still_ends_the_pass_loudly() -> None:
    result, outcome = run_loader_and_signal([signal.SIGKILL], whole_group=False)
    assert result.returncode == 1 and outcome is None
    assert "DataLoader worker (pid" in result.stderr and "is killed by signal: Killed" in result.stderr


def test_a_notice_while_workers_are_forked_waits_for_the_block_to_end() -> None:
    noticed: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: noticed.append(signum))
    try:
        with notices_blocked():
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
            time.sleep(0.05)
            assert noticed == []  # held back in the thread that forks
            child = os.fork()
            if child == 0:  # a worker forked now starts with the notices held back until it ignores them
                os._exit(0 if set(NOTICE_SIGNALS) <= signal.pthread_sigmask(signal.SIG_BLOCK, []) else 1)
        assert os.waitpid(child, 0)[1] == 0
        for _ in range(100):  # delivered at the unblock; Python runs the handler at its next check
            if noticed:
                break
            time.sleep(0.01)
        assert noticed == [signal.SIGUSR1]
        assert signal.SIGUSR1 not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    finally:
        signal.signal(signal.SIGUSR1, previous)
