"""A one-line file beside the checkpoints holding how many optimizer steps a run has executed.

CostTracker bills the work a hard kill (SIGKILL, a lost machine) threw away: steps run beyond the
checkpoint a relaunch resumes from. Checkpoints cannot say that (they are older than the kill), so
the count is rewritten in place after every step, a fixed-width ``pwrite`` at offset 0: no new file,
no rename, a few microseconds, and a reader never sees a torn number.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

__all__ = [
    "FIRST_LAUNCH_FILE", "PROGRESS_FILE", "StepsFile", "read_first_launch", "read_steps_run", "write_first_launch",
]

log = logging.getLogger(__name__)

#: The file's name, in the run's checkpoint directory (uploaded with the run's files to object storage).
PROGRESS_FILE = "cost_steps_run.txt"
_WIDTH = 20


def read_steps_run(path: Path) -> int | None:
    """The steps run recorded in a steps file, or None when it is missing or unreadable."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


class StepsFile:
    """The open steps file of one fit; a file that cannot be written is warned about once and skipped."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / PROGRESS_FILE
        self._fd: int | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        except OSError as err:
            log.warning("CostTracker: cannot write %s (%s); lost work after a hard kill will not be counted.",
                        self.path, err)

    def write(self, steps_run: int) -> None:
        """Record ``steps_run`` (in place)."""
        if self._fd is not None:
            os.pwrite(self._fd, f"{steps_run:>{_WIDTH}d}\n".encode(), 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


#: The first launch's start of a run that has no checkpoint yet, beside the steps file: a relaunch that finds it
#: bills the launches that died before any checkpoint (their time, and the gap since, as a restart).
FIRST_LAUNCH_FILE = "cost_first_launch.txt"


def read_first_launch(directory: Path) -> tuple[float, str] | None:
    """``(wall-clock start, MLflow run id or "")`` of the run's first launch, or None when not recorded."""
    try:
        started, _, run_id = (Path(directory) / FIRST_LAUNCH_FILE).read_text().strip().partition(" ")
        return float(started), run_id.strip()
    except (OSError, ValueError):
        return None


def write_first_launch(directory: Path, started: float, run_id: str | None) -> None:
    """Record the first launch's start (and the MLflow run it logs to); warned about, never raised, when unwritable."""
    path = Path(directory) / FIRST_LAUNCH_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{started!r} {run_id or ''}\n")
    except OSError as err:
        log.warning("CostTracker: cannot write %s (%s); a launch killed before its first checkpoint will not be "
                    "billed to its relaunch.", path, err)
