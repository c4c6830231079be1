"""A watchdog that ends a hung distributed job within a bounded time, instead of the process group's 30 minutes.

A rank that waits in a collective for a peer that never comes (a frozen or dead rank, or ranks that
disagree on what comes next) waits in C++: its Python signal handlers do not run, so a notice (SIGTERM,
SIGUSR1) is never acted on, and the job bills until gloo's or NCCL's timeout (30 minutes by default).
This watchdog is a thread beside the training loop that sees both conditions:

- **a notice the loop cannot reach**: the signal's C-level handler writes to a wakeup file descriptor
  (``signal.set_wakeup_fd``) even while the main thread is blocked; if the loop does not reach a step
  boundary within ``notice_grace_s`` of it, the rank is hung;
- **a stall**: no step boundary for ``max(stall_floor_s, stall_factor x the longest gap seen)``: a
  collective timeout sized from the run's own measured steps, saves and validations.

Before calling a stall a hang it asks the peers, through a heartbeat each rank publishes every
``period_s`` in the rendezvous store (a key per rank: a counter, the step, whether the rank is busy with
work of its own such as writing a checkpoint): a rank whose counter stops moving "stopped answering"; a
busy live peer means the wait is legitimate. What the hang costs is then bounded: the notice grace (or the
stall timeout) plus a few seconds to write the record and end the processes.

On a hang, ``on_hang`` receives one line: this rank, how long it waited, the collective its main thread
is in (read from its stack), and the ranks that stopped answering. What to do (mark the tracking run,
kill the process tree, exit 75) is the caller's business.

No Lightning import: torch.distributed's public store API and the standard library.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

__all__ = ["HangWatchdog", "PeerBoard", "kill_children", "main_thread_wait", "rendezvous_store"]

#: Key prefix of the heartbeats in the rendezvous store.
HEARTBEAT_PREFIX = "atscale/heartbeat/"


class Store(Protocol):
    """The part of ``torch.distributed.Store`` the board uses."""

    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...


def rendezvous_store(timeout_s: float = 5.0, quiet: bool = False) -> Store | None:
    """A client of the job's rendezvous store (``MASTER_ADDR:MASTER_PORT``) with its own short timeout.

    Every launcher (Lightning's, torchrun, SLURM) serves the store there; a connection of our own keeps the
    process group's store, and its timeout, untouched. ``None`` when there is none to reach (said in a warning
    for the hang watchdog, unless ``quiet``).
    """
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    import torch.distributed as dist

    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except Exception as err:  # no heartbeats is a weaker diagnosis, never a failed run
        if quiet:
            return None
        log.warning("Hang watchdog: the rendezvous store %s:%s cannot be reached (%s); a hang is still ended, "
                    "but without naming the rank that stopped answering.", host, port, err)
        return None


class PeerBoard:
    """Each rank's heartbeat in a shared store: a counter, the step, and whether it is busy on its own.

    Args:
        store: the shared key-value store (a ``torch.distributed.Store``).
        rank: this rank.
        world_size: ranks in the job.
    """

    def __init__(self, store: Store, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.seq = 0

    def publish(self, step: int, busy: str | None) -> None:
        """Say "alive" (the counter moves), at which step, and what this rank is busy with, if anything."""
        self.seq += 1
        self.store.set(f"{HEARTBEAT_PREFIX}{self.rank}", json.dumps({"seq": self.seq, "step": step, "busy": busy}))

    def read(self) -> dict[int, dict[str, Any] | None]:
        """Every rank's last heartbeat (``None``: never published, or the store does not answer for it)."""
        beats: dict[int, dict[str, Any] | None] = dict.fromkeys(range(self.world_size))
        for rank in range(self.world_size):
            key = f"{HEARTBEAT_PREFIX}{rank}"
            try:
                beats[rank] = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except Exception:  # the store stopped answering (its host hung): no rank's heartbeat can be read
                break
        return beats


