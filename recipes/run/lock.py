"""One live process per run directory: a second launch of a running run is refused, a dead holder never blocks.

The lock is ``filelock``'s :class:`~filelock.FileLock` on ``<run dir>/.lock`` (on Linux an ``flock``), held by the
launching process for its whole life. The kernel drops it when the process dies however it dies (SIGKILL
included), so no stale lock outlives its holder on the same machine; filelock closes the descriptor in a forked
child (a dataloader worker), so no such child keeps it past its holder either. On NFS the server releases it
when the client's lease ends. It protects one filesystem: two machines staging the same object-storage run in their own
local directories do not see each other's lock.

What filelock has no notion of, and is written here:

- the holder's identity in the refusal: filelock's ``Timeout`` names only the file, so the holder writes its
  host, pid and start time into the lock file (filelock's ``on_acquired`` hook) and a refused launch reads them;
- leaving nothing behind: filelock keeps a Unix lock file after release (waiters share its inode), and knows
  nothing of the run directory. Releasing removes the lock file while still holding it, then the run directory
  with its parents when this launch created them and they are still empty: a launch refused at start-up leaves
  nothing behind. A launch that opened the file just before its holder removed it flocks an orphan: filelock
  sees the orphan (no links left) and does not count it as held, and the short wait below tries again on the
  file in its place, so two launches never both hold one run.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

LOCK_NAME = ".lock"


class RunLocked(Exception):
    """The run directory is held by another live process."""

    def __init__(self, run_dir: Path, holder: dict[str, Any]) -> None:
        self.run_dir, self.holder = run_dir, holder
        since = holder.get("started")
        when = f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}" if since else ""
        super().__init__(f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}{when}")


class RunLock:
    """An exclusive lock on a run directory while this object lives (keep a reference) or until :meth:`release`.

    Args:
        run_dir: the run's directory (created if missing).

    Raises:
        RunLocked: from :meth:`acquire`, when another live process holds the run.
        OSError: when the directory cannot be created or the lock file written (a read-only filesystem).
    """

    #: How long :meth:`acquire` tries before refusing: a few of filelock's polls, enough to step past a lock file
    #: that its holder removed between our open and our flock (see the module), too short for a person to notice.
    WAIT_S = 0.25

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        # thread_local=False: the CLI may let go from another thread than the one that took it.
        self._lock = FileLock(self.path, timeout=self.WAIT_S, thread_local=False, on_acquired=write_holder)
        #: The directories :meth:`acquire` created, deepest first: removed again on release if still empty.
        self._created: list[Path] = []

    def acquire(self) -> None:
        """Take the lock, and write who holds it."""
        self._created = missing_dirs(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire()
        except Timeout:
            holder = read_holder(self.path)
            self._remove_created()
            raise RunLocked(self.run_dir, holder) from None
        except BaseException:
            self._remove_created()
            raise

    def release(self) -> None:
        """Let the next launch in (also done by the kernel when this process ends), leaving no lock file behind.

        The file is removed while it is still locked (a launch that opened it meanwhile sees it gone and retries),
        then the run directory and its parents, if this lock created them and nothing else was written there.
        """
        if not self._lock.is_locked:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only or vanished directory: the release below is what matters
        self._lock.release(force=True)
        self._remove_created()

    def _remove_created(self) -> None:
        for folder in self._created:
            try:
                folder.rmdir()  # only if empty: a run's files, or another launch's run, keep it
            except OSError:
                break
        self._created = []

    @property
    def held(self) -> bool:
        return self._lock.is_locked


def write_holder(fd: int) -> None:
    """filelock's ``on_acquired`` hook: write this process's identity into the lock file it just locked."""
    record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)


def read_holder(path: Path) -> dict[str, Any]:
    """The identity the holder wrote (empty when it is gone, or has not written it yet)."""
    try:
        holder = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, deepest first (what ``mkdir(parents=True)`` creates)."""
    out: list[Path] = []
    current = path.absolute()
    while not current.exists() and current != current.parent:
        out.append(current)
        current = current.parent
    return out
