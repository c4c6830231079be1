"""Where the time goes: data, compute, gradient communication, optimizer, checkpoints, validation.

``StepTiming`` splits every optimizer step into consecutive segments between Lightning's hooks,
so the parts add up to the step exactly:

===================  =====================================================================
part                 from -> to
===================  =====================================================================
data wait            previous ``on_train_batch_end`` (or epoch start) -> ``on_train_batch_start``:
                     fetching the next batch, host-to-device copy, loop bookkeeping
forward              ``on_train_batch_start`` -> ``on_before_backward`` (training_step, loss)
backward compute     ``on_before_backward`` -> ``on_after_backward``, less the exposed communication
exposed comm         gradient all-reduce that was still running after the backward's compute ended
optimizer            ``on_after_backward`` -> ``on_train_batch_end`` (clipping, ``optimizer.step``)
===================  =====================================================================

Under DDP the data-wait segment also holds the loop's per-step collectives (Lightning's SIGTERM
broadcast, SpotCheckpoint's notice all-reduce), in which a rank waits for the slowest rank: on a
busy machine that straggler wait shows up as data wait. Timings are rank 0's.

Checkpoints (every ``trainer.save_checkpoint``, timed around the call) and validation runs
(``on_validation_start`` -> ``on_validation_end``) are events: their time is cut out of whichever
segment they fall in and reported on its own, per event.

Communication: under DDP each bucket's all-reduce is timed through the DDP comm hook; what is still in
flight after the last bucket's hook call is the *exposed* part. A ring all-reduce model calibrated at train
start predicts it (:mod:`callbacks.utils.comm_timer`). Under FSDP, collective time is sampled with
``torch.profiler``. Compression is chosen by :class:`callbacks.compression.GradientCompression`; this
callback only observes (bytes on the wire included).

Serial fraction: ``(data wait + exposed comm + optimizer + checkpoint per step) / (step + checkpoint
per step)``, the parts that do not shrink with more data-parallel devices, turned into Amdahl's ``s``
of one device's time and its predicted speedups (:mod:`callbacks.analysis.step_time`).

Clocks: CUDA events on GPU (resolved once per logging window), ``time.perf_counter`` on CPU. Cost per
step: a handful of clock reads and list appends (``python -m recipes.bench overhead`` measures it).

Logged metrics (rank 0; means over a window of ``log_every_n_steps`` optimizer steps after
``warmup_steps``):

==================================  =============================================================
key                                 meaning
==================================  =============================================================
``time/step_s``                     seconds per optimizer step (checkpoints, validation excluded)
``time/data_s``                     data wait per step
``time/forward_s``                  forward per step
``time/backward_s``                 backward compute per step (exposed comm excluded)
``time/comm_exposed_s``             communication not overlapped with the backward, per step
``time/optimizer_s``                optimizer step per step
``time/comm_s``                     wall time with an all-reduce in flight, per step (DDP)
``time/samples_per_s``              global samples/s (local batch x world size / step time)
``time/checkpoint_s``               the loop's stall for the checkpoints of one step (per step saved)
``time/validation_s``               one validation run (per event, checkpoints in it excluded)
``time/mean/<key>``                 the same over the whole run, at train end (survives resume)
``comm/mean/<key>``                 the ``comm/`` means below over the whole run, at train end
``comm/bytes_per_step``             bytes all-reduced per step (as sent: fp16 = 2 per element)
``comm/hook_calls_per_step``        comm-hook calls per step (= DDP buckets)
``comm/measured_s``                 = ``time/comm_s``
``comm/predicted_s``                ring model's prediction for the same bytes and buckets
``comm/bandwidth_gbps``             calibrated link bandwidth B (Gbit/s), at train start
``comm/latency_us``                 calibrated per-step latency a (microseconds), at train start
``comm/calibration_s``              seconds the calibration took (and ``comm/calibration_r2``)
``comm/fsdp_collective_s``          FSDP: collective time per sampled step (torch.profiler)
``time/serial_share``               serial share of this run's step (per window)
``amdahl/serial_fraction``          Amdahl's s of the whole run (one device's time), at train end
``amdahl/serial_fraction/world_N``  the same, under the world size N it was measured at
``amdahl/predicted_speedup_N``      ``1/(s + (1-s)/N)`` for N = 2, 4, 8, 16, 32, 64, at train end
==================================  =============================================================

At train end a stacked-bar ``time_breakdown.png`` goes to the run directory (the checkpoint
directory's parent, else ``trainer.default_root_dir``) and to the MLflow run, and
:meth:`StepTiming.summary_rows` gives rows for the CLI's end table.

Copy with it (paths under ``callbacks/``, each folder with an ``__init__.py``):
``analysis/{step_time,scaling,comm_model,keys}.py``, ``utils/{comm_timer,comm_hooks,compat,profiler,timing_report}.py``
(and ``compression.py`` for the deprecated ``comm_hook`` argument).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from .analysis.keys import (
    CHECKPOINT_STALL_KEY,
    COMM_MEAN_PREFIX,
    COMM_PREFIX,
    SERIAL_KEY,
    TIME_MEAN_PREFIX,
    TIME_PREFIX,
    VALIDATION_TIME_KEY,
    serial_key_at,
)
from .analysis.scaling import amdahl_speedup
from .analysis.step_time import (
    PARTS,
    SERIAL_PARTS,
    amdahl_predictions,
    amdahl_serial_fraction,
    overlap,
    serial_fraction,
    union_length,
)
from .utils.comm_timer import CALIBRATION_SIZES, CommTimer
from .utils.compat import time_every_save
from .utils.timing_report import LABELS, plot_breakdown

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

log = logging.getLogger(__name__)

#: Deprecated ``comm_hook`` values (compression is :class:`callbacks.compression.GradientCompression`'s job).
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")

__all__ = ["CALIBRATION_SIZES", "PARTS", "SERIAL_PARTS", "StepTiming", "amdahl_predictions",
           "amdahl_serial_fraction", "batch_size_of", "plot_breakdown", "serial_fraction", "union_length"]


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (0 if it holds none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = batch_size_of(item)
            if size:
                return size
    return 0


class _HostClock:
    """Wall clock; marks are floats."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        return float(end - start)

    def sync(self) -> None:
        pass


