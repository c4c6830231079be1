"""One launch of ``python -m recipes.fit`` under the soak: its process group, and what its output says.

:class:`Launch` is the process and the record of it; the parsers read the lines the CLI prints (its resume
decision, a run already complete, the last error) and the faulthandler dump a hung launch leaves, so that the
soak judges a launch from what a user would see of it.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

_RESUME = re.compile(r"Resuming from (\S+) \(step (\d+)")
_COMPLETE = re.compile(r"is already complete \(finished at step (\d+)")


@dataclass
class Launch:
    """One ``python -m recipes.fit`` process (group) and what it left behind."""

    label: str
    run_name: str
    extra: list[str]
    started: float  # time.time() at start
    expected_resume: list[Any] | None  # [checkpoint name, step] that verified when it started; None: none did
    out: str
    err: str
    t0: float = field(default=0.0, repr=False)
    proc: subprocess.Popen | None = field(default=None, repr=False)
    exit_code: int | None = None
    wall_s: float | None = None
    hung: bool = False
    hung_where: str = ""  # hung: where its threads were (hung_where)
    signals: list[list[Any]] = field(default_factory=list)  # [signal name, seconds from start]
    resumed_from: int | None = None  # step of its "Resuming from" line
    resumed_path: str | None = None
    decided: bool = False  # printed a resume line, or trained (from step 0 then)
    first_step_s: float | None = None  # start -> first train/loss logged
    furthest_step: int | None = None  # steps completed by the furthest train/loss it logged
    # SIGKILLed: the most steps it can have completed past furthest_step (losses still in MLflow's queue); None: unknown
    unlogged_max: int | None = 0
    traceback: bool = False
    error_line: str | None = None
    skipped_corrupt: list[str] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, sig: signal.Signals) -> None:
        """Signal the launch's process group (only while its leader is unreaped: the group id is then its own)."""
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
            self.signals.append([sig.name, round(self.elapsed(), 3)])
        except ProcessLookupError:
            pass

    def wait(self, timeout: float) -> bool:
        """Wait for the exit up to ``timeout`` s; True if it exited."""
        assert self.proc is not None
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def stderr(self) -> str:
        try:
            return Path(self.err).read_text(errors="replace")
        except OSError:
            return ""

    def record(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("t0", "proc")}


def unlogged_bound(steps: list[tuple[int, int]], end_s: float) -> int | None:
    """The most optimizer steps a launch can have completed after its last logged loss and before ``end_s``.

    ``steps`` are its logged ``(step, timestamp ms)`` losses in time order; the pace is the fastest between two
    consecutive logged losses (at least a millisecond a step: the timestamps' resolution). None with fewer than two
    losses: no pace to go by. A SIGKILL drops the losses still queued for the store, so the history alone
    undercounts the steps a killed launch ran; this bounds by how much.
    """
    if len(steps) < 2:
        return None
    paces = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in itertools.pairwise(steps) if s1 > s0]
    if not paces:
        return None
    gap_ms = max(end_s * 1000 - steps[-1][1], 0.0)
    return math.ceil(gap_ms / max(min(paces), 1.0))


def last_error(stderr: str) -> str:
    """The last ``SomeError: message`` line of a traceback (or the last line), for one-line reports."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit): ", line)]
    return (errors or lines or [""])[-1][:240]


_THREAD_DUMP = re.compile(
    r"^(Current thread|Thread) 0x[0-9a-f]+[^\n]*\(most recent call first\):\n((?:  File [^\n]*\n?)*)", re.MULTILINE)
_FRAME = re.compile(r'  File "([^"]+)", line (\d+) in (\S+)')


#: What a launch's exit watch prints before it ends a process whose exit hangs (recipes.run.shutdown).
EXIT_WATCH_LINE = "error: the process did not finish exiting within"


def hung_where(stderr: str, frames: int = 4) -> str:
    """Where each thread of a hung launch was, from the faulthandler dump SIGABRT made: one line per thread.

    The current thread (the one the signal interrupted, the main thread in practice) comes first; each line lists
    its innermost ``frames`` frames as ``file:line in function``, innermost first. Empty when there is no dump.
    """
    lines = []
    for match in _THREAD_DUMP.finditer(stderr):
        calls = [f"{'/'.join(Path(file).parts[-2:])}:{line} in {func}"
                 for file, line, func in _FRAME.findall(match.group(2))[:frames]]
        label = "current thread" if match.group(1) == "Current thread" else "thread"
        lines.append(f"{label}: {' < '.join(calls) or '(no Python frames)'}")
    return "\n".join(sorted(lines, key=lambda line: not line.startswith("current")))


def parse_resume(stderr: str) -> tuple[str, int] | None:
    """``(checkpoint, step)`` of the CLI's "Resuming from X (step N" line, or None."""
    match = _RESUME.search(stderr)
    return (match.group(1), int(match.group(2))) if match else None


def parse_complete(output: str) -> tuple[str, int] | None:
    """``("<complete>", step)`` when the CLI said the run had already finished (it then trains nothing)."""
    match = _COMPLETE.search(output)
    return ("<complete>", int(match.group(1))) if match else None
