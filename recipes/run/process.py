"""What a launch sets for its own process: stop signals, log filters, the collector, CPU threads, GPU checks.

The run flow (:mod:`recipes.run.cli`) calls these; each is process-wide state a library leaves to its
caller (Python's signal handlers, the logging tree, the garbage collector, torch's thread count, an
environment variable Lightning sets), so each is undone or reset where a test or a sweep runs several fits
in one process.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shlex
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from callbacks.cpu_threads import AdaptiveCpuThreads, FixedCpuThreads
from callbacks.spot import REQUEUE_EXIT_CODE
from callbacks.utils.launcher import reported_exit_code
from callbacks.utils.notices import forget_interrupt_notices, interrupt_notices
from recipes.run.common import SIGINT_EXIT_CODE, UsageError
from recipes.run.compat import MLFLOW_TRACKING_CLIENT_LOGGER
from recipes.run.errors import out_of_space

log = logging.getLogger(__name__)

#: MLflow prints a run's UI page at every end of the run (twice for one fit) unless this is true.
MLFLOW_QUIET_URL_ENV = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"
#: MLflow's worker threads for async logging (read when its queue starts; the CLI sets one: batches in order).
ASYNC_LOGGING_THREADS_ENV = "MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE"
#: MLflow's async queue, by default, waits for its next batch with a 1 s timeout and looks at its stop event only
#: after it: every run's end (set_terminated, a flush) then waited ~1 s. Buffered, it sleeps on the stop event
#: itself (woken at once when the run ends) and writes what gathered each interval as one batch. A batch's
#: write costs mostly per call, not per metric, and it holds the GIL the training step needs: gathering several
#: logging windows into one write is most of what metrics cost the step. A live run's charts lag by as much.
#: MLflow parses the value as an int: "0.5" would stop its logging thread with a ValueError.
ASYNC_LOGGING_BUFFER_ENV = "MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS"
ASYNC_LOGGING_BUFFER_S = "5"


class Interrupted(BaseException):
    """A SIGTERM or SIGINT outside training (where SpotCheckpoint owns the signals): unwind and stop."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


#: ``--cpu_threads`` values other than a count: held for the run's life, following the load, torch's own.
CPU_THREAD_MODES = ("auto", "adaptive", "torch")


def apply_cpu_threads(setting: str) -> None:
    """Check ``--cpu_threads`` and set torch's intra-op thread count for an explicit ``N`` (see recipes.fit)."""
    if setting in CPU_THREAD_MODES:
        return
    if not setting.isdigit() or int(setting) < 1:
        raise UsageError(f"--cpu_threads {setting!r}: expected 'auto', 'adaptive', 'torch' or a positive integer.")
    torch.set_num_threads(int(setting))


def cpu_thread_callback(setting: str, user_callbacks: list[Callback]) -> Callback | None:
    """The callback ``--cpu_threads`` asks for, unless the config brings its own.

    ``adaptive`` follows the machine's load (faster beside busy work, not bitwise resumable); every other
    setting holds the count the run starts with for its whole life, resumes included.
    """
    if any(isinstance(cb, (AdaptiveCpuThreads, FixedCpuThreads)) for cb in user_callbacks):
        return None
    if setting == "adaptive":
        if "OMP_NUM_THREADS" in os.environ:
            return None  # a launcher divided the cores, or the user fixed the count
        log.warning("--cpu_threads adaptive: the thread count follows the machine's load, so this run's weights do "
                    "too; a resumed or reproduced run will not be bitwise identical.")
        return AdaptiveCpuThreads()  # acts on a single-process CPU run only
    return FixedCpuThreads()