def silent_ranks(before: dict[int, dict[str, Any] | None], after: dict[int, dict[str, Any] | None]) -> list[int]:
    """Ranks whose heartbeat did not move between two readings."""
    return [rank for rank in sorted(after) if after[rank] is None
            or (before.get(rank) is not None and before[rank]["seq"] == after[rank]["seq"])]  # type: ignore[index]


def main_thread_wait() -> str:
    """Where the main thread waits: the innermost ``torch.distributed`` call and our frame that made it.

    ``sys._current_frames`` is documented CPython (``sys`` module) for exactly this: a thread reading another
    thread's stack, as ``faulthandler`` does.
    """
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    collective, caller = None, None
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if collective is None and "/torch/distributed/" in path:
            collective = frame.f_code.co_name
        elif collective is None and path.endswith("/torch/autograd/__init__.py"):
            collective = "backward (DDP's gradient all-reduce)"
        if caller is None and "site-packages" not in path and "/lib/python" not in path:
            caller = f"{Path(path).name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    where = collective or "no collective (the step itself)"
    return f"{where}, called from {caller}" if caller else where


def kill_children() -> None:
    """SIGKILL every process this one started, and theirs (ranks a launcher started, loader workers).

    SIGKILL, because a frozen (stopped) process never handles a SIGTERM.
    """
    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()


