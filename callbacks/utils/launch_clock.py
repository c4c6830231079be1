"""When this launch started: the moment a run's bill begins.

A cloud bills a machine from its boot, and a job from its own start: for a run, that is when the training
command started, imports included. The process's own spawn time (Linux ``/proc``) is not always that: a shell
that ``exec``s its last command (``bash -c 'pip install -e . && python -m recipes.fit ...'``, a Dockerfile's or a
launcher's ``run:`` line) hands the process over with the *shell's* start time, so the bill would include the
install or whatever else the shell did first.

So the entry point marks its start (:func:`mark_launch`, the first thing ``python -m recipes.fit`` does, before it
imports torch) in the environment, with its process id; :func:`launch_age_s` believes a mark made by this process
or by its parent (the launching process of Lightning's DDP ranks, which inherit the mark), and falls back to the
process's spawn time otherwise (a rank of torchrun or SLURM, a script of a user's own). A mark inherited from
any other ancestor (a sweep or a notebook that starts the command as a child) is ignored: that child marks its own.
No library keeps such a mark; hence this module.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["ENV_LAUNCHED_AT", "launch_age_s", "mark_launch", "process_age_s"]

#: ``"<pid> <wall-clock seconds>"``: the process that started the launch, and when.
ENV_LAUNCHED_AT = "ATSCALE_LAUNCHED_AT"


def mark_launch(at: float | None = None) -> None:
    """Record that a launch starts now (or at wall time ``at``) in this process; its child ranks inherit it."""
    os.environ[ENV_LAUNCHED_AT] = f"{os.getpid()} {time.time() if at is None else at!r}"


def process_age_s() -> float | None:
    """Seconds since this process was spawned (Linux ``/proc``), or None where that cannot be read."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, counted from after the name
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - started)


def launch_age_s() -> float | None:
    """Seconds since this launch started: its mark (this process's or its launcher's), else the process's spawn."""
    mark = os.environ.get(ENV_LAUNCHED_AT, "").split()
    if len(mark) == 2 and mark[0].isdigit() and int(mark[0]) in (os.getpid(), os.getppid()):
        try:
            return max(0.0, time.time() - float(mark[1]))
        except ValueError:
            pass
    return process_age_s()
