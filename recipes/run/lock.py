"""One live process per run directory: a second launch of a running run is refused, a dead holder never blocks.

The lock is an advisory ``flock`` on ``<run dir>/.lock``, held by the launching process for its whole
life. The kernel drops it when the process dies however it dies (SIGKILL included), so no stale lock
outlives its holder on the same machine; on NFS the server releases it when the client's lease ends.
The file names the holder (host, pid, start time) for the refusal message. It protects one
filesystem: two machines staging the same object-storage run in their own local directories do not
see each other's lock.
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

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._handle: IO[str] | None = None

    def acquire(self) -> None:
        """Take the lock without waiting, and write who holds it."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")  # held open for the life of the process
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            try:
                holder = json.loads(handle.read() or "{}")
            except ValueError:
                holder = {}
            handle.close()
            raise RunLocked(self.run_dir, holder) from None
        except BaseException:
            handle.close()
            raise
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}))
        handle.flush()
        self._handle = handle

    def release(self) -> None:
        """Let the next launch in (also done by the kernel when this process ends)."""
        if self._handle is not None:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None

    @property
    def held(self) -> bool:
        return self._handle is not None
