"""Loader workers that outlive an interruption notice sent to the whole process group.

A notice often reaches every process of a job at once: systemd signals every process when a VM shuts down,
SLURM signals the whole job step, a terminal's Ctrl-C reaches the foreground group. A loader worker that
dies of it (torch's worker handler re-raises a SIGTERM not sent by its parent; SIGUSR1's default action
kills; SIGINT ends the worker loop) makes the main process raise ``DataLoader worker ... is killed by
signal`` in the middle of the step: the run crashes without its notice checkpoint.

So a worker ignores the notice signals (a SIGTERM from its own parent excepted: that is how ``multiprocessing``
and torch end a worker) and leaves when the main process tells it to (torch's workers also watch their parent and
exit when it is gone); the main process alone takes the notice, saves at the next step and stops its workers.
A worker that really dies (SIGKILL, the OOM killer) still ends the run loudly.

The signals are blocked in the main thread while the workers are forked (:func:`notices_blocked`): a
notice sent in the few milliseconds between a worker's fork and its :func:`ignore_notice_signals` stays
pending in the worker and is discarded once ignored, and reaches the main process when it unblocks.
Python's standard library and torch offer neither piece (torch's ``worker_init_fn`` is the hook).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

__all__ = ["NOTICE_SIGNALS", "ignore_notice_signals", "notices_blocked", "with_notices_ignored"]

#: The signals a scheduler or a person sends as "stop soon" (the notice signals of ``callbacks.spot``):
#: only the main process acts on them.
NOTICE_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def ignore_notice_signals(worker_id: int | None = None) -> None:
    """In a loader worker: leave the notice signals to the main process; a SIGTERM from the parent still ends it.

    SIGINT and SIGUSR1 are ignored. SIGTERM stays blocked and a thread takes it with its sender
    (``sigwaitinfo``): the parent's own SIGTERM (``multiprocessing`` terminates its daemonic children at exit,
    torch a worker that does not stop in time) ends the worker as torch's handler would, anyone else's is
    dropped. An ignored SIGTERM would make the parent wait forever at its exit.

    Usable as a DataLoader's ``worker_init_fn`` (``worker_init_fn=ignore_notice_signals``).
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    for signum in NOTICE_SIGNALS:
        if signum != signal.SIGTERM:
            signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [s for s in NOTICE_SIGNALS if s != signal.SIGTERM])
    threading.Thread(target=_end_on_the_parents_sigterm, args=(os.getppid(),), name="worker-sigterm",
                     daemon=True).start()


def _end_on_the_parents_sigterm(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)  # as torch's worker handler does for its parent's SIGTERM


class with_notices_ignored:
    """A ``worker_init_fn`` that ignores the notice signals, then calls the loader's own ``worker_init_fn``."""

    def __init__(self, inner: Callable[[int], None] | None) -> None:
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        ignore_notice_signals(worker_id)
        if self.inner is not None:
            self.inner(worker_id)


@contextlib.contextmanager
def notices_blocked() -> Iterator[None]:
    """Hold the notice signals back in this thread while loader workers are forked (a no-op off the main thread).

    A signal that arrives meanwhile is delivered when the block ends: the main process's handler still sees it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, NOTICE_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