class _CudaClock:
    """CUDA events on the current stream; resolved after a synchronize."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) / 1e3

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)


@dataclass
class _Step:
    """Raw marks of one optimizer step (one or more batches under gradient accumulation)."""

    segments: list[tuple[str, Any, Any]] = field(default_factory=list)
    comm: list[list[Any]] = field(default_factory=list)  # [call mark, done mark, bytes raw, bytes sent]
    samples: int = 0
    skip: bool = False  # warm-up or profiled: measured, not counted


class StepTiming(Callback):
    """Measure where each optimizer step's time goes, and what that implies for scaling.

    Args:
        log_every_n_steps: optimizer steps per logged window (default: the trainer's).
        warmup_steps: first steps of each fit that are not counted (lazy init, DDP bucket rebuild).
        calibrate_comm: calibrate the all-reduce model at train start (only when world size > 1).
        profile_steps: FSDP only: steps after warm-up profiled for collective time (0: none).
        plot: write and log ``time_breakdown.png`` at train end.
        comm_hook: deprecated, kept so that the recorded configs of earlier runs still load and
            reproduce: compression is :class:`callbacks.compression.GradientCompression`'s (``method``,
            ``powersgd_rank``, ...).
        powersgd_rank: deprecated, as ``comm_hook``.
        powersgd_start_iter: deprecated, as ``comm_hook``.

    Raises:
        ValueError: for an out-of-range number or an unknown ``comm_hook`` (the message names it).

    Example::

        trainer = Trainer(strategy="ddp", devices=2, callbacks=[StepTiming(log_every_n_steps=10)])
        # or in a config: trainer.callbacks: [{class_path: callbacks.timing.StepTiming,
        #                                      init_args: {log_every_n_steps: 10}}]
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        warmup_steps: int = 3,
        calibrate_comm: bool = True,
        profile_steps: int = 2,
        plot: bool = True,
        comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = "none",
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 10,
    ) -> None:
        if comm_hook not in COMM_HOOKS:
            raise ValueError(f"StepTiming(comm_hook={comm_hook!r}) is not one of {', '.join(COMM_HOOKS)}.")
        for name, value, low in (("log_every_n_steps", log_every_n_steps, 1), ("warmup_steps", warmup_steps, 0),
                                 ("powersgd_rank", powersgd_rank, 1), ("powersgd_start_iter", powersgd_start_iter, 2),
                                 ("profile_steps", profile_steps, 0)):
            if value is not None and (isinstance(value, bool) or int(value) != value or value < low):
                raise ValueError(f"StepTiming({name}={value!r}) must be an integer >= {low}.")
        self.comm_hook = comm_hook
        self.log_every_n_steps = log_every_n_steps
        self.warmup_steps = warmup_steps
        self.calibrate_comm = calibrate_comm
        self.powersgd_rank = powersgd_rank
        self.powersgd_start_iter = powersgd_start_iter
        self.profile_steps = profile_steps
        self.plot = plot

        # Totals over counted steps of the whole run (state_dict).
        self.steps = 0
        self.samples = 0
        self.totals: dict[str, float] = dict.fromkeys((*PARTS, "comm", "comm_predicted", "bytes", "hook_calls"), 0.0)
        self.checkpoints = 0
        self.checkpoint_s = 0.0
        self.validations = 0
        self.validation_s = 0.0
        # This fit only.
        self.comm = CommTimer(time.perf_counter, calibrate_comm, profile_steps)
        #: ``(global step, seconds)`` of every checkpoint of this fit (the loop's stall per save).
        self.checkpoint_log: list[tuple[int, float]] = []
        self.plot_path: Path | None = None
        #: Set by a runner that calls :meth:`write_deferred_plot` once ``trainer.fit`` has returned (the CLI):
        #: the plot (~2 s of matplotlib) is then drawn after fit instead of inside it.
        self.defer_plot = False
        self._plot_trainer: Trainer | None = None
        self.windows: list[tuple[int, dict[str, float]]] = []
        self._clock: _HostClock | _CudaClock = _HostClock()
        self._world = 1
        self._log_every = 1
        self._steps_this_fit = 0
        self._prev_end: Any = None
        self._step: _Step | None = None
        self._step_marks: dict[str, Any] = {}
        self._step_global = 0
        self._pending: list[_Step] = []
        self._events: list[tuple[Any, Any]] = []
        self._window_ckpt_s = 0.0
        self._unlogged_ckpt_s: float | None = None  # this step's checkpoint stall, not logged yet
        self._in_validation = False
        self._val_start: Any = None
        self._val_nested_s = 0.0
        self._undo_save_timing: Callable[[], None] | None = None

    @property
    def world_size(self) -> int:
        """Processes of the current (or last) fit."""
        return self._world

    @property
    def comm_mode(self) -> str:
        """``ddp`` (hook-timed), ``fsdp`` (profiler-sampled) or ``none``, for the current fit."""
        return self.comm.mode

    @property
    def link(self) -> Any:
        """The calibrated all-reduce model (:class:`callbacks.analysis.comm_model.LinkModel`) or None."""
        return self.comm.link

    @property
    def fsdp_collective_s(self) -> list[float]:
        """FSDP: collective seconds of each profiled step of this fit."""
        return self.comm.fsdp_collective_s

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        device = trainer.strategy.root_device
        self._clock = _CudaClock(device) if device.type == "cuda" else _HostClock()
        self._log_every = self.log_every_n_steps or max(1, int(trainer.log_every_n_steps or 1))
        self._wrap_save(trainer)

    @override
    def teardown(self, trainer: Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.comm.stop_profiler()
        if self._undo_save_timing is not None:
            self._undo_save_timing()
            self._undo_save_timing = None

    def _wrap_save(self, trainer: Trainer) -> None:
        """Time every ``trainer.save_checkpoint`` (ModelCheckpoint's, SpotCheckpoint's, a user's)."""
        if self._undo_save_timing is not None:
            return

        def timed(save: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            start = self._clock.mark()
            try:
                return save(*args, **kwargs)
            finally:
                self._on_checkpoint(trainer, start, self._clock.mark())

        self._undo_save_timing = time_every_save(trainer, timed)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self._world = trainer.world_size
        self._steps_this_fit = 0
        self._pending, self._events, self.windows = [], [], []
        self._step, self._step_marks, self._window_ckpt_s = None, {}, 0.0
        self.checkpoint_log = []
        self.comm = CommTimer(self._clock.mark, self.calibrate_comm, self.profile_steps)
        if self.comm_hook != "none":
            self._compress_deprecated(trainer)
        self._log(trainer, self.comm.start(trainer, cuda=isinstance(self._clock, _CudaClock)))
        self._prev_end = self._clock.mark()

    def _compress_deprecated(self, trainer: Trainer) -> None:
        """``StepTiming(comm_hook=...)`` of earlier configs: register the compression they asked for."""
        from .compression import register_compression

        model = trainer.strategy.model
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            log.warning("StepTiming(comm_hook=%r): the model is not DDP-wrapped; no hook registered.", self.comm_hook)
            return
        log.warning("StepTiming(comm_hook=%r) is deprecated: use callbacks.compression.GradientCompression"
                    "(method=%r) (configs/strategy/ddp-*-compress.yaml, ddp-powersgd.yaml).", self.comm_hook,
                    self.comm_hook)
        register_compression(model, self.comm_hook, self.powersgd_rank, self.powersgd_start_iter)

    # --------------------------------------------------------------- the step
    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self._prev_end = self._clock.mark()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        start = self._clock.mark()
        if self._unlogged_ckpt_s is not None:
            self._log_checkpoint_stall(trainer)
        if self._step is None:
            skip = self._steps_this_fit < self.warmup_steps
            self._step = _Step(skip=skip)
            self._step_global = trainer.global_step
            if not skip and trainer.is_global_zero and self.comm.start_profiled_step():
                self._step.skip = True  # profiled: measured, not counted
        self._step.segments.append(("data", self._prev_end if self._prev_end is not None else start, start))
        self._step.samples += batch_size_of(batch)
        self._step_marks = {"start": start}

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if "before_backward" not in self._step_marks:  # manual optimization may call backward twice
            self._step_marks["before_backward"] = self._clock.mark()

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self._step_marks["after_backward"] = self._clock.mark()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        end = self._clock.mark()
        step, marks = self._step, self._step_marks
        if step is None or "start" not in marks:
            self._prev_end = end
            return
        points = [("forward", marks["start"])]
        if "before_backward" in marks:
            points.append(("backward", marks["before_backward"]))
        if "after_backward" in marks:
            points.append(("optimizer", marks["after_backward"]))
        points.append(("", end))
        for (name, a), (_, b) in itertools.pairwise(points):
            step.segments.append((name, a, b))
        self._prev_end = end
        self._step_marks = {}
        stepped = trainer.global_step != self._step_global or not pl_module.automatic_optimization
        if not stepped:
            return  # gradient accumulation: the optimizer step spans more batches
        step.comm = self.comm.take_calls()
        self._step = None
        self._steps_this_fit += 1
        self.comm.stop_profiler()
        self._pending.append(step)
        if trainer.global_step % self._log_every == 0:
            self._flush(trainer)

    # ----------------------------------------------------------------- events
    @override
    def on_validation_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self._in_validation, self._val_nested_s = True, 0.0
        self._val_start = self._clock.mark()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        if not self._in_validation:
            return
        end = self._clock.mark()
        self._in_validation = False
        self._events.append((self._val_start, end))
        self._clock.sync()
        seconds = max(0.0, self._clock.seconds(self._val_start, end) - self._val_nested_s)
        self.validations += 1
        self.validation_s += seconds
        self._log(trainer, {VALIDATION_TIME_KEY: seconds})

    def _on_checkpoint(self, trainer: Trainer, start: Any, end: Any) -> None:
        self._clock.sync()
        seconds = self._clock.seconds(start, end)
        if self._in_validation:
            self._val_nested_s += seconds  # the validation interval already covers it
        else:
            self._events.append((start, end))
        self.checkpoints += 1
        self.checkpoint_s += seconds
        self.checkpoint_log.append((trainer.global_step, seconds))
        self._window_ckpt_s += seconds
        # one point per step: the saves of one step (a best and a periodic one at an epoch's end) are summed and
        # logged when the step's saving is over, at the next batch's start or the training's end
        self._unlogged_ckpt_s = (self._unlogged_ckpt_s or 0.0) + seconds

    def _log_checkpoint_stall(self, trainer: Trainer) -> None:
        if self._unlogged_ckpt_s is not None:
            self._log(trainer, {CHECKPOINT_STALL_KEY: self._unlogged_ckpt_s})
            self._unlogged_ckpt_s = None

    # ---------------------------------------------------------------- windows
    def _resolve(self, step: _Step, ref: Any, events: list[tuple[float, float]]) -> dict[str, float]:
        """Seconds per part of one step, events cut out, comm split into overlapped and exposed."""
        clock = self._clock
        parts = dict.fromkeys(PARTS, 0.0)
        backward_end = None
        for name, a, b in step.segments:
            t0, t1 = clock.seconds(ref, a), clock.seconds(ref, b)
            parts[name] += max(0.0, (t1 - t0) - overlap(t0, t1, events))
            if name == "backward":
                backward_end = t1
        calls = [(clock.seconds(ref, c[0]), clock.seconds(ref, c[1]), c[2], c[3]) for c in step.comm
                 if c[1] is not None]
        out = {**parts, "comm": 0.0, "comm_predicted": 0.0, "bytes": 0.0, "hook_calls": float(len(step.comm))}
        if calls:
            compute_end = max(c[0] for c in calls)
            comm_end = max(c[1] for c in calls)
            if backward_end is not None:
                comm_end = min(comm_end, backward_end)
            exposed = min(max(0.0, comm_end - compute_end), parts["backward"])
            out["comm_exposed"] = exposed
            out["backward"] = parts["backward"] - exposed
            out["comm"] = union_length([(c[0], c[1]) for c in calls])
            out["bytes"] = float(sum(c[3] for c in calls))
            if self.link is not None:
                out["comm_predicted"] = sum(self.link.predict(c[3], self._world) for c in calls)
        return out

    def _flush(self, trainer: Trainer) -> None:
        """Resolve the pending steps, add them to the totals and log the window's means (rank 0)."""
        pending, self._pending = self._pending, []
        counted = [s for s in pending if not s.skip]
        events, self._events = self._events, []
        if not counted:
            return
        self._clock.sync()
        ref = counted[0].segments[0][1]
        resolved_events = [(self._clock.seconds(ref, a), self._clock.seconds(ref, b)) for a, b in events]
        window = dict.fromkeys(self.totals, 0.0)
        samples = 0
        for step in counted:
            for key, value in self._resolve(step, ref, resolved_events).items():
                window[key] += value
            samples += step.samples
        n = len(counted)
        self.steps += n
        self.samples += samples
        for key, value in window.items():
            self.totals[key] += value
        means = {key: value / n for key, value in window.items()}
        ckpt_per_step, self._window_ckpt_s = self._window_ckpt_s / n, 0.0
        self.windows.append((trainer.global_step, means))
        self._log(trainer, self._metrics(means, samples / n, ckpt_per_step))

    def _metrics(self, means: dict[str, float], samples_per_step: float, ckpt_per_step: float,
                 prefix: str = TIME_PREFIX) -> dict[str, float]:
        """Logged keys for per-step means (a window's or, with ``prefix=TIME_MEAN_PREFIX``, the run's)."""
        step_s = sum(means[p] for p in PARTS)
        metrics = {f"{prefix}{p}_s": means[p] for p in PARTS}
        metrics[f"{prefix}step_s"] = step_s
        if step_s > 0:
            metrics[f"{prefix}samples_per_s"] = samples_per_step * self._world / step_s
        # the run's means go under comm/mean/: a key logged per window and again at train end would hold two
        # points at the last step
        comm = COMM_PREFIX if prefix == TIME_PREFIX else COMM_MEAN_PREFIX
        if self.comm_mode == "ddp":
            metrics[f"{prefix}comm_s"] = means["comm"]
            metrics[f"{comm}measured_s"] = means["comm"]
            metrics[f"{comm}bytes_per_step"] = means["bytes"]
            metrics[f"{comm}hook_calls_per_step"] = means["hook_calls"]
            if self.link is not None:
                metrics[f"{comm}predicted_s"] = means["comm_predicted"]
        if self.comm_mode == "fsdp" and self.fsdp_collective_s:
            metrics[f"{comm}fsdp_collective_s"] = sum(self.fsdp_collective_s) / len(self.fsdp_collective_s)
        share = serial_fraction(means, ckpt_per_step)
        metrics[f"{prefix}serial_share"] = share
        if prefix != TIME_PREFIX:  # the run's Amdahl fraction: logged once, at train end
            metrics[f"{prefix}checkpoint_per_step_s"] = ckpt_per_step
            s = amdahl_serial_fraction(share, self._world)
            metrics[SERIAL_KEY] = s
            # per world size too: a run resumed on another device count keeps each size's measurement
            metrics[serial_key_at(self._world)] = s
            metrics.update(amdahl_predictions(s))
        return metrics

    # -------------------------------------------------------------- run level
    def mean_parts(self) -> dict[str, float]:
        """Seconds per counted step of the whole run, per part and comm total (empty before any step)."""
        if self.steps == 0:
            return {}
        return {key: value / self.steps for key, value in self.totals.items()}

    def run_serial_fraction(self) -> float | None:
        """The whole run's Amdahl ``s`` (checkpoint stall amortized over its steps), or None before any step."""
        means = self.mean_parts()
        if not means:
            return None
        return amdahl_serial_fraction(serial_fraction(means, self.checkpoint_s / self.steps), self._world)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self.comm.stop_profiler()
        self._log_checkpoint_stall(trainer)
        self._flush(trainer)
        means = self.mean_parts()
        if not means:
            return
        self._log(trainer, self._metrics(means, self.samples / self.steps, self.checkpoint_s / self.steps,
                                         prefix=TIME_MEAN_PREFIX))
        if self.plot and trainer.is_global_zero:
            if self.defer_plot:
                self._plot_trainer = trainer
            else:
                self.plot_path = self._write_plot(trainer)

    def write_deferred_plot(self) -> Path | None:
        """Write (and log) the plot that ``defer_plot`` held back at train end, if any."""
        trainer, self._plot_trainer = self._plot_trainer, None
        if trainer is not None:
            self.plot_path = self._write_plot(trainer)
        return self.plot_path

    def after_fit(self, trainer: Trainer) -> None:
        """After ``trainer.fit`` (``callbacks.utils.run_report.AfterFit``): the deferred plot, off the loop."""
        self.write_deferred_plot()

    def run_dir(self, trainer: Trainer) -> Path:
        """The checkpoint directory's parent (the CLI's run directory), else ``default_root_dir``."""
        ckpt = trainer.checkpoint_callback
        dirpath = getattr(ckpt, "dirpath", None) if ckpt is not None else None
        return Path(dirpath).parent if dirpath else Path(trainer.default_root_dir)

    def _write_plot(self, trainer: Trainer) -> Path | None:
        path = self.run_dir(trainer) / "time_breakdown.png"
        try:
            plot_breakdown(path, self.windows, self.mean_parts(), self.checkpoint_s / max(1, self.steps),
                           self.run_serial_fraction() or 0.0)
        except (OSError, ValueError) as err:
            log.warning("StepTiming: could not write %s (%s).", path, err)
            return None
        for logger in trainer.loggers:
            run_id = getattr(logger, "run_id", None)
            experiment = getattr(logger, "experiment", None)
            if run_id and hasattr(experiment, "log_artifact"):
                experiment.log_artifact(run_id, str(path))
        return path

    def summary_rows(self, metrics: dict[str, float]) -> list[tuple[str, str]]:
        """Rows for the CLI's end table: the mean step and its parts, events, comm, serial fraction."""
        means = self.mean_parts()
        if not means:
            return [("time/step", f"no step measured after the {self.warmup_steps} warm-up steps")]
        step = sum(means[p] for p in PARTS)
        rate = self.samples * self.world_size / (step * self.steps) if step > 0 else 0.0
        rows = [("time/step", f"{step * 1e3:.2f} ms mean over {self.steps} steps, {rate:,.0f} samples/s")]
        for part in PARTS:
            share = means[part] / step if step > 0 else 0.0
            text = f"{means[part] * 1e3:.2f} ms ({share:.1%})"
            if part == "comm_exposed" and self.comm_mode != "ddp":
                text = ("none (one process)" if self.world_size == 1 else
                        "not measured (FSDP: inside backward)" if self.comm_mode == "fsdp" else "not measured")
            rows.append((f"  {LABELS[part]}", text))
        if self.checkpoints:
            rows.append(("  checkpoint", f"{self.checkpoints} x {self.checkpoint_s / self.checkpoints:.3f} s "
                                         f"(loop stall; {self.checkpoint_s / self.steps * 1e3:.2f} ms per step)"))
        if self.validations:
            rows.append(("  validation", f"{self.validations} x {self.validation_s / self.validations:.3f} s"))
        if self.comm_mode == "ddp":
            text = (f"{self.comm.summary_name()}, {means['hook_calls']:.0f} bucket(s), "
                    f"{means['bytes'] / 1e6:.3f} MB/step, "
                    f"{means['comm'] * 1e3:.2f} ms/step in flight, {means['comm_exposed'] * 1e3:.2f} ms exposed")
            if self.link is not None:
                gbps = self.link.bandwidth_bytes_per_s * 8 / 1e9
                text += (f"; model {means['comm_predicted'] * 1e3:.2f} ms "
                         f"(B {gbps:.2f} Gbit/s, a {self.link.latency_s * 1e6:.1f} us)")
            rows.append(("comm", text))
        elif self.comm_mode == "fsdp":
            measured = (f"{sum(self.fsdp_collective_s) / len(self.fsdp_collective_s) * 1e3:.2f} ms collectives/step "
                        f"(torch.profiler, {len(self.fsdp_collective_s)} sampled steps)"
                        if self.fsdp_collective_s else "no step profiled")
            rows.append(("comm (FSDP)", f"{measured}; NOT measured under FSDP: exposed comm (counted as backward), "
                                        "bytes per step, model prediction"))
        rows.extend(self.projection_rows(means))
        if self.plot_path is not None:
            rows.append(("time breakdown", str(self.plot_path)))
        return rows

    def projection_rows(self, means: dict[str, float]) -> list[tuple[str, str]]:
        """Amdahl's projection, said to be one, with what it assumes and what was measured beside it.

        On one process the serial share holds no communication and no second rank's threads on shared
        cores, so the projection is an upper bound; on N ranks it stands beside what those N measured.
        """
        share = serial_fraction(means, self.checkpoint_s / self.steps)
        s = amdahl_serial_fraction(share, self.world_size)
        preds = ", ".join(f"x{amdahl_speedup(n, s):.2f} at N={n}" for n in (2, 4, 8))
        ceiling = "inf" if s == 0 else f"{1 / s:.1f}"
        rows = [(SERIAL_KEY, f"{s:.3f} -> projected speedup {preds} (ceiling x{ceiling})")]
        if self.world_size == 1:
            rows.append(("  projection", "Amdahl's law from this one process's serial share (data wait, optimizer, "
                                         "checkpoints), not a measurement: it assumes forward and backward divide "
                                         "perfectly over N devices that share no cores, and adds no communication "
                                         "(none on one process). Measure: python -m recipes.scale --devices 1,2"))
        else:
            comm = (f", exposed comm {means['comm_exposed'] * 1e3:.2f} ms/step" if self.comm_mode == "ddp"
                    else ", exposed comm not measured" if self.comm_mode == "fsdp" else "")
            rows.append(("  measured", f"on {self.world_size} devices: serial share {share:.3f} of a "
                                       f"{sum(means[p] for p in PARTS) * 1e3:.2f} ms step{comm}; the projection "
                                       "assumes these stay as measured at every N (a speedup against one process "
                                       "is measured by python -m recipes.scale)"))
        return rows

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "samples": self.samples, "totals": dict(self.totals),
                "checkpoints": self.checkpoints, "checkpoint_s": self.checkpoint_s,
                "validations": self.validations, "validation_s": self.validation_s}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = int(state_dict.get("steps", 0))
        self.samples = int(state_dict.get("samples", 0))
        self.totals.update({k: float(v) for k, v in state_dict.get("totals", {}).items()})
        self.checkpoints = int(state_dict.get("checkpoints", 0))
        self.checkpoint_s = float(state_dict.get("checkpoint_s", 0.0))
        self.validations = int(state_dict.get("validations", 0))
        self.validation_s = float(state_dict.get("validation_s", 0.0))

    @staticmethod
    def _log(trainer: Trainer, metrics: dict[str, float]) -> None:
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

