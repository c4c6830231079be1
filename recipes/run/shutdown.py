"""How a training process ends: with its own exit code, fast, never SIGABRT after a run that succeeded.

:func:`run_and_exit` runs a program's ``main`` and ends the process with its exit code. It runs
everything a normal exit runs before the interpreter's finalization (non-daemon threads joined,
``atexit`` handlers: MLflow's queue, logging, temporary directories; standard streams flushed), then
skips the finalization itself.

Why skip it: after a fit the interpreter holds torch, Lightning and MLflow, and tearing their modules
and objects down one by one takes seconds (the benchmarks page has the figure), which a spot notice's
grace period and every relaunch waiting on this process pay for nothing: the kernel frees the memory at
once. Under a profiler or tracer (``python -m cProfile``, coverage) a process outside a group exits
normally, so that tool still writes its output at exit.

In a process that joined a ``torch.distributed`` group it is also needed: ``destroy_process_group``
unregisters the groups but does not free them while anything still holds one, and something always
does after a fit: FSDP2's mesh info on every sharded module, DDP's
reducer. The gloo group is then freed during finalization, while its worker threads may still hold
tensors of the last collectives; releasing those wants the GIL of an interpreter being torn down,
and the process aborts (SIGABRT, "terminate called without an active exception") after a run that
succeeded. On this project's CI that happened about once in a few hundred 2-process runs, and in
``tests/unit/recipes/run/test_shutdown.py``'s stress case in most runs. torch has no switch for it
(pytorch#179291, an ``atexit`` destroy, was abandoned), so this module ends the process itself.

Copy with it: nothing; it works alone (``torch`` and the standard library).
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

import torch

__all__ = ["destroy_process_group", "exit_process", "run_and_exit"]

#: Seconds the exit may take (threads joined, exit handlers, MLflow's last metrics) before the process ends anyway.
EXIT_TIMEOUT_ENV = "ATSCALE_EXIT_TIMEOUT_S"
DEFAULT_EXIT_TIMEOUT_S = 120.0  # AWS's spot notice; a relaunch waits on this process's end

_joined_a_group = False


def destroy_process_group() -> None:
    """Destroy every process group, if one exists, once all ranks are done communicating."""
    global _joined_a_group
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        _joined_a_group = True
        torch.distributed.destroy_process_group()


def joined_a_group() -> bool:
    """Whether this process belongs, or belonged until :func:`destroy_process_group`, to a process group."""
    return _joined_a_group or (torch.distributed.is_available() and torch.distributed.is_initialized())


def _exit_timeout_s() -> float:
    raw = os.environ.get(EXIT_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_EXIT_TIMEOUT_S
    try:
        value = float(raw)
        if value > 0:
            return value
    except ValueError:
        pass
    print(f"warning: {EXIT_TIMEOUT_ENV}={raw!r} is not a number of seconds; using {DEFAULT_EXIT_TIMEOUT_S:.0f}",
          file=sys.stderr, flush=True)
    return DEFAULT_EXIT_TIMEOUT_S


def _watch_the_exit(code: int, timeout_s: float) -> None:
    """End the process with ``code`` if its exit has not finished ``timeout_s`` from now; say where threads were.

    A thread that never ends (a writer stuck on a lock, a queue waiting for work that will not come) or an exit
    handler that never returns kept a stopped run's process alive until something killed it: a spot notice's
    relaunch, or a scheduler's requeue, waits on it. The watch is a daemon thread, so a normal exit never waits
    for it; Python's faulthandler writes the stacks (it needs no lock another thread may hold).
    """
    fd = sys.stderr.fileno() if sys.stderr is not None else 2

    def watch() -> None:
        time.sleep(timeout_s)
        os.write(fd, f"error: the process did not finish exiting within {timeout_s:.0f} s; where its threads "
                     "were:\n".encode())
        faulthandler.dump_traceback(file=fd, all_threads=True)
        os.write(fd, f"Ending it with exit code {code}.\n".encode())
        os._exit(code)

    threading.Thread(target=watch, name="exit-watch", daemon=True).start()


def _profiled() -> bool:
    """Whether a profiler or tracer watches this process (it writes its results during a normal exit)."""
    return sys.getprofile() is not None or sys.gettrace() is not None


def exit_process(code: int) -> NoReturn:
    """End the process with ``code``, without the interpreter's finalization (unless profiled, outside a group).

    Either way within ``ATSCALE_EXIT_TIMEOUT_S`` (default 120 s): an exit that hangs is ended with ``code``.
    """
    _watch_the_exit(code, _exit_timeout_s())
    if _profiled() and not joined_a_group():
        sys.stdout.flush()
        sys.stderr.flush()
        raise SystemExit(code)
    # what a normal exit runs before finalization, in its order (CPython's Py_FinalizeEx): non-daemon
    # threads joined (threading's own atexit list first, e.g. concurrent.futures' workers), atexit handlers,
    # standard streams flushed. The interpreter's private hooks for the first two are the only ones there are.
    # (here, not in recipes/run/compat.py: this file is copied alone; tests/unit/recipes/run/test_shutdown.py
    # checks them)
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to say on it
            pass
    os._exit(code)


def _code_of(exit_request: SystemExit) -> int:
    """The exit code ``raise SystemExit(x)`` means, printing ``x`` where the interpreter would."""
    if exit_request.code is None:
        return 0
    if isinstance(exit_request.code, int):
        return exit_request.code
    print(exit_request.code, file=sys.stderr)
    return 1


def run_and_exit(main: Callable[[], int | None]) -> NoReturn:
    """Run ``main`` as the program's entry point and end the process with its exit code.

    An uncaught exception is reported as the interpreter would (``sys.excepthook``) and exits 1 (130
    for Ctrl-C); ``SystemExit`` inside ``main`` keeps its meaning.
    """
    try:
        code = main() or 0
    except SystemExit as exit_request:
        code = _code_of(exit_request)
    except KeyboardInterrupt:
        code = 130  # the shell's code for SIGINT, as the interpreter exits on an uncaught Ctrl-C
    except BaseException:  # the entry point: report everything, as the interpreter would
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_process(code)
