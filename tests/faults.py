"""Faults a test injects into a real ``python -m recipes.fit`` process through its config (``trainer.callbacks``)."""

from __future__ import annotations

import atexit
import os
import signal
import time
from pathlib import Path
from typing import Any

import mlflow
from lightning.pytorch import Callback, LightningModule, Trainer


class KillOnce(Callback):
    """SIGKILL the run's whole process group once training passes ``step``, after its metrics reached the store.

    ``marker`` is written first, so the relaunch (the same command) trains on past ``step``.

    Args:
        step: the global step after which to kill.
        marker: a file whose existence means "already killed once".
    """

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, Path(marker)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step < self.step or self.marker.exists():
            return
        trainer.strategy.barrier("KillOnce")  # every rank is at this step
        if trainer.is_global_zero:
            mlflow.flush_async_logging()  # the points past the checkpoint are in the store
            self.marker.write_text(str(trainer.global_step))
            os.killpg(os.getpgid(0), signal.SIGKILL)
        trainer.strategy.barrier("KillOnce.after")  # the other ranks wait here for the kill


class SecondPressSwallowed(Callback):
    """Ctrl-C twice, the second press landing in a wrap-up writer whose library swallows the stop.

    The first press (at ``step``) is a notice: checkpoint, stop. The second comes as the MLflow logger finalizes,
    inside code that turns the exception into an error of its own and handles that, as matplotlib's cleanup of a
    figure being saved did ("Invalid bounding box", logged by the plot's writer as a failed plot).

    Args:
        step: the global step after which the first press comes.
    """

    def __init__(self, step: int = 2) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGINT)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for logger in trainer.loggers:
            finalize = logger.finalize

            def swallowing_finalize(status: str = "success", _finalize: Any = finalize) -> None:
                try:
                    try:
                        os.kill(os.getpid(), signal.SIGINT)
                        time.sleep(1.0)  # the handler runs at once; the sleep only bounds a miss
                    except BaseException:  # the library's own cleanup fails in turn and replaces the exception
                        raise ValueError("Invalid bounding box") from None
                except ValueError:
                    pass  # its caller logs a failed write and carries on
                _finalize(status)

            logger.finalize = swallowing_finalize  # type: ignore[method-assign]


class SignalDuringWrapUp(Callback):
    """Send this process ``signal`` once training is over: in the middle of the wrap-up, or as the process exits.

    ``moment="finalize"``: just before the MLflow logger's ``finalize``, after every callback's teardown gave the
    signals back, where a SIGTERM (a spot notice, a supervisor's stop) once raised into MLflow's shutdown of its
    metric queue and turned a run that had finished training into a KILLED or FAILED one, exiting 75.
    ``moment="exit"``: from an ``atexit`` handler, once the run is recorded and the process is ending.

    Args:
        signal_name: ``"SIGTERM"`` or ``"SIGINT"``.
        moment: ``"finalize"`` or ``"exit"``.
    """

    def __init__(self, signal_name: str = "SIGTERM", moment: str = "finalize") -> None:
        self.signum = signal.Signals[signal_name]
        self.moment = moment

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.moment == "exit":
            atexit.register(os.kill, os.getpid(), self.signum)  # before MLflow's own exit handlers (LIFO)
            return
        for logger in trainer.loggers:
            finalize = logger.finalize

            def signalled_finalize(status: str = "success", _finalize: Any = finalize) -> None:
                os.kill(os.getpid(), self.signum)
                _finalize(status)

            logger.finalize = signalled_finalize  # type: ignore[method-assign]


class RecordThreads(Callback):
    """Write the process's OpenMP environment and torch's thread count to ``path`` (JSON) when training starts.

    Args:
        path: the JSON file to write.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        import json

        import torch

        self.path.write_text(json.dumps({"threads": torch.get_num_threads(),
                                         **{k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}}))


class SignalMidStoreRead(Callback):
    """At setup, send this process ``signal`` while a read of the tracking store is between two rows.

    A Ctrl-C lands wherever the main thread is; at start-up that is often inside one of MLflow's reads of a
    SQLite store. The interrupted read's open cursor holds the file's read lock for as long as something keeps
    its frame alive, and the exception in flight does, through its traceback: the run's "ended" write, made
    while that exception is handled, once waited 20 s on the lock and failed (exit 1, "database is locked").

    Args:
        signal_name: ``"SIGINT"`` or ``"SIGTERM"``.
    """

    def __init__(self, signal_name: str = "SIGINT") -> None:
        self.signum = signal.Signals[signal_name]

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        import sqlalchemy

        engine = sqlalchemy.create_engine(mlflow.get_tracking_uri())
        rows = engine.connect().exec_driver_sql("SELECT key FROM tags")  # the run's tags: several rows
        assert rows.fetchone() is not None  # the read is under way: the file's read lock is held
        os.kill(os.getpid(), self.signum)  # the handler raises here, in this frame
        rows.fetchall()


class SkewRank(Callback):
    """Make one rank late at every step boundary: it sleeps ``sleep_s`` before the other callbacks look at a clock.

    Ranks in lockstep still leave each step's collectives together; the sleep puts this rank's clock readings
    ``sleep_s`` behind the others', as a slower or busier machine's are.

    Args:
        rank: the global rank to slow down.
        sleep_s: seconds slept at each training batch's end.
    """

    def __init__(self, rank: int = 1, sleep_s: float = 0.02) -> None:
        self.rank, self.sleep_s = rank, sleep_s

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_rank == self.rank:
            time.sleep(self.sleep_s)


class SignalOneRank(Callback):
    """Send ``signal_name`` to one rank only, once, when training passes ``step`` (a notice seen by one node).

    ``marker`` records it (the relaunch does not signal again) and holds that rank's pid.

    Args:
        rank: the global rank that receives the signal.
        step: the global step after which it is sent.
        marker: a file whose existence means "already sent".
        signal_name: ``"SIGTERM"``, ``"SIGUSR1"``, or ``"SIGSTOP"`` (the rank freezes: a hung machine).
    """

    def __init__(self, rank: int, step: int, marker: str, signal_name: str = "SIGTERM") -> None:
        self.rank, self.step, self.marker = rank, step, Path(marker)
        self.signum = signal.Signals[signal_name]

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_rank != self.rank or trainer.global_step < self.step or self.marker.exists():
            return
        self.marker.write_text(str(os.getpid()))
        os.kill(os.getpid(), self.signum)


class HangOneRank(Callback):
    """Block one rank's main thread once, when training reaches ``step`` (a read that never returns); its other
    threads (the watchdog, Lightning's child-process observer) run on.

    Args:
        rank: the global rank whose main thread stops.
        step: the global step at whose end it stops.
        sleep_s: how long it stays stopped (longer than the test waits).
    """

    def __init__(self, rank: int, step: int, sleep_s: float = 600.0) -> None:
        self.rank, self.step, self.sleep_s = rank, step, sleep_s

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            time.sleep(self.sleep_s)


class KillWhileLoggingModel(Callback):
    """SIGKILL this process once MLflow has made the run's logged model (PENDING) and starts uploading its files.

    Deterministic where a test watching the store for a PENDING model and then killing raced the upload: a fast
    upload finished the model (READY) before the kill landed. ``marker`` is written first, so the relaunch (the
    same command) logs its model.

    Args:
        marker: a file whose existence means "already killed once".
    """

    def __init__(self, marker: str) -> None:
        self.marker = Path(marker)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.marker.exists():
            return
        marker = self.marker

        def killed(*args: Any, **kwargs: Any) -> None:
            marker.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)

        mlflow.MlflowClient.log_model_artifacts = killed  # type: ignore[method-assign]
