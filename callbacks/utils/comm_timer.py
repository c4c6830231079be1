"""Time a run's gradient communication: DDP buckets through the comm hook, FSDP collectives by profiler.

DDP: a wrapper joins the DDP module's composed comm hook (:mod:`callbacks.utils.comm_hooks`) and
records, for each bucket, the call of its hook, the completion of its future (``fut.then``), the
bucket's bytes and the bytes the base hook put on the wire (compression sends fewer). DDP calls a
bucket's hook as soon as its gradients are ready, so the *last* call marks the end of the backward's
compute; what is still in flight after it is the *exposed* communication. The ring all-reduce model
(:mod:`callbacks.analysis.comm_model`) is calibrated on the real process group at train start
(``measure_allreduce`` over 4 KiB-16 MiB, well under a second) and predicts each step's
communication from the bytes sent (one all-reduce per bucket; PowerSGD's two or three all-reduces per
bucket count as one, so its prediction is optimistic by their latency).

FSDP (no DDP wrapper, no hook): collective time is read from ``torch.profiler`` on a few sampled
steps (gloo's ``gloo:*`` ranges, NCCL's kernels); exposed communication, bytes and the prediction are
not measured there.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from ..analysis import keys
from ..analysis.comm_model import LinkModel, calibrate, measure_allreduce
from .comm_hooks import add_comm_hook_wrapper, composed_hook, wire_bytes
from .profiler import quiet_cpu_profiler

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = ["CALIBRATION_SIZES", "CommTimer"]

log = logging.getLogger(__name__)

#: All-reduce sizes of the link calibration (bytes): up to 16 MiB, so the bandwidth term stands out of the
#: latency and the noise even on loopback (a fit on small sizes alone can find no bandwidth term at all).
CALIBRATION_SIZES = (4096, 65536, 1048576, 16777216)


class CommTimer:
    """The communication side of :class:`callbacks.timing.StepTiming` for one fit.

    Args:
        mark: the step timer's clock (``time.perf_counter`` or CUDA events); bucket marks use it too.
        calibrate_comm: calibrate the link model at :meth:`start` when the run is distributed.
        profile_steps: FSDP only: steps sampled with ``torch.profiler`` for their collective time.
    """

    def __init__(self, mark: Callable[[], Any], calibrate_comm: bool = True, profile_steps: int = 2) -> None:
        self.mark = mark
        self.calibrate_comm = calibrate_comm
        self.profiled_left = 0
        self.profile_steps = profile_steps
        self.mode: Literal["ddp", "fsdp", "none"] = "none"
        self.link: LinkModel | None = None
        self.compression = "none"
        #: ``[call mark, done mark, bytes in the bucket, bytes on the wire]`` per bucket since the last take.
        self.calls: list[list[Any]] = []
        self.fsdp_collective_s: list[float] = []
        self._ddp: torch.nn.parallel.DistributedDataParallel | None = None
        self._profiler: Any = None
        self._profile_cuda = False

    def start(self, trainer: Trainer, cuda: bool) -> dict[str, float]:
        """Hook the DDP module (or prepare FSDP sampling) and calibrate; returns the metrics to log."""
        model = trainer.strategy.model
        distributed = trainer.world_size > 1 and dist.is_available() and dist.is_initialized()
        self._profile_cuda = cuda
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self.mode = "ddp" if self._register(model) else "none"
        elif distributed:
            self.mode = "fsdp"
            self.profiled_left = self.profile_steps
        if distributed and self.calibrate_comm:
            return self._calibrate(trainer.world_size)
        return {}

    def take_calls(self) -> list[list[Any]]:
        """The buckets recorded since the last take (one optimizer step's)."""
        calls = list(self.calls)
        self.calls.clear()  # the hook's closure appends to this very list
        return calls

    def summary_name(self) -> str:
        """How the gradients travel: ``all-reduce`` or the compression the DDP module uses."""
        composed = composed_hook(self._ddp) if self._ddp is not None else None
        name = composed.compression if composed is not None else None
        return f"{name} compression" if name else "all-reduce"

    # ------------------------------------------------------------------ DDP
    def _register(self, ddp: torch.nn.parallel.DistributedDataParallel) -> bool:
        composed = composed_hook(ddp)
        if composed is not None and composed.timed:
            log.warning("StepTiming: the DDP module's communication is already timed by another StepTiming.")
            return False
        mark, calls = self.mark, self.calls

        def timed(bucket: dist.GradBucket, inner: Callable[[dist.GradBucket], Any]) -> Any:
            buffer = bucket.buffer()
            sent = wire_bytes(ddp, bucket)
            record = [mark(), None, buffer.numel() * buffer.element_size(), 0]
            fut = inner(bucket)
            record[3] = sent()
            calls.append(record)

            def done(result: Any) -> Any:
                record[1] = mark()
                return result.value()

            return fut.then(done)

        try:
            add_comm_hook_wrapper(ddp, timed).timed = True
        except RuntimeError as err:
            log.warning("StepTiming: could not register the communication hook (%s); communication is not timed.", err)
            return False
        self._ddp = ddp
        return True

    def _calibrate(self, world_size: int) -> dict[str, float]:
        start = time.perf_counter()
        try:
            timings = measure_allreduce(CALIBRATION_SIZES, repeats=3, warmup=1)
            self.link = calibrate([s for s, _ in timings], [t for _, t in timings], world_size, relative=True)
        except (RuntimeError, ValueError) as err:
            log.warning("StepTiming: all-reduce calibration failed (%s); no communication prediction.", err)
            return {}
        metrics = {keys.COMM_LATENCY_KEY: self.link.latency_s * 1e6,
                   keys.COMM_CALIBRATION_KEY: time.perf_counter() - start}
        if math.isfinite(self.link.bandwidth_bytes_per_s):  # an infinite fit is "not measurable", not 0
            metrics[keys.COMM_BANDWIDTH_KEY] = self.link.bandwidth_bytes_per_s * 8 / 1e9
        else:
            log.warning("StepTiming: the all-reduce timings show no bandwidth term (latency-bound); "
                        "%s is not logged.", keys.COMM_BANDWIDTH_KEY)
        if not math.isnan(self.link.r_squared):
            metrics[keys.COMM_CALIBRATION_R2_KEY] = self.link.r_squared
        return metrics

    # ------------------------------------------------------------------ FSDP
    def start_profiled_step(self) -> bool:
        """Profile the coming step if FSDP sampling has steps left; True if it is profiled."""
        if self.profiled_left <= 0 or self._profiler is not None:
            return False
        from torch.profiler import ProfilerActivity, profile

        quiet_cpu_profiler()  # before the process's first session: Kineto's C++ lines on a GPU-less machine
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._profile_cuda else [])
        self._profiler = profile(activities=activities)
        self._profiler.__enter__()
        return True

    def stop_profiler(self) -> None:
        """End a profiled step and record its collective seconds."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        self.profiled_left -= 1
        total_us = 0.0
        for event in profiler.key_averages():
            key = event.key.lower()
            if key.startswith("gloo:"):
                total_us += event.cpu_time_total
            elif key.startswith("nccl") and "kernel" in key:
                total_us += getattr(event, "device_time_total", 0.0)
        self.fsdp_collective_s.append(total_us / 1e6)
