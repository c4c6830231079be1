"""Kineto's C++ lines on CPU (issue 17 item 2): ``callbacks.utils.profiler.quiet_cpu_profiler``.

Two gloo processes profile a step the way ``StepTiming`` samples FSDP collectives (torch.profiler, CPU
activities, ``key_averages``), once as today and once with the helper called first; their stderr is read.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from callbacks.utils.profiler import quiet_cpu_profiler

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
NOISE = ("gpuGetDeviceCount failed", "USDT:", "SyncActivityProfilerHandler")

SCRIPT = r'''
import sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

def rank(r):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=r, world_size=2)
    if sys.argv[1] == "quiet":
        from callbacks.utils.profiler import quiet_cpu_profiler
        quiet_cpu_profiler()
    for _ in range(2):  # StepTiming profiles a few steps, each in its own session
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = torch.ones(4)
            dist.all_reduce(t)
        gloo = [e.key for e in prof.key_averages() if e.key.lower().startswith("gloo:")]
        assert gloo and t.tolist() == [2.0] * 4, (gloo, t)
    # as recipes.fit ends: the interpreter's teardown past a gloo group sometimes aborts a process ("terminate
    # called without an active exception"), which is not what this test is about
    from recipes.run.shutdown import destroy_process_group, exit_process
    destroy_process_group()
    exit_process(0)

if __name__ == "__main__":
    mp.spawn(rank, nprocs=2)
    print("ok")
'''


def run_two_ranks(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    from tests.servers import free_port

    script = tmp_path / "two_ranks.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(script), mode, str(free_port())], env=env, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the lines are those of a machine without CUDA")
def test_two_process_cpu_profiling_prints_no_kineto_lines(tmp_path: Path) -> None:
    loud = run_two_ranks(tmp_path, "as-today")
    assert loud.returncode == 0 and loud.stdout.strip() == "ok", loud.stderr[-3000:]
    # the lines this fixes: 2 ranks x 2 sessions x (profiler_start, profiler_stop), gpuGetDeviceCount once a rank
    # (counted as substrings: the two ranks write to one pipe, and a line of one may land inside the other's)
    lines = ("] profiler_start", "] profiler_stop", "gpuGetDeviceCount failed with code 35")
    counts = [loud.stderr.count(line) for line in lines]
    assert counts == [4, 4, 2], loud.stderr
    quiet = run_two_ranks(tmp_path, "quiet")
    assert quiet.returncode == 0 and quiet.stdout.strip() == "ok", quiet.stderr[-3000:]
    assert [line for line in quiet.stderr.splitlines() if any(n in line for n in NOISE)] == []


def test_quiet_only_where_there_is_no_gpu_and_no_user_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert quiet_cpu_profiler() is False and "KINETO_LOG_LEVEL" not in os.environ
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("KINETO_LOG_LEVEL", "0")  # the user wants Kineto's verbose log
    assert quiet_cpu_profiler() is False and os.environ["KINETO_LOG_LEVEL"] == "0"
    monkeypatch.delenv("KINETO_LOG_LEVEL")
    assert quiet_cpu_profiler() is True and os.environ["KINETO_LOG_LEVEL"] == "6"
