"""One live process per run directory: a second launch of a running run is refused, a dead holder never blocks.

The lock is an advisory ``flock`` on ``<run dir>/.lock``, held by the launching process for its whole
life. The kernel drops it when the process dies however it dies (SIGKILL included), so no stale lock
outlives its holder on the same machine; on NFS the server releases it when the client's lease ends.
The file names the holder (host, pid, start time) for the refusal message. It protects one
filesystem: two machines staging the same object-storage run in their own local directories do not
see each other's lock.

Releasing removes the lock file (while still holding it), and the run directory with its parents when this
launch created them and they are still empty: a launch refused at start-up leaves nothing behind. A launch that
opened the file just before its holder removed it locks an orphan: it sees that the path now names another
file (or none) and tries again on the file in its place, so two launches never both hold one run.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO, Any

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

    #: Attempts to lock a lock file that another launch removed between our open and our lock (see the module).
    ATTEMPTS = 20

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._handle: IO[str] | None = None
        #: The directories :meth:`acquire` created, deepest first: removed again on release if still empty.
        self._created: list[Path] = []

    def acquire(self) -> None:
        """Take the lock without waiting, and write who holds it."""
        for _ in range(self.ATTEMPTS):
            created = missing_dirs(self.run_dir)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._created = created or self._created
            try:
                handle = open(self.path, "a+")  # held open for the life of the process
            except FileNotFoundError:  # a refused launch removed the empty folders we had just made: again
                continue
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                try:
                    holder = json.loads(handle.read() or "{}")
                except ValueError:
                    holder = {}
                handle.close()
                self._remove_created()
                raise RunLocked(self.run_dir, holder) from None
            except BaseException:
                handle.close()
                raise
            if same_file(handle, self.path):
                break
            handle.close()  # its holder removed that file as we opened it: lock the one in its place
        else:
            raise OSError(f"could not lock {self.path}: it kept being removed")
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}))
        handle.flush()
        self._handle = handle

    def release(self) -> None:
        """Let the next launch in (also done by the kernel when this process ends), leaving no lock file behind.

        The file is removed while it is still locked (a launch that opened it meanwhile sees it gone and retries),
        then the run directory and its parents, if this lock created them and nothing else was written there.
        """
        if self._handle is not None:
            try:
                if same_file(self._handle, self.path):
                    self.path.unlink(missing_ok=True)
            except OSError:
                pass  # a read-only or vanished directory: the kernel's release below is what matters
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None
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
        return self._handle is not None


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, deepest first (what ``mkdir(parents=True)`` creates)."""
    out: list[Path] = []
    current = path.absolute()
    while not current.exists() and current != current.parent:
        out.append(current)
        current = current.parent
    return out


def same_file(handle: IO[str], path: Path) -> bool:
    """Whether the open ``handle`` is still the file at ``path`` (not one removed, or replaced, since it was opened)."""
    try:
        here, there = os.fstat(handle.fileno()), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)
