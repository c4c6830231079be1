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

Communication (DDP): a communication hook wraps torch's own (``allreduce_hook``, or
``fp16_compress_hook``, ``bf16_compress_hook``, ``powerSGD_hook`` with ``comm_hook=``) and is
registered on the DDP-wrapped model at train start (Lightning's ``DDPStrategy(ddp_comm_hook=)``
ignores hooks unless the device is CUDA), as one wrapper of :mod:`callbacks.utils.comm_hooks`' composed
hook, so that GradientNoiseScale can watch the same buckets. Each bucket's all-reduce is timed from the hook call
to its future's completion (``fut.then``). DDP calls a bucket's hook as soon as the bucket's
gradients are ready, so the *last* hook call marks the end of the backward's compute; the
communication still in flight after it, up to the completion of the last all-reduce, is the
*exposed* part (``exposed = max(end of last all-reduce) - (call of last bucket's hook)``, at
least 0 and at most the backward segment). ``time/comm_s`` is the wall time during which any
all-reduce was in flight (the union of the buckets' intervals), overlapped or not. On gloo, each
PowerSGD bucket is finished before the next starts (torch's PowerSGD issues its second and third
all-reduce from gloo's callback thread, which otherwise races the next bucket's all-reduce: ranks
disagree on the order and hang or abort); NCCL runs callbacks inline and needs no such care.
The ring all-reduce model of :mod:`callbacks.analysis.comm` is calibrated on the real process
group at train start (``measure_allreduce`` over 4 KiB-16 MiB, well under a second) and predicts
each step's communication from the bytes the hook sent (one all-reduce per bucket; PowerSGD's two
or three all-reduces per bucket are counted as one, so its prediction is optimistic by their
latency). Under FSDP (``ModelParallelStrategy``, no DDP wrapper) there is no hook: collective
time is read from ``torch.profiler`` on a few sampled steps (gloo's ``gloo:*`` ranges, NCCL's
kernels), and exposed communication, bytes per step and the model's prediction are *not* measured
(a summary row says so).

Serial fraction: the serial share of this run's step is ``(data wait + exposed comm + optimizer +
checkpoint per step) / (step + checkpoint per step)`` (:func:`serial_fraction`): the parts that do not
shrink when more devices share a fixed global batch (the optimizer step is replicated on every DDP
rank). Amdahl's ``s`` is a fraction of *one* device's time; measured on ``W`` devices, whose parallel
part would take ``W`` times longer on one, it is ``s = share / (share + W (1 - share))``
(:func:`amdahl_serial_fraction`; equal to the share when ``W = 1``, and it makes Amdahl's ``C(W)``
equal to ``W - share (W - 1)``, the speedup of this very run). Amdahl's law
(:func:`callbacks.analysis.scaling.amdahl_speedup`) turns ``s`` into predicted speedups at N = 2 ... 64.

Clocks: on CUDA every boundary is a CUDA event (host timers misreport asynchronous GPU work;
events are resolved once per logging window, one synchronize per window); on CPU the wall clock
``time.perf_counter`` (tests patch it). Cost per step: a handful of clock reads and list appends
(well under 1% of a step; ``python -m recipes.bench overhead`` measures the whole recipe).

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
``time/checkpoint_s``               one checkpoint's stall of the loop (per event)
``time/validation_s``               one validation run (per event, checkpoints in it excluded)
``time/mean/<key>``                 the same over the whole run, at train end (survives resume)
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
``amdahl/predicted_speedup_N``      ``1/(s + (1-s)/N)`` for N = 2, 4, 8, 16, 32, 64, at train end
==================================  =============================================================