class HangWatchdog:
    """A daemon thread that calls ``on_hang`` once, when training stopped reaching step boundaries.

    Args:
        on_hang: called from the watchdog thread with one line saying what hung.
        rank: this process's global rank.
        notice_signals: signal numbers that are interruption notices.
        notice_grace_s: after a notice, how long the loop may take to reach a step boundary.
        stall_floor_s: the least stall taken for a hang without a notice.
        stall_factor: a stall is a hang past this many times the longest gap seen between step boundaries.
        board: the peers' heartbeats (``None``: one process, or no store; then only notices are watched).
        period_s: how often the thread wakes, publishes its heartbeat and checks.
        clock: the monotonic clock (a test passes its own).

    Example::

        watchdog = HangWatchdog(on_hang=end_job, rank=0, notice_signals={signal.SIGTERM})
        watchdog.start()          # main thread
        ...; watchdog.beat(step)  # every step boundary
        watchdog.stop()
    """

    def __init__(self, on_hang: Callable[[str], None], rank: int, notice_signals: set[int],
                 notice_grace_s: float = 20.0, stall_floor_s: float = 300.0, stall_factor: float = 20.0,
                 board: PeerBoard | None = None, period_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not all(v > 0 for v in (notice_grace_s, stall_floor_s, stall_factor, period_s)):  # NaN included
            raise ValueError(f"HangWatchdog(notice_grace_s={notice_grace_s!r}, stall_floor_s={stall_floor_s!r}, "
                             f"stall_factor={stall_factor!r}, period_s={period_s!r}): each must be positive.")
        self.on_hang, self.rank, self.notice_signals = on_hang, rank, notice_signals
        self.notice_grace_s, self.stall_floor_s, self.stall_factor = notice_grace_s, stall_floor_s, stall_factor
        self.board, self.period_s, self.clock = board, period_s, clock
        self.step = 0
        self.longest_gap_s = 0.0
        self.last_beat = clock()
        self.notice_at: float | None = None
        self.busy_with: str | None = None
        self.fired = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup_fd = -1

    # ------------------------------------------------------------- main thread
    def beat(self, step: int | None = None) -> None:
        """The loop reached a boundary: it is not hung, and a pending notice is being acted on."""
        now = self.clock()
        if self.busy_with is None:
            self.longest_gap_s = max(self.longest_gap_s, now - self.last_beat)
        self.last_beat = now
        self.notice_at = None
        if step is not None:
            self.step = step

    @contextlib.contextmanager
    def busy(self, what: str) -> Iterator[None]:
        """Work of this rank's own (writing a checkpoint): its length does not set the stall timeout."""
        self.busy_with = what
        try:
            yield
        finally:
            self.busy_with = None
            self.last_beat = self.clock()

    def stall_timeout_s(self) -> float:
        """How long without a step boundary is a hang."""
        return max(self.stall_floor_s, self.stall_factor * self.longest_gap_s)

    def start(self) -> None:
        """Watch (from the main thread: the wakeup descriptor can only be set there)."""
        if self._thread is not None:
            return
        self.last_beat = self.clock()
        if threading.current_thread() is threading.main_thread():
            read_fd, write_fd = os.pipe()
            os.set_blocking(read_fd, False)
            os.set_blocking(write_fd, False)
            try:
                self._old_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
                self._pipe = (read_fd, write_fd)
            except ValueError:  # not the main interpreter: notices are then seen at step boundaries only
                os.close(read_fd)
                os.close(write_fd)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="atscale-hang-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching and give the wakeup descriptor back."""
        self._stop.set()
        if self._pipe is not None:  # wake the thread from its select() on the pipe (byte 0 is no signal)
            with contextlib.suppress(OSError):
                os.write(self._pipe[1], b"\0")
        if self._thread is not None:
            self._thread.join(timeout=5 * self.period_s)
            self._thread = None
        if self._pipe is not None and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self._old_wakeup_fd)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None

    # -------------------------------------------------------- watchdog thread
    def _signals_received(self, wait_s: float) -> list[int]:
        if self._pipe is None:
            self._stop.wait(wait_s)
            return []
        ready, _, _ = select.select([self._pipe[0]], [], [], wait_s)
        if not ready:
            return []
        try:
            return list(os.read(self._pipe[0], 512))
        except BlockingIOError:
            return []

    def _run(self) -> None:
        while not self._stop.is_set():
            received = self._signals_received(self.period_s)
            if self._stop.is_set():
                return
            if any(signum in self.notice_signals for signum in received) and self.notice_at is None:
                self.notice_at = self.clock()
            self._publish()
            verdict = self.check()
            if verdict is not None:
                self.fired = True
                self.on_hang(verdict)
                return

    def _publish(self) -> None:
        if self.board is None:
            return
        try:
            self.board.publish(self.step, self.busy_with)
        except Exception as err:  # the store's host may be the rank that hung
            log.debug("Hang watchdog: heartbeat not published (%s).", err)

    def check(self) -> str | None:
        """One look: the line that says what hung, or ``None`` while training moves (or waits legitimately)."""
        now = self.clock()
        waited = now - self.last_beat
        if self.notice_at is not None and now - self.notice_at >= self.notice_grace_s:
            silent = self._silent_peers()
            return self._line(f"a notice {now - self.notice_at:.0f} s ago found rank {self.rank} unable to reach a "
                              f"step boundary for {waited:.0f} s", silent)
        if self.board is None or waited < self.stall_timeout_s():
            return None
        silent = self._silent_peers()
        if not silent and (self.busy_with is not None or self._busy_peers()):
            self.last_beat = now  # a live rank is writing or uploading: the others' wait is legitimate
            return None
        cause = f"rank {self.rank} reached no step boundary for {waited:.0f} s (timeout {self.stall_timeout_s():.0f} s)"
        return self._line(cause, silent, deadlock=not silent)

    def _silent_peers(self) -> list[int]:
        if self.board is None:
            return []
        before = self.board.read()
        self._stop.wait(2 * self.period_s)
        self._publish()
        return [rank for rank in silent_ranks(before, self.board.read()) if rank != self.rank]

    def _busy_peers(self) -> list[int]:
        assert self.board is not None
        return [rank for rank, beat in self.board.read().items() if beat and beat.get("busy") and rank != self.rank]

    def _line(self, cause: str, silent: list[int], deadlock: bool = False) -> str:
        who = (f"rank(s) {', '.join(map(str, silent))} stopped answering" if silent
               else "every rank answers but waits: they disagree on what comes next" if deadlock
               else "no rank named as silent")
        return f"hang: {cause}; its main thread waits in {main_thread_wait()}; {who} (step {self.step})"
