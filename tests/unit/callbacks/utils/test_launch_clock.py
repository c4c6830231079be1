"""When a launch started: its own mark, not the start of a shell that exec'd it; a stale mark is not believed."""

from __future__ import annotations

import os
import subprocess
import sys

from callbacks.utils import launch_clock
from callbacks.utils.launch_clock import ENV_LAUNCHED_AT, launch_age_s, mark_launch
from tests.conftest import REPO

# A shell sleeps 1 s, then exec's Python as its last command: the process keeps the shell's pid and start time.
PROBE = ("from callbacks.utils.launch_clock import launch_age_s, mark_launch, process_age_s; "
         "spawn = process_age_s(); mark_launch(); print(spawn, launch_age_s())")


def test_a_process_a_shell_execd_is_billed_from_its_own_start_not_the_shells() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(ENV_LAUNCHED_AT, None)
    out = subprocess.run(["bash", "-c", f"sleep 1 && exec {sys.executable} -c '{PROBE}'"], env=env, check=True,
                         capture_output=True, text=True, timeout=60).stdout.split()
    spawn, launch = float(out[0]), float(out[1])
    assert spawn >= 1.0  # /proc's start time is the shell's: the sleep is in it
    assert 0.0 <= launch < 0.5  # the mark is this launch's own


def test_a_mark_of_this_process_or_its_launcher_is_believed_and_any_other_is_not(monkeypatch) -> None:
    monkeypatch.setattr(launch_clock.time, "time", lambda: 1000.0)
    monkeypatch.setattr(launch_clock, "process_age_s", lambda: 77.0)
    monkeypatch.setenv(ENV_LAUNCHED_AT, "")  # put back after the test: mark_launch writes the environment
    mark_launch(at=990.0)
    assert launch_age_s() == 10.0
    monkeypatch.setenv(ENV_LAUNCHED_AT, f"{os.getppid()} 995.5")  # Lightning's launcher, for the ranks it starts
    assert launch_age_s() == 4.5
    monkeypatch.setenv(ENV_LAUNCHED_AT, f"{os.getpid() + 100000} 900.0")  # a sweep's or a notebook's, inherited
    assert launch_age_s() == 77.0
    monkeypatch.setenv(ENV_LAUNCHED_AT, "garbage")
    assert launch_age_s() == 77.0
    monkeypatch.setenv(ENV_LAUNCHED_AT, f"{os.getpid()} 1005.0")  # a clock stepped back: never negative
    assert launch_age_s() == 0.0