At train end a stacked-bar ``time_breakdown.png`` goes to the run directory (the checkpoint
directory's parent, else ``trainer.default_root_dir``) and to the MLflow run, and
:meth:`StepTiming.summary_rows` gives rows for the CLI's end table.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from .analysis.comm import LinkModel, calibrate, measure_allreduce
from .analysis.scaling import amdahl_speedup
from .utils.comm_hooks import add_comm_hook_wrapper

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

log = logging.getLogger(__name__)

#: Gradient communication choices: torch's default all-reduce, or one of its compression hooks.
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
#: Parts of a step, in timeline order (they sum to the step).
PARTS = ("data", "forward", "backward", "comm_exposed", "optimizer")
#: Parts that do not shrink with more data-parallel devices (numerator of the serial fraction).
SERIAL_PARTS = ("data", "comm_exposed", "optimizer")
#: Device counts whose Amdahl speedup is logged.
PREDICT_N = (2, 4, 8, 16, 32, 64)
#: Sizes (bytes) all-reduced to calibrate the link at train start.
#: All-reduce sizes of the link calibration (bytes): up to 16 MiB, so the bandwidth term stands out of the
#: latency and the noise even on loopback (a fit on small sizes alone can find no bandwidth term at all).
CALIBRATION_SIZES = (4096, 65536, 1048576, 16777216)

_LABELS = {"data": "data wait", "forward": "forward", "backward": "backward compute",
           "comm_exposed": "exposed comm", "optimizer": "optimizer", "checkpoint": "checkpoint"}
_COLORS = {"data": "#8c8c8c", "forward": "#4c72b0", "backward": "#55a868", "comm_exposed": "#c44e52",
           "optimizer": "#dd8452", "checkpoint": "#8172b3"}


def serial_fraction(parts: dict[str, float], checkpoint_per_step: float = 0.0) -> float:
    """Serial share of a step: the parts that more data-parallel devices do not shrink, over the step.

    ``s = (data + comm_exposed + optimizer + checkpoint_per_step) / (sum(parts) + checkpoint_per_step)``.

    Args:
        parts: seconds per step of each of :data:`PARTS` (missing ones count 0).
        checkpoint_per_step: checkpoint stall amortized over the steps (total stall / steps).

    Returns:
        ``s`` in [0, 1]; ``0.0`` for an empty step.

    Raises:
        ValueError: if a part or ``checkpoint_per_step`` is negative.

    Example::

        >>> serial_fraction({"data": 1, "forward": 3, "backward": 4, "comm_exposed": 1, "optimizer": 1})
        0.3
    """
    values = {key: float(parts.get(key, 0.0)) for key in PARTS}
    for key, value in (*values.items(), ("checkpoint_per_step", checkpoint_per_step)):
        if value < 0 or math.isnan(value):
            raise ValueError(f"serial_fraction: `{key}={value!r}` must be >= 0.")
    total = sum(values.values()) + checkpoint_per_step
    if total <= 0:
        return 0.0
    return (sum(values[key] for key in SERIAL_PARTS) + checkpoint_per_step) / total


def amdahl_serial_fraction(share: float, world_size: int = 1) -> float:
    """Amdahl's ``s`` (a fraction of one device's time) from the serial share of a step on ``world_size`` devices.

    The parallel part of a step on ``W`` devices would take ``W`` times as long on one device, so
    ``s = share / (share + W (1 - share))``.

    Args:
        share: serial share of the measured step, in [0, 1] (:func:`serial_fraction`).
        world_size: devices ``W`` the step was measured on (>= 1).

    Returns:
        ``s`` in [0, 1]; ``share`` itself when ``W = 1``.

    Raises:
        ValueError: if ``share`` is outside [0, 1] or ``world_size < 1``.

    Example::

        >>> amdahl_serial_fraction(0.5, 2)  # 1 s serial + 1 s parallel on 2 devices = 1 + 2 s on one
        0.3333333333333333
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"amdahl_serial_fraction: `share={share!r}` must be in [0, 1].")
    if int(world_size) != world_size or world_size < 1:
        raise ValueError(f"amdahl_serial_fraction: `world_size={world_size!r}` must be an integer >= 1.")
    if share == 0.0:
        return 0.0
    return share / (share + world_size * (1.0 - share))


def amdahl_predictions(s: float, devices: tuple[int, ...] = PREDICT_N) -> dict[str, float]:
    """``{"amdahl/predicted_speedup_N": 1/(s + (1-s)/N)}`` for each N in ``devices``."""
    return {f"amdahl/predicted_speedup_{n}": float(amdahl_speedup(n, s)) for n in devices}


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping ``(start, end)`` intervals."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def _overlap(a: float, b: float, events: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, e1) - max(a, e0)) for e0, e1 in events)


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
        comm_hook: DDP gradient communication: ``none`` (torch's ``allreduce_hook``), ``fp16`` or
            ``bf16`` (compress to 16 bits), ``powersgd`` (low-rank PowerSGD). Timed either way.
        log_every_n_steps: optimizer steps per logged window (default: the trainer's).
        warmup_steps: first steps of each fit that are not counted (lazy init, DDP bucket rebuild).
        calibrate_comm: calibrate the all-reduce model at train start (only when world size > 1).
        powersgd_rank: PowerSGD's ``matrix_approximation_rank``.
        powersgd_start_iter: PowerSGD's ``start_powerSGD_iter`` (plain all-reduce before it; >= 2).
        profile_steps: FSDP only: steps after warm-up profiled for collective time (0: none).
        plot: write and log ``time_breakdown.png`` at train end.

    Raises:
        ValueError: for an unknown ``comm_hook`` or an out-of-range number (the message names it).

    Example::

        trainer = Trainer(strategy="ddp", devices=2, callbacks=[StepTiming(comm_hook="fp16")])
        # or in a config: trainer.callbacks: [{class_path: callbacks.timing.StepTiming,
        #                                      init_args: {comm_hook: fp16}}]
    """

    def __init__(
        self,
        comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = "none",
        log_every_n_steps: int | None = None,
        warmup_steps: int = 3,
        calibrate_comm: bool = True,
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 10,
        profile_steps: int = 2,
        plot: bool = True,
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
        self.link: LinkModel | None = None
        self.comm_mode: str = "none"  # "ddp", "fsdp" or "none"
        self.fsdp_collective_s: list[float] = []
        #: ``(global step, seconds)`` of every checkpoint of this fit (the loop's stall per save).
        self.checkpoint_log: list[tuple[int, float]] = []
        self.plot_path: Path | None = None
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
        self._comm_calls: list[list[Any]] = []
        self._in_validation = False
        self._val_start: Any = None
        self._val_nested_s = 0.0
        self._trainer: Trainer | None = None
        self._original_save: Any = None
        self._profiler: Any = None
        self._profiled_left = 0

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
        self._stop_profiler()
        if self._trainer is not None and self._original_save is not None:
            if "save_checkpoint" in vars(self._trainer):
                del self._trainer.save_checkpoint  # back to the class's method
            self._trainer, self._original_save = None, None

    def _wrap_save(self, trainer: Trainer) -> None:
        """Time every ``trainer.save_checkpoint`` (ModelCheckpoint's, SpotCheckpoint's, a user's)."""
        if self._original_save is not None:
            return
        original = trainer.save_checkpoint

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            start = self._clock.mark()
            try:
                return original(*args, **kwargs)
            finally:
                self._on_checkpoint(trainer, start, self._clock.mark())

        self._trainer, self._original_save = trainer, original
        trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]

    @override
    def on_train_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self._world = trainer.world_size
        self._steps_this_fit = 0
        self._pending, self._events, self.windows, self._comm_calls = [], [], [], []
        self._step, self._step_marks, self._window_ckpt_s = None, {}, 0.0
        self.fsdp_collective_s, self._profiled_left, self.checkpoint_log = [], 0, []
        self.comm_mode = "none"
        model = trainer.strategy.model
        distributed = trainer.world_size > 1 and dist.is_available() and dist.is_initialized()
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self.comm_mode = "ddp" if self._register_hook(model) else "none"
        elif distributed:
            self.comm_mode = "fsdp"
            self._profiled_left = self.profile_steps
        elif self.comm_hook != "none":
            log.warning("StepTiming(comm_hook=%r): the model is not DDP-wrapped; no hook registered.", self.comm_hook)
        if distributed and self.calibrate_comm:
            self._calibrate(trainer)
        self._prev_end = self._clock.mark()

    def _inner_hook(self, ddp: torch.nn.parallel.DistributedDataParallel) -> tuple[Any, Any]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        group = ddp.process_group
        if self.comm_hook == "fp16":
            return default_hooks.fp16_compress_hook, group
        if self.comm_hook == "bf16":
            return default_hooks.bf16_compress_hook, group
        if self.comm_hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=self.powersgd_rank,
                                                start_powerSGD_iter=self.powersgd_start_iter)
            return powerSGD_hook.powerSGD_hook, state
        return default_hooks.allreduce_hook, group

    def _register_hook(self, ddp: torch.nn.parallel.DistributedDataParallel) -> bool:
        """Time every bucket's communication: a wrapper in the DDP module's composed hook; False if impossible.

        The wrapper joins :func:`callbacks.utils.comm_hooks.add_comm_hook_wrapper`'s chain, so other callbacks
        (GradientNoiseScale) can observe the same buckets; StepTiming chooses the base hook (compression).
        """
        if getattr(ddp, "_atscale_timed_hook", False):
            log.warning("StepTiming: the DDP module's communication is already timed by another StepTiming "
                        "(use one, and choose compression with its comm_hook).")
            return False
        base, base_state = self._inner_hook(ddp)
        clock, calls, mode = self._clock, self._comm_calls, self.comm_hook
        # torch's PowerSGD issues its second and third all-reduce from the callback of the first; on gloo
        # callbacks run on gloo's threads, racing the next bucket's all-reduce (ranks then disagree on the
        # order: a collective mismatch or a hang). On gloo, finish each PowerSGD bucket before the next.
        serialize = mode == "powersgd" and dist.get_backend(ddp.process_group) == "gloo"

        def timed(bucket: dist.GradBucket, inner: Callable[[dist.GradBucket], Any]) -> Any:
            buffer = bucket.buffer()
            raw = buffer.numel() * buffer.element_size()
            compressing = mode == "powersgd" and base_state.iter >= base_state.start_powerSGD_iter
            before = base_state.total_numel_after_compression if compressing else 0
            record = [clock.mark(), None, raw, raw]
            fut = inner(bucket)
            if serialize:
                fut.wait()
            if mode in ("fp16", "bf16"):
                record[3] = buffer.numel() * 2
            elif compressing:
                record[3] = (base_state.total_numel_after_compression - before) * buffer.element_size()
            calls.append(record)

            def done(result: Any) -> Any:
                record[1] = clock.mark()
                return result.value()

            return fut.then(done)

        try:
            # plain averaging leaves the base free for another callback's choice; compression claims it
            add_comm_hook_wrapper(ddp, timed, base=None if mode == "none" else (base, base_state))
        except RuntimeError as err:
            log.warning("StepTiming: could not register the communication hook (%s); communication is not timed.", err)
            return False
        ddp._atscale_timed_hook = True  # type: ignore[attr-defined]
        return True

    def _calibrate(self, trainer: Trainer) -> None:
        start = time.perf_counter()
        try:
            timings = measure_allreduce(CALIBRATION_SIZES, repeats=3, warmup=1)
            self.link = calibrate([s for s, _ in timings], [t for _, t in timings], trainer.world_size, relative=True)
        except (RuntimeError, ValueError) as err:
            log.warning("StepTiming: all-reduce calibration failed (%s); no communication prediction.", err)
            return
        metrics = {"comm/latency_us": self.link.latency_s * 1e6, "comm/calibration_s": time.perf_counter() - start}
        if math.isfinite(self.link.bandwidth_bytes_per_s):  # an infinite fit is "not measurable", not 0
            metrics["comm/bandwidth_gbps"] = self.link.bandwidth_bytes_per_s * 8 / 1e9
        else:
            log.warning("StepTiming: the all-reduce timings show no bandwidth term (latency-bound); "
                        "comm/bandwidth_gbps is not logged.")
        if not math.isnan(self.link.r_squared):
            metrics["comm/calibration_r2"] = self.link.r_squared
        self._log(trainer, metrics)

    # --------------------------------------------------------------- the step
    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self._prev_end = self._clock.mark()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        start = self._clock.mark()
        if self._step is None:
            skip = self._steps_this_fit < self.warmup_steps
            self._step = _Step(skip=skip)
            self._step_global = trainer.global_step
            if not skip and self._profiled_left > 0 and trainer.is_global_zero:
                self._step.skip = True
                self._start_profiler(trainer)
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
        step.comm, self._comm_calls[:] = list(self._comm_calls), []
        self._step = None
        self._steps_this_fit += 1
        if self._profiler is not None:
            self._stop_profiler()
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
        self._log(trainer, {"time/validation_s": seconds})

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
        self._log(trainer, {"time/checkpoint_s": seconds})

    # --------------------------------------------------------------- profiler
    def _start_profiler(self, trainer: Trainer) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self._clock.__class__ is _CudaClock:
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities)
        self._profiler.__enter__()

    def _stop_profiler(self) -> None:
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        self._profiled_left -= 1
        total_us = 0.0
        for event in profiler.key_averages():
            key = event.key.lower()
            if key.startswith("gloo:"):
                total_us += event.cpu_time_total
            elif key.startswith("nccl") and "kernel" in key:
                total_us += getattr(event, "device_time_total", 0.0)
        self.fsdp_collective_s.append(total_us / 1e6)

    # ---------------------------------------------------------------- windows
    def _resolve(self, step: _Step, ref: Any, events: list[tuple[float, float]]) -> dict[str, float]:
        """Seconds per part of one step, events cut out, comm split into overlapped and exposed."""
        clock = self._clock
        parts = dict.fromkeys(PARTS, 0.0)
        backward_end = None
        for name, a, b in step.segments:
            t0, t1 = clock.seconds(ref, a), clock.seconds(ref, b)
            parts[name] += max(0.0, (t1 - t0) - _overlap(t0, t1, events))
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
                 prefix: str = "time/") -> dict[str, float]:
        """Logged keys for per-step means (a window's or, with ``prefix="time/mean/"``, the run's)."""
        step_s = sum(means[p] for p in PARTS)
        metrics = {f"{prefix}{p}_s": means[p] for p in PARTS}
        metrics[f"{prefix}step_s"] = step_s
        if step_s > 0:
            metrics[f"{prefix}samples_per_s"] = samples_per_step * self._world / step_s
        if self.comm_mode == "ddp":
            metrics[f"{prefix}comm_s"] = means["comm"]
            metrics["comm/measured_s"] = means["comm"]
            metrics["comm/bytes_per_step"] = means["bytes"]
            metrics["comm/hook_calls_per_step"] = means["hook_calls"]
            if self.link is not None:
                metrics["comm/predicted_s"] = means["comm_predicted"]
        if self.comm_mode == "fsdp" and self.fsdp_collective_s:
            metrics["comm/fsdp_collective_s"] = sum(self.fsdp_collective_s) / len(self.fsdp_collective_s)
        share = serial_fraction(means, ckpt_per_step)
        metrics[f"{prefix}serial_share"] = share
        if prefix != "time/":  # the run's Amdahl fraction: logged once, at train end
            metrics[f"{prefix}checkpoint_per_step_s"] = ckpt_per_step
            s = amdahl_serial_fraction(share, self._world)
            metrics["amdahl/serial_fraction"] = s
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
        self._stop_profiler()
        self._flush(trainer)
        means = self.mean_parts()
        if not means:
            return
        self._log(trainer, self._metrics(means, self.samples / self.steps, self.checkpoint_s / self.steps,
                                         prefix="time/mean/"))
        if self.plot and trainer.is_global_zero:
            self.plot_path = self._write_plot(trainer)

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
        rate = self.samples * self._world / (step * self.steps) if step > 0 else 0.0
        rows = [("time/step", f"{step * 1e3:.2f} ms mean over {self.steps} steps, {rate:,.0f} samples/s")]
        for part in PARTS:
            share = means[part] / step if step > 0 else 0.0
            text = f"{means[part] * 1e3:.2f} ms ({share:.1%})"
            if part == "comm_exposed" and self.comm_mode != "ddp":
                text = ("none (one process)" if self._world == 1 else
                        "not measured (FSDP: inside backward)" if self.comm_mode == "fsdp" else "not measured")
            rows.append((f"  {_LABELS[part]}", text))
        if self.checkpoints:
            rows.append(("  checkpoint", f"{self.checkpoints} x {self.checkpoint_s / self.checkpoints:.3f} s "
                                         f"(loop stall; {self.checkpoint_s / self.steps * 1e3:.2f} ms per step)"))
        if self.validations:
            rows.append(("  validation", f"{self.validations} x {self.validation_s / self.validations:.3f} s"))
        if self.comm_mode == "ddp":
            text = (f"{self.comm_hook} hook, {means['hook_calls']:.0f} bucket(s), {means['bytes'] / 1e6:.3f} MB/step, "
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
        share = serial_fraction(means, self.checkpoint_s / self.steps)
        s = amdahl_serial_fraction(share, self._world)
        preds = ", ".join(f"x{amdahl_speedup(n, s):.2f} at N={n}" for n in (2, 4, 8))
        ceiling = "inf" if s == 0 else f"{1 / s:.1f}"
        where = "" if self._world == 1 else f" (serial share {share:.3f} of a step on {self._world} devices)"
        rows.append(("amdahl/serial_fraction", f"{s:.3f}{where} -> speedup {preds} (ceiling x{ceiling})"))
        if self.plot_path is not None:
            rows.append(("time breakdown", str(self.plot_path)))
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


def plot_breakdown(path: Path, windows: list[tuple[int, dict[str, float]]], mean: dict[str, float],
                   checkpoint_per_step: float, s: float) -> Path:
    """Stacked bars of the step's parts: one per logged window, and the run's mean with checkpoints.

    Args:
        path: PNG to write (its directory is created).
        windows: ``(global step, per-step means)`` of each logged window.
        mean: the run's per-step means.
        checkpoint_per_step: checkpoint stall amortized per step, stacked on the mean bar.
        s: the run's Amdahl serial fraction, for the title.

    Returns:
        ``path``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_w, ax_m = fig.subplots(1, 2, width_ratios=[4, 1])
    labels = [str(step) for step, _ in windows]
    bottoms = [0.0] * len(windows)
    for part in PARTS:
        heights = [m.get(part, 0.0) * 1e3 for _, m in windows]
        ax_w.bar(labels, heights, bottom=bottoms, color=_COLORS[part], label=_LABELS[part])
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax_w.set_xlabel("global step (end of logged window)")
    ax_w.set_ylabel("ms per optimizer step")
    ax_w.set_title("per window")
    if len(labels) > 12:
        ax_w.set_xticks(range(0, len(labels), max(1, len(labels) // 12)))
    bottom = 0.0
    for part in (*PARTS, "checkpoint"):
        height = (checkpoint_per_step if part == "checkpoint" else mean.get(part, 0.0)) * 1e3
        ax_m.bar(["run mean"], [height], bottom=[bottom], color=_COLORS[part], label=_LABELS[part])
        bottom += height
    ax_m.set_title("whole run")
    ax_m.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small")
    fig.suptitle(f"Where the time goes — serial fraction s = {s:.3f}, Amdahl ceiling "
                 f"{'inf' if s == 0 else f'x{1 / s:.1f}'}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
