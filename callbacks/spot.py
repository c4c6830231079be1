"""Spot-safe training: checkpoint on an interruption notice, stop cleanly, resume exactly.

This file wires the hooks; each part it composes is a module of its own under ``utils/``: where notices come
from (``notices``), the vote that agrees decisions across ranks (``agreement``), the hang watchdog
(``watchdog``), when periodic saves are due and Daly's interval (``save_schedule``), fire drills
(``drills``), what a resume records in MLflow (``resume_record``), and every rank's RNG (``rng``).

Notices come from signals (SIGTERM from Kubernetes and most schedulers, SIGUSR1 from SLURM's
``--signal=USR1@90``), from the cloud's metadata service (polled in a thread, see
``callbacks/utils/notices.py``), or from a fire drill. Handlers and pollers only set a flag; at each
training-batch end (and at the end of validation) the ranks vote with one small all-reduce on every
decision that changes control flow (a notice on any rank, a timed save by rank 0's clock, whether the
epoch's validation follows: ``callbacks/utils/agreement.py``), then all save the same step, synchronously,
and stop together. No collective ever runs inside a signal handler (Lightning's own SIGTERM handler
broadcasts inside the handler, which can deadlock DDP; this callback replaces it when training starts).

A rank that never reaches the step boundary (a frozen or dead peer holds it in a collective, where its
signal handlers cannot run) is ended by a watchdog thread (``callbacks/utils/watchdog.py``): a notice the
loop does not act on within ``notice_grace_s``, or a stall longer than a timeout sized from the run's own
steps, ends the process tree with one line naming the silent rank and the collective, the MLflow run marked
KILLED, and exit 75; the relaunch resumes from the newest good checkpoint.

It needs the trainer's checkpoint IO to be ``AtomicCheckpointIO`` (from ``checkpoint_io.py``), whose
integrity records pruning and resume read: a ``Trainer`` without one (Lightning's default IO, alone or inside
``AsyncCheckpointIO``) gets it at setup; any other IO stops the fit at setup with one line saying so.

Every checkpoint this callback writes carries the RNG states of every rank (Python, NumPy,
torch, CUDA) and the MLflow run id; with a stateful training loader (Lightning saves its
position) a resumed run continues bitwise where the interrupted one stopped. Periodic saves
every K steps or T minutes go through the trainer's checkpoint IO (asynchronous when it is
Lightning's ``AsyncCheckpointIO``); names are unique per step and older saves are pruned only
after a newer one is published, so a good checkpoint always remains.

After a notice save the run stops with ``trainer.should_stop``; ``interrupted`` is then true
and the launcher exits with :data:`REQUEUE_EXIT_CODE` (75, ``EX_TEMPFAIL``: "try again"), on
which schedulers can requeue. Under SLURM the job is requeued with ``scontrol requeue``.

Logged metrics (rank 0):

=========================  ===========================================================
key                        meaning
=========================  ===========================================================
``spot/interruptions``     notices acted on over the whole run (survives resumes)
``spot/notice_to_saved_s`` seconds from the notice to the checkpoint published on disk
``spot/lost_steps``        steps redone after a resume (work since the last checkpoint)
=========================  ===========================================================

Copy with it (paths under ``callbacks/``, each folder with an ``__init__.py``): ``checkpoint_io.py``,
``storage/{ckpt_store,safe_load,remote_store}.py``,
``utils/{notices,rng,compat,agreement,watchdog,launcher,save_schedule,drills,resume_record,comm_hooks,steps_file}.py``,
``analysis/{ckpt_interval,keys}.py``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from .analysis.keys import INTERRUPTIONS_KEY, NOTICE_TO_SAVED_KEY, SPOT_LOST_STEPS_KEY, UPLOAD_KEY
from .checkpoint_io import (
    METRICS_PENDING_KEY,
    RUN_METADATA_KEY,
    BoundedAsyncCheckpointIO,
    mirror_of,
    require_atomic_io,
)
from .storage import ckpt_store
from .utils import notices
from .utils.agreement import agree, distributed_world
from .utils.comm_hooks import pin_bucket_layout
from .utils.compat import validation_due
from .utils.drills import FireDrill
from .utils.launcher import reported_exit_code, started_by_lightning
from .utils.resume_record import ELASTIC_TAG, lost_steps, tag_elastic  # noqa: F401 (ELASTIC_TAG: tests import it)
from .utils.rng import restore_rank_rng, rng_state, set_rng_state  # noqa: F401 (tests import it from here)
from .utils.save_schedule import SaveSchedule
from .utils.steps_file import PROGRESS_FILE, read_steps_run
from .utils.watchdog import HangWatchdog, PeerBoard, kill_children, rendezvous_store

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from .storage.remote_store import RemoteCheckpoints

log = logging.getLogger(__name__)

#: Exit status after a notice save: sysexits' EX_TEMPFAIL, "temporary failure, retry".
REQUEUE_EXIT_CODE = 75
#: File name pattern of the checkpoints this callback writes (``step=00000042.ckpt``).
CHECKPOINT_PATTERN = "step=*.ckpt"

class SpotCheckpoint(Callback):
    """Act on interruption notices, save periodically, and make resumes exact.

    Args:
        provider: cloud whose metadata service to poll for notices: ``auto`` (detect),
            ``aws``, ``gcp``, ``azure`` or ``none`` (signals only).
        metadata_url: base URL of the metadata service (default: the provider's own).
        poll_interval_s: seconds between metadata polls.
        metadata_timeout_s: timeout of one metadata request (it never blocks training).
        signals: signal names that count as a notice (default SIGTERM, SIGUSR1, SIGINT; a second SIGINT stops now).
        every_n_steps: also save every this many optimizer steps (``None``: not by steps).
        every_minutes: also save every this many minutes of training (``None``: not by time;
            ``"auto"``: Daly's optimum from the measured save time and ``interruption_rate``). Global
            rank 0's clock and interval decide, and every rank follows (one vote per step).
        interruption_rate: expected interruptions of one instance per ``rate_period_h`` (a
            probability in [0, 1)); with the node count it gives the job's MTBF for ``"auto"``, and
            a fixed ``every_minutes`` more than 2x away from the optimum draws a warning.
        rate_period_h: the period of ``interruption_rate``, in hours.
        save_on_train_epoch_end: save at the end of every training epoch.
        validate_on_notice: when a notice lands on an epoch's last batch, still run that epoch's
            scheduled validation (after the notice checkpoint is safe) and save again at the epoch's
            end, so the epoch's metrics and best checkpoint are not lost. Turn off when validation
            takes longer than the notice window allows.
        keep: how many of this callback's newest checkpoints to keep.
        dirpath: where checkpoints go (default: the trainer's ModelCheckpoint directory).
        requeue_slurm: under SLURM, run ``scontrol requeue $SLURM_JOB_ID`` after a notice save.
        drill_steps: fire drill: send this process a real SIGTERM after these global steps.
        drill_validation_epochs: fire drill: send a SIGTERM during validation in these epochs.
        drill_rate: fire drill: per-step probability of a SIGTERM (seeded by ``drill_seed``).
        drill_seed: seed of the random drill.
        notice_grace_s: a notice that the training loop cannot act on within this many seconds (a rank held
            in a collective by a frozen or dead peer) ends the job: exit 75, the MLflow run KILLED.
        stall_floor_s: with several ranks, no step boundary for ``max(stall_floor_s, stall_factor x the
            longest gap measured between boundaries)`` while no rank is busy writing is a hang, ended as
            above (the process group's own timeout is 30 minutes).
        stall_factor: see ``stall_floor_s``.

    Raises:
        ValueError: for an unknown provider or signal, or a non-positive interval.

    Example::

        trainer = Trainer(callbacks=[SpotCheckpoint(provider="aws", every_n_steps=500)],
                          plugins=[BoundedAsyncCheckpointIO(AtomicCheckpointIO())])
        trainer.fit(model, datamodule, ckpt_path=ckpt_store.newest_good(dirpath).path)
    """

    def __init__(
        self,
        provider: Literal["auto", "aws", "gcp", "azure", "none"] = "none",
        metadata_url: str | None = None,
        poll_interval_s: float = 5.0,
        metadata_timeout_s: float = 1.0,
        signals: list[str] | None = None,
        every_n_steps: int | None = None,
        every_minutes: float | Literal["auto"] | None = None,
        interruption_rate: float = 0.0,
        rate_period_h: float = 1.0,
        save_on_train_epoch_end: bool = True,
        validate_on_notice: bool = True,
        keep: int = 2,
        dirpath: str | None = None,
        requeue_slurm: bool = True,
        drill_steps: list[int] | None = None,
        drill_validation_epochs: list[int] | None = None,
        drill_rate: float = 0.0,
        drill_seed: int = 0,
        notice_grace_s: float = 20.0,
        stall_floor_s: float = 300.0,
        stall_factor: float = 20.0,
    ) -> None:
        if provider not in ("auto", "aws", "gcp", "azure", "none"):
            raise ValueError(f"SpotCheckpoint(provider={provider!r}) must be auto, aws, gcp, azure or none.")
        signals = ["SIGTERM", "SIGUSR1", "SIGINT"] if signals is None else signals
        unknown = [s for s in signals if s not in notices.SIGNALS]
        if unknown:
            raise ValueError(f"SpotCheckpoint(signals={unknown!r}): known signals are {sorted(notices.SIGNALS)}.")
        if every_minutes == "auto" and interruption_rate <= 0:
            raise ValueError("SpotCheckpoint(every_minutes='auto') needs interruption_rate > 0 "
                             f"(got {interruption_rate!r}) to derive the MTBF.")
        if not 0.0 <= interruption_rate < 1.0:
            raise ValueError(f"SpotCheckpoint(interruption_rate={interruption_rate!r}) must lie in [0, 1).")
        fixed_minutes = None if every_minutes == "auto" else every_minutes
        for name, value in (("every_n_steps", every_n_steps), ("every_minutes", fixed_minutes),
                            ("poll_interval_s", poll_interval_s), ("keep", keep), ("rate_period_h", rate_period_h),
                            ("notice_grace_s", notice_grace_s), ("stall_floor_s", stall_floor_s),
                            ("stall_factor", stall_factor)):
            if value is not None and not value > 0:  # NaN included
                raise ValueError(f"SpotCheckpoint({name}={value!r}) must be positive.")
        self.provider = provider
        self.metadata_url = metadata_url
        self.poll_interval_s = poll_interval_s
        self.metadata_timeout_s = metadata_timeout_s
        self.signals = signals
        self.every_n_steps = every_n_steps
        self.every_minutes = every_minutes
        self.interruption_rate = interruption_rate
        self.rate_period_h = rate_period_h
        self.schedule = SaveSchedule(every_n_steps, every_minutes, interruption_rate, rate_period_h)
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.validate_on_notice = validate_on_notice
        self.keep = keep
        self.dirpath = dirpath
        self.requeue_slurm = requeue_slurm
        self.drill = FireDrill(drill_steps, drill_validation_epochs, drill_rate, drill_seed)
        self.notice_grace_s, self.stall_floor_s, self.stall_factor = notice_grace_s, stall_floor_s, stall_factor

        self.mlflow_run_id: str | None = None  # kept across resumes (state_dict), as is interruptions
        self.interruptions = 0
        self.interrupted = False  # this process only, as is everything below
        self._save_at_epoch_end = False  # a notice at the epoch's last batch: validate, then save again
        self.notice: notices.Notice | None = None
        self._notice_time: float | None = None
        self._flag = threading.Event()
        self._signals = notices.SignalNotices(signals, self.notify)
        self._poller: notices.NoticePoller | None = None
        self._pending_rng: list[dict[str, Any]] | None = None
        self._last_saved_step: int | None = None  # a step saved once is not saved again at its epoch's end
        self._resumed_step: int | None = None
        self._saved_lost = 0
        self._watchdog: HangWatchdog | None = None
        self._paused_log_every = 0  # log_every_n_steps, paused for the step a notice stops at
        self._hang_record: tuple[Any, str] | None = None  # (MLflow client, run id) a hang marks KILLED (rank 0)

    # ----------------------------------------------------------------- notices
    def notify(self, notice: notices.Notice) -> None:
        """Record a notice; safe from a signal handler or another thread (sets a flag only)."""
        if not self._flag.is_set():
            self._notice_time = time.monotonic()
            self.notice = notice
            self._flag.set()

    def install_signal_handlers(self) -> None:
        """Make the configured signals set the notice flag (and nothing else)."""
        self._signals.install()

    def restore_signal_handlers(self) -> None:
        """Give the signals back to the handlers found at install time."""
        self._signals.restore()

    def _start_poller(self, trainer: Trainer) -> None:
        provider = self.provider
        if provider == "none" or trainer.local_rank != 0:
            return
        if provider == "auto":
            detected = notices.detect_provider(self.metadata_url)
            if detected is None:
                log.info("SpotCheckpoint(provider='auto'): no cloud metadata service answers; signals only.")
                return
            provider = detected
        self._poller = notices.NoticePoller(provider, self.notify, self.metadata_url, self.poll_interval_s,
                                             self.metadata_timeout_s)
        self._poller.start()

    def _vote(self, trainer: Trainer, save_due: bool = False,
              validation_follows: bool = False) -> tuple[bool, bool, bool]:
        """(notice, save, validation follows) as every rank decided them: one all-reduce, outside any handler."""
        local = self._flag.is_set()
        agreed = agree(notice=local, save_due=save_due, validation_follows=validation_follows,
                       rank=trainer.global_rank, device=trainer.strategy.root_device, distributed=distributed_world())
        if agreed.notice and not local:
            self.notify(notices.Notice("peer", "another rank received a notice"))
        return agreed.notice, agreed.save_due, agreed.validation_follows

    @property
    def interval_s(self) -> float | None:
        """Seconds between timed saves (rank 0's clock decides them)."""
        return self.schedule.interval_s

    # ------------------------------------------------------------------ saving
    def _dir(self, trainer: Trainer) -> Path:
        if self.dirpath is not None:
            return Path(self.dirpath)
        if trainer.checkpoint_callback is not None and getattr(trainer.checkpoint_callback, "dirpath", None):
            return Path(trainer.checkpoint_callback.dirpath)
        return Path(trainer.default_root_dir) / "checkpoints"

    def save(self, trainer: Trainer, wait: bool, suffix: str = "") -> Path:
        """Save a checkpoint of the current step on every rank; ``wait`` for it to be on disk."""
        started = time.monotonic()
        directory = self._dir(trainer)
        path = directory / f"step={trainer.global_step:08d}{suffix}.ckpt"
        io = trainer.strategy.checkpoint_io
        with self._busy("writing a checkpoint"):
            trainer.save_checkpoint(path, weights_only=False)  # the full training state
            if wait and isinstance(io, AsyncCheckpointIO):
                io.teardown()  # joins the writer thread; it restarts on the next save
            mirror = mirror_of(io)
            if path.is_dir() and trainer.is_global_zero:
                # sharded (distributed) checkpoints bypass the checkpoint IO: publish them here (with the metric
                # points the tracking store has not confirmed, when the IO has a publish gate)
                publish = functools.partial(self._publish_sharded, trainer, path, mirror)
                gate = getattr(io, "gate", None)
                gate.publish(trainer.global_step, publish) if gate is not None else publish()
        trainer.strategy.barrier("SpotCheckpoint.save")
        if trainer.is_global_zero:
            prune = functools.partial(self._prune, directory, mirror)
            if isinstance(io, BoundedAsyncCheckpointIO) and not wait:
                io.after_saves(prune, f"prune {directory}")  # once this save is published, off the training thread
            else:  # a save still in flight is not counted: `keep` good ones remain
                prune()
        self._last_saved_step = trainer.global_step
        self._choose_interval(trainer, save_cost_s=time.monotonic() - started)
        return path

    def _publish_sharded(self, trainer: Trainer, path: Path, mirror: RemoteCheckpoints | None,
                         points: list[Any] | None = None) -> None:
        extra: dict[str, Any] = {"mlflow_run_id": self.mlflow_run_id}
        if points:
            extra[METRICS_PENDING_KEY] = points
        ckpt_store.write_record(path, trainer.global_step, trainer.current_epoch, extra=extra)
        if mirror is not None:
            mirror.try_publish(path)

    def _prune(self, directory: Path, mirror: RemoteCheckpoints | None) -> None:
        """Keep the ``keep`` newest good checkpoints here and in the mirror."""
        ckpt_store.prune(directory, CHECKPOINT_PATTERN, self.keep)
        if mirror is not None:
            mirror.try_prune(CHECKPOINT_PATTERN, self.keep)

    def _choose_interval(self, trainer: Trainer, save_cost_s: float) -> None:
        """Restart the save clock; after the first save, Daly's interval from its cost and the job's MTBF."""
        metrics = self.schedule.saved(save_cost_s, instances=trainer.num_nodes, speak=trainer.is_global_zero)
        if metrics is not None and trainer.is_global_zero:
            self._log(trainer, metrics)

    def _validation_follows(self, trainer: Trainer) -> bool:
        """Whether this batch is its epoch's last and the epoch's validation is due after it (this rank's view)."""
        return self.validate_on_notice and trainer.enable_validation and bool(validation_due(trainer))

    def _stop_on_notice(self, trainer: Trainer, validate_after: bool = False) -> None:
        if self._watchdog is not None:
            self._watchdog.beat(trainer.global_step)  # the loop acts on the notice: not a hang
        self.interruptions += 1  # before the save: the resumed run must know about this interruption
        self.save(trainer, wait=True)
        elapsed = time.monotonic() - (self._notice_time or time.monotonic())
        self.interrupted = True
        trainer.should_stop = True
        self._keep_the_logging_cadence(trainer)
        if validate_after:  # the epoch's own validation, then a save at the epoch's end (on_train_epoch_end)
            self._save_at_epoch_end = True
        else:
            trainer.limit_val_batches = 0  # Lightning validates on should_stop: not inside a notice window
        if trainer.is_global_zero:
            source = self.notice.source if self.notice else "peer"
            mirror = mirror_of(trainer.strategy.checkpoint_io)
            metrics = {INTERRUPTIONS_KEY: self.interruptions, NOTICE_TO_SAVED_KEY: elapsed, SPOT_LOST_STEPS_KEY: 0}
            where = "on disk"
            if mirror is not None and mirror.last_publish_s is not None:
                metrics[UPLOAD_KEY] = mirror.last_publish_s
                where = f"uploaded to {mirror.url} (upload {mirror.last_publish_s:.2f} s)"
            elif mirror is not None:
                where = f"on disk, but NOT uploaded to {mirror.url} (see the error above)"
            log.warning("Interruption notice (%s) -> checkpoint of step %d %s in %.3f s; stopping.",
                        source, trainer.global_step, where, elapsed)
            window = notices.WARNING_SECONDS.get(source)
            if window is not None and elapsed > window:
                log.warning("The save took %.1f s, longer than %s's %.0f s notice window: the machine may have "
                            "gone before it finished; checkpoint more often or to faster storage.",
                            elapsed, source, window)
            self._log(trainer, metrics)
            self._requeue()

    def _keep_the_logging_cadence(self, trainer: Trainer) -> None:
        """Lightning logs the step it stops at (``should_stop``) even off its ``log_every_n_steps`` cadence. An
        uninterrupted run has no point there, and the relaunch goes on past it: skip it, so that the run's
        history is an uninterrupted run's (the cadence is back for validation and the next launch)."""
        every = trainer.log_every_n_steps
        if every and trainer.global_step % every:
            self._paused_log_every, trainer.log_every_n_steps = every, 0

    def _restore_logging_cadence(self, trainer: Trainer) -> None:
        if self._paused_log_every:
            trainer.log_every_n_steps, self._paused_log_every = self._paused_log_every, 0

    def _requeue(self) -> None:
        if self.requeue_slurm:
            notices.requeue_slurm_job()

    @staticmethod
    def _log(trainer: Trainer, metrics: dict[str, float]) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    # ------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        require_atomic_io(trainer, type(self).__name__)  # its records are what pruning and resume read
        run_id = None
        if trainer.is_global_zero:
            run_id = next((getattr(lg, "run_id", None) for lg in trainer.loggers if getattr(lg, "run_id", None)),
                          None)
        self.mlflow_run_id = trainer.strategy.broadcast(run_id, src=0) or self.mlflow_run_id
        self.install_signal_handlers()
        self._start_poller(trainer)

    @override
    def on_sanity_check_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning registers its own SIGTERM handler after `setup` (it broadcasts inside the handler
        # and then fails the run): take the signals back before the sanity check, the first thing after.
        self.install_signal_handlers()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        # and again here, for runs without a sanity check
        self.install_signal_handlers()
        if self._pending_rng is not None:
            states = self._pending_rng
            if len(states) != trainer.world_size:
                self._resumed_elsewhere(trainer, len(states))
            restore_rank_rng(states, trainer.global_rank)
            self._pending_rng = None
        if self._resumed_step is not None and trainer.is_global_zero:
            lost = lost_steps(trainer.loggers, self._resumed_step, self._steps_run(trainer), self._saved_lost)
            self._log(trainer, {SPOT_LOST_STEPS_KEY: lost})
        if isinstance(trainer.strategy.model, DistributedDataParallel):
            pin_bucket_layout(trainer.strategy.model)  # a resume at 3+ ranks reduces as the uninterrupted run
        self.schedule.restart_clock()
        self._start_watchdog(trainer)

    # ---------------------------------------------------------------- hangs
    def _start_watchdog(self, trainer: Trainer) -> None:
        """Watch for a loop that stops reaching step boundaries (see the module docstring)."""
        if self._watchdog is not None:
            return
        board = None
        if distributed_world():
            store = rendezvous_store()
            board = PeerBoard(store, trainer.global_rank, trainer.world_size) if store is not None else None
        if trainer.is_global_zero:
            logger = next((lg for lg in trainer.loggers if getattr(lg, "run_id", None)), None)
            if logger is not None and hasattr(logger.experiment, "set_terminated"):
                self._hang_record = (logger.experiment, logger.run_id)
        self._hang_exit = reported_exit_code(REQUEUE_EXIT_CODE, started_by_lightning(trainer), (REQUEUE_EXIT_CODE,))
        self._watchdog = HangWatchdog(self._end_hung_job, trainer.global_rank, set(self._signals.signums),
                                      notice_grace_s=self.notice_grace_s, stall_floor_s=self.stall_floor_s,
                                      stall_factor=self.stall_factor, board=board)
        self._watchdog.start()

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None

    def _busy(self, what: str) -> Any:
        """A context in which this rank works on its own (the watchdog does not count it as a stall)."""
        return self._watchdog.busy(what) if self._watchdog is not None else contextlib.nullcontext()

    def _end_hung_job(self, line: str) -> None:
        """From the watchdog thread: say what hung, mark the run KILLED, end this process tree, exit 75 (0 in a rank
        Lightning's launcher started: ``utils/launcher.py``). The newest published checkpoint is whole."""
        sys.stderr.write(f"atscale: {line}. Ending the job (exit {REQUEUE_EXIT_CODE}); the same command resumes "
                         "it from its newest checkpoint.\n")
        sys.stderr.flush()
        if self._hang_record is not None:
            client, run_id = self._hang_record
            marker = threading.Thread(target=client.set_terminated, args=(run_id, "KILLED"), daemon=True)
            marker.start()
            marker.join(timeout=10.0)  # the store may be slow; the processes end regardless
        kill_children()
        os._exit(self._hang_exit)

    def _resumed_elsewhere(self, trainer: Trainer, saved_world: int) -> None:
        if trainer.is_global_zero:
            tag_elastic(trainer.loggers, saved_world, trainer.world_size, trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self._watchdog is not None:
            self._watchdog.beat(step)
        if trainer.is_global_zero:
            self.drill.after_step(step)
        # rank 0's clock and interval decide a timed save for everyone (its vote alone counts)
        due_time = trainer.is_global_zero and self.schedule.due_by_clock()
        notice, due_time, validation_follows = self._vote(trainer, due_time, self._validation_follows(trainer))
        if notice:
            self._stop_on_notice(trainer, validate_after=validation_follows)
            return
        due_steps = self.schedule.due_by_steps(step)
        # the run's last step: save here, because on_train_epoch_end already counts the epoch as done
        final = trainer.max_steps > 0 and step >= trainer.max_steps
        if due_steps or due_time or final:
            self.save(trainer, wait=False)

    @override
    def on_validation_batch_end(self, trainer: Trainer, pl_module: pl.LightningModule, outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._watchdog is not None:
            self._watchdog.beat()
        if trainer.sanity_checking or not trainer.is_global_zero or batch_idx != 0:
            return
        self.drill.in_validation(trainer.current_epoch)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        if self._watchdog is not None:
            self._watchdog.beat()
        if not self.interrupted and self._vote(trainer)[0]:
            self._stop_on_notice(trainer)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_logging_cadence(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_logging_cadence(trainer)
        self._stop_watchdog()  # the wrap-up (model logging, uploads) has no step boundaries to watch

    @override
    def on_exception(self, trainer: Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_watchdog()

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        if self._save_at_epoch_end:  # after a notice at the last batch: the epoch's validation has run
            self._save_at_epoch_end = False
            started = time.monotonic()
            self.save(trainer, wait=True, suffix="-validated")
            if trainer.is_global_zero:
                log.warning("The epoch's validation ran after the notice; its end saved as well (%.2f s more).",
                            time.monotonic() - started)
            return
        if not self.save_on_train_epoch_end or self.interrupted:
            return
        if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
            return  # saved at the last batch's end
        if self._last_saved_step == trainer.global_step:
            return  # every_n_steps (or the interval) saved this very step at its batch's end
        self.save(trainer, wait=False)

    def exit_code(self) -> int | None:
        """``REQUEUE_EXIT_CODE`` once stopped on a notice (``callbacks.utils.run_report.ExitCode``): relaunch me."""
        return REQUEUE_EXIT_CODE if self.interrupted else None

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        states: list[Any] = [rng_state()]
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            states = [None] * trainer.world_size
            dist.all_gather_object(states, rng_state())
        checkpoint[RUN_METADATA_KEY] = {"mlflow_run_id": self.mlflow_run_id, "rng": states}

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        meta = checkpoint.get(RUN_METADATA_KEY) or {}
        self._pending_rng = meta.get("rng")
        self._resumed_step = int(checkpoint.get("global_step", 0))
        # CostTracker's count of lost steps up to this checkpoint, when it ran beside (one count: see lost_steps)
        self._saved_lost = max([int(state.get("lost_steps", 0)) for state in checkpoint.get("callbacks", {}).values()
                                if isinstance(state, dict)] or [0])

    @staticmethod
    def _steps_run(trainer: Trainer) -> int | None:
        """The steps file's count of every step run (CostTracker's, beside the checkpoints), if there is one."""
        places = [Path(trainer.ckpt_path).parent] if trainer.ckpt_path else []
        callback = trainer.checkpoint_callback
        if callback is not None and getattr(callback, "dirpath", None):
            places.append(Path(callback.dirpath))
        found = [n for n in (read_steps_run(place / PROGRESS_FILE) for place in places) if n is not None]
        return max(found) if found else None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"mlflow_run_id": self.mlflow_run_id, "interruptions": self.interruptions,
                "drills_fired": sorted(self.drill.fired)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # the run this fit logs to (set in setup) wins: a checkpoint of another run never names this one's records
        self.mlflow_run_id = self.mlflow_run_id or state_dict.get("mlflow_run_id")
        self.interruptions = int(state_dict.get("interruptions", 0))
        self.drill.fired = set(state_dict.get("drills_fired", []))

    @override
    def teardown(self, trainer: Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_watchdog()
        if self._poller is not None:
            self._poller.stop()
            self._poller = None
        self.restore_signal_handlers()
        io = trainer.strategy.checkpoint_io
        if isinstance(io, AsyncCheckpointIO):
            io.teardown()
        if trainer.is_global_zero:
            self._prune(self._dir(trainer), mirror_of(io))