@contextlib.contextmanager
def frozen_setup_objects() -> Iterator[None]:
    """Inside: every object alive on entry (modules, configs, the MLflow client) is exempt from garbage collection.

    They live as long as the process; without this, each full collection during ``fit`` walks them all
    (hundreds of thousands after the CLI's imports: a pause of a sizeable share of a small recipe's fit).
    Objects made inside are collected as usual; on exit all are collectable again (a later fit in this
    process, in tests or sweeps, freezes its own setup).
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


#: Set by Lightning on import, so that asking whether a GPU exists never initialises CUDA (which would break
#: fork-started workers): torch then asks NVML instead, anew at every check until CUDA is initialised.
NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"


@contextlib.contextmanager
def cheap_gpu_checks() -> Iterator[None]:
    """Inside: on a machine without a GPU, torch answers "is there a GPU?" from its cached runtime count.

    Every ``optimizer.step()`` asks (``torch.accelerator.current_accelerator(check_available=True)``, for CUDA
    graph capture). With a CUDA build of torch and Lightning's NVML check, a CPU run never initialises CUDA, so
    each step loads the NVML library anew and fails to find a GPU (tens of microseconds a step: the benchmarks
    page, "The digits fit against plain Lightning", has the figure). Without a GPU there is no CUDA state a
    forked worker could inherit, so the NVML route protects nothing; with one, nothing changes. The variable
    is restored on exit.
    """
    saved = os.environ.get(NVML_CHECK_ENV)
    if saved is None or torch.cuda.device_count() > 0:
        yield
        return
    del os.environ[NVML_CHECK_ENV]
    try:
        yield
    finally:
        os.environ[NVML_CHECK_ENV] = saved


class _DropLines(logging.Filter):
    """Drop log records whose message starts with one of ``prefixes``."""

    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


class _DropOutOfSpace(logging.Filter):
    """Drop a record logged about a write that failed for lack of space (its exception, or the one being handled
    where it was logged: MLflow's async writer logs its failure inside its ``except``, without ``exc_info``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info and record.exc_info[1] is not None else sys.exc_info()[1]
        return err is None or out_of_space(err) is None


#: MLflow's loggers that print a full store's failed writes, each with its traceback (several per logging window):
#: the run says it once, in the one line that ends it (``recipes.run.errors.store_full_message``).
MLFLOW_WRITE_LOGGERS = ("mlflow.store.db.utils", "mlflow.utils.async_logging.async_logging_queue",
                        "mlflow.system_metrics.system_metrics_monitor", MLFLOW_TRACKING_CLIENT_LOGGER)
_DROP_OUT_OF_SPACE = _DropOutOfSpace()
#: One filter object for every launch: ``addFilter`` skips one already there, so a kernel or a sweep that launches
#: many fits in one process does not pile up a filter per launch.
_DROP_TIP = _DropLines("💡 Tip:")


def quiet_known_noise() -> None:
    """Silence what is known to be harmless and outside this project's control; real warnings stay.

    - Lightning's seed announcement (the seed is in config.yaml and the params) and its litlogger tip;
    - MLflow's INFO lines about its system-metrics thread and database setup;
    - deprecation warnings that Lightning 2.6 and torchdata raise from their own code on every run
      (``LeafSpec``, ``set_vital``), which a user cannot act on;
    - ModelCheckpoint's "Checkpoint directory ... exists and is not empty" on every resume: the directory
      holds the run's own checkpoints (``--fresh true`` sets them aside);
    - MLflow's "View run ... at: URL" at every end of a run (the end table shows the page once);
    - MLflow's ERROR lines and tracebacks for each write a full tracking store refused (the run ends with one line
      that says so: ``recipes.run.errors.store_full_message``);
    - once a stop signal came outside training (:func:`stopping`), the "Exception ignored in ..." tracebacks of
      library clean-ups it broke into: the stop's exception raised inside a weakref callback (SQLAlchemy's
      ``InstanceState._cleanup``) leaves that library's bookkeeping half-done, and each later clean-up prints an
      ``AssertionError`` while the process is ending anyway with its one line.
    """
    logging.getLogger("lightning.fabric.utilities.seed").setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DROP_TIP)
    os.environ.setdefault(MLFLOW_QUIET_URL_ENV, "true")  # the run's page is printed once, in the end table
    for name in ("mlflow.system_metrics", "mlflow.store.db.utils", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in MLFLOW_WRITE_LOGGERS:
        logging.getLogger(name).addFilter(_DROP_OUT_OF_SPACE)  # once: the same filter object
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*is deprecated")
    warnings.filterwarnings("ignore", message=r".*'set_vital' is deprecated")
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    if not isinstance(sys.unraisablehook, _QuietAfterStop):
        sys.unraisablehook = _QuietAfterStop(sys.unraisablehook)


class _QuietAfterStop:
    """``sys.unraisablehook`` that drops what is raised in clean-ups once a stop signal came (see above)."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    def __call__(self, unraisable: Any) -> None:
        if not _stopping.is_set():
            self.previous(unraisable)


def quiet_lightning_info() -> None:
    """Keep Lightning's INFO lines (devices, "`Trainer.fit` stopped") out of a process that runs many fits.

    For the benchmarks and other tools that fit several times in one process. MLflow's model logging imports
    the standalone ``pytorch_lightning`` package when it is installed, whose import sets its logger back to
    INFO; it is imported here first, so the level set after it holds.
    """
    import importlib.util

    names = ["lightning.pytorch"]
    if importlib.util.find_spec("pytorch_lightning") is not None:
        import pytorch_lightning  # noqa: F401

        names.append("pytorch_lightning")
    for name in names:
        logging.getLogger(name).setLevel(logging.WARNING)


#: Set by the first SIGTERM/SIGINT outside training: the process is stopping, and further signals change nothing.
_stopping = threading.Event()
#: Set once training is over (``on_fit_end``): from then on a stop signal waits for the wrap-up to complete.
_wrapping_up = threading.Event()
#: The signals that came during the wrap-up, in order.
_deferred: list[int] = []
#: The signals raised as :class:`Interrupted` since :func:`reset_stop_signals`, in order.
_raised: list[int] = []


class WrapUpSignals(Callback):
    """Once training is over, let a SIGTERM/SIGINT wait for the run's wrap-up instead of raising into it.

    The wrap-up (MLflow's logger draining its metric queue and ending the run, the time-breakdown plot, the
    model, the summary) takes seconds. A signal raised there as :class:`Interrupted` interrupted MLflow's queue
    shutdown half-way: a run that had finished training ended KILLED or FAILED and exited 75, asking to be
    relaunched with nothing left to do. A second Ctrl-C still stops at once.
    """

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _wrapping_up.set()


#: Exceptions a stop signal raises wherever the main thread happens to be (ours, Python's, Lightning's).
STOP_EXCEPTIONS = (Interrupted, KeyboardInterrupt, SIGTERMException)


def release_interrupted_frames(err: BaseException) -> None:
    """Free the locals of the frames a stop signal's exception unwound, before anything writes the run's end.

    A signal lands wherever the main thread is; at start-up that is often between two rows of one of
    MLflow's reads of a SQLite store. The exception's traceback keeps the interrupted frames, and with them
    the read's open cursor and the file's read lock, alive while the exception is handled: the write that
    ends the run (Lightning's ``logger.finalize``, ours) then waited 20 s on that lock and failed ("database
    is locked"). Only for stop exceptions: a failure's locals stay for a post-mortem. The traceback keeps
    its lines.
    """
    seen: set[int] = set()
    chained: BaseException | None = err
    while isinstance(chained, STOP_EXCEPTIONS) and id(chained) not in seen:
        seen.add(id(chained))
        traceback.clear_frames(chained.__traceback__)  # skips the frames still running (the handler's own)
        chained = chained.__context__
    gc.collect()  # a cursor in a reference cycle goes now, not at the collector's next pass


class ReleaseInterruptedFrames(Callback):
    """Lightning's exception handling calls the callbacks before the loggers' ``finalize``: release there."""

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        release_interrupted_frames(exception)


#: Loggers muted by a stop, and their levels before it.
_muted: dict[str, int] = {}


def _raise_interrupted(signum: int, frame: Any) -> None:
    # a second Ctrl-C insists: the first may have come during the wrap-up, or as the notice that ended training
    insists = signum == signal.SIGINT and bool(_deferred or interrupt_notices())
    if _wrapping_up.is_set() and not insists:
        if not _deferred:
            print(f"{signal.Signals(signum).name} while the run was wrapping up: its training is over; finishing "
                  "its record, then exiting.", file=sys.stderr, flush=True)
        _deferred.append(signum)
        _stopping.set()
        return
    _wrapping_up.clear()
    # Once: a second Ctrl-C a moment later (Lightning re-installs this handler while it unwinds) would raise
    # inside the unwinding and print the stop twice.
    if _stopping.is_set() and not _deferred:
        return
    _deferred.clear()
    _stopping.set()
    # raised wherever the main thread is: inside a library (SQLAlchemy reading the tracking store) that then logs
    # its own cleanup's failure with a traceback; the run is going down with its one line, so that noise is muted
    _muted.setdefault("sqlalchemy", logging.getLogger("sqlalchemy").level)
    logging.getLogger("sqlalchemy").setLevel(logging.CRITICAL + 1)
    _raised.append(signum)
    raise Interrupted(signum)


def stops_raised() -> int:
    """How many stop signals were raised as :class:`Interrupted` so far (see :func:`reraise_swallowed_stop`)."""
    return len(_raised)


def reraise_swallowed_stop(since: int) -> None:
    """Raise again a stop signal's :class:`Interrupted` raised after the ``since``-th that the code it landed in
    swallowed (``since``: :func:`stops_raised` when the fit began; an earlier fit's stops were handled there).

    The exception is raised wherever the main thread is; some libraries turn it into an error of their own and
    handle that: matplotlib's cleanup of a figure being saved raised ``ValueError`` ("Invalid bounding box"),
    which the plot's writer logs as a failed plot, and a second Ctrl-C's stop was lost (the run ended as the
    first press's stop, exit 75, not 130). Called where the run's own code resumes (after ``trainer.fit``,
    between the wrap-up's writers): a stop raised is a stop, whatever caught it.
    """
    if len(_raised) > since and threading.current_thread() is threading.main_thread():
        raise Interrupted(_raised[-1])


def ignore_stop_signals() -> None:
    """Ignore SIGINT/SIGTERM from here to the process's end.

    The interpreter's finalization puts a Python-handled signal back to its default action, so a
    Ctrl-C pressed again during it killed the process by the signal (exit -2) instead of the 130
    already decided; an ignored signal stays ignored.
    """
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)


def reset_stop_signals() -> None:
    """Forget an earlier fit's stop (a test or a sweep runs several in one process)."""
    _stopping.clear()
    _wrapping_up.clear()
    _deferred.clear()
    _raised.clear()
    forget_interrupt_notices()
    for name, level in _muted.items():  # the next fit's store errors are shown again
        logging.getLogger(name).setLevel(level)
    _muted.clear()


def install_stop_signals() -> None:
    """From here until training starts (and after it ends), SIGTERM and SIGINT raise :class:`Interrupted`."""
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, _raise_interrupted)


def stopping() -> bool:
    """Whether a SIGTERM or SIGINT came outside training since :func:`reset_stop_signals`."""
    return _stopping.is_set()


def wrap_up_done() -> None:
    """The wrap-up is done: a stop signal from now on raises again (see :class:`WrapUpSignals`)."""
    _wrapping_up.clear()


def rank_exit_code(code: int, launched_by_parent: bool) -> int:
    """The exit code a rank reports: 0 for an orderly stop (75, 130) of a rank Lightning's launcher started, whose
    launching process reports it (the rule and why: :mod:`callbacks.utils.launcher`)."""
    return reported_exit_code(code, launched_by_parent, (REQUEUE_EXIT_CODE, SIGINT_EXIT_CODE))


def resume_line(step: int, command_args: list[str] | None) -> str:
    """The line a notice's stop ends with: where it stopped, and the exact command that resumes the run (its URLs'
    passwords masked)."""
    from recipes.run.tracking import redact

    how = "relaunch it with the same arguments" if command_args is None else \
        "python -m recipes.fit " + shlex.join(redact(a) for a in command_args)
    return f"atscale: stopped at step {step} on an interruption notice, checkpoint saved (exit {REQUEUE_EXIT_CODE}); " \
           f"to resume: {how}"
