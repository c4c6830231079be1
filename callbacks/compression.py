"""Compress DDP gradient communication: fp16/bf16 casts or PowerSGD low-rank factors.

``GradientCompression`` chooses the hook that communicates each gradient bucket (torch's
``fp16_compress_hook``, ``bf16_compress_hook`` or ``powerSGD_hook``) and registers it at train start
as the base of the DDP module's composed hook (:mod:`callbacks.utils.comm_hooks`), so observers such
as :class:`callbacks.timing.StepTiming` (time, bytes on the wire) and
:class:`callbacks.noise_scale.GradientNoiseScale` (gradient norms) still see every bucket. Lightning's
``DDPStrategy(ddp_comm_hook=...)`` registers hooks only on CUDA; this works on gloo too.

On gloo each PowerSGD bucket is finished before the next one starts: torch's PowerSGD issues its
second and third all-reduce from the first one's callback, which gloo runs on its own threads, racing
the next bucket's all-reduce (ranks then disagree on the order and hang or abort). NCCL runs
callbacks inline and needs no such care.

Copy with it: ``callbacks/utils/comm_hooks.py``.

Example::

    trainer = Trainer(strategy="ddp", devices=2, callbacks=[GradientCompression("powersgd", powersgd_rank=2)])
    # or in a config (configs/strategy/ddp-powersgd.yaml):
    #   trainer.callbacks: [{class_path: callbacks.compression.GradientCompression,
    #                        init_args: {method: powersgd, powersgd_rank: 1}}]
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from .utils.comm_hooks import add_comm_hook_wrapper

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch import Trainer

__all__ = ["METHODS", "GradientCompression", "register_compression"]

log = logging.getLogger(__name__)

#: Compression methods: 16-bit casts of the bucket, or PowerSGD's low-rank factors with error feedback.
METHODS = ("fp16", "bf16", "powersgd")


def register_compression(ddp: torch.nn.parallel.DistributedDataParallel, method: str, powersgd_rank: int = 1,
                         powersgd_start_iter: int = 10) -> None:
    """Make ``method`` the communication of ``ddp``'s composed comm hook, with its wire-bytes meter.

    Raises:
        ValueError: for an unknown method.
        RuntimeError: if another compression (or a foreign hook) already owns the module's hook.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    group = ddp.process_group
    if method in ("fp16", "bf16"):
        hook = default_hooks.fp16_compress_hook if method == "fp16" else default_hooks.bf16_compress_hook

        def half_meter(bucket: dist.GradBucket) -> Callable[[], int]:
            sent = bucket.buffer().numel() * 2
            return lambda: sent

        add_comm_hook_wrapper(ddp, _passthrough, base=(hook, group), meter=half_meter)
        return
    if method != "powersgd":
        raise ValueError(f"compression method {method!r} is not one of {', '.join(METHODS)}.")
    state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=powersgd_rank,
                                        start_powerSGD_iter=powersgd_start_iter)

    def powersgd_meter(bucket: dist.GradBucket) -> Callable[[], int]:
        buffer = bucket.buffer()
        if state.iter < state.start_powerSGD_iter:  # plain all-reduce until then
            raw = buffer.numel() * buffer.element_size()
            return lambda: raw
        before = state.total_numel_after_compression  # PowerSGD adds each bucket's sent elements to it
        return lambda: (state.total_numel_after_compression - before) * buffer.element_size()

    serialize = dist.get_backend(group) == "gloo"

    def finish_each_bucket(bucket: dist.GradBucket, inner: Callable[[dist.GradBucket], Any]) -> Any:
        future = inner(bucket)
        if serialize:
            future.wait()
        return future

    add_comm_hook_wrapper(ddp, finish_each_bucket, base=(powerSGD_hook.powerSGD_hook, state), meter=powersgd_meter)


def _passthrough(bucket: dist.GradBucket, inner: Callable[[dist.GradBucket], Any]) -> Any:
    return inner(bucket)


class GradientCompression(Callback):
    """Compress DDP gradient all-reduces with torch's fp16/bf16 or PowerSGD communication hooks.

    Args:
        method: ``fp16`` or ``bf16`` (2 bytes per element), or ``powersgd`` (low-rank, error feedback).
        powersgd_rank: PowerSGD's ``matrix_approximation_rank`` (raise it if accuracy suffers).
        powersgd_start_iter: PowerSGD's ``start_powerSGD_iter``: plain all-reduce before it (>= 2).

    Raises:
        ValueError: for an unknown method or an out-of-range number (the message names it).
    """

    def __init__(self, method: Literal["fp16", "bf16", "powersgd"] = "fp16", powersgd_rank: int = 1,
                 powersgd_start_iter: int = 10) -> None:
        if method not in METHODS:
            raise ValueError(f"GradientCompression(method={method!r}) is not one of {', '.join(METHODS)}.")
        for name, value, low in (("powersgd_rank", powersgd_rank, 1), ("powersgd_start_iter", powersgd_start_iter, 2)):
            if isinstance(value, bool) or int(value) != value or value < low:
                raise ValueError(f"GradientCompression({name}={value!r}) must be an integer >= {low}.")
        self.method = method
        self.powersgd_rank = int(powersgd_rank)
        self.powersgd_start_iter = int(powersgd_start_iter)
        self.active = False

    @override
    def on_train_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            log.warning("GradientCompression(%s): the model is not DDP-wrapped; gradients are not compressed.",
                        self.method)
            return
        if getattr(model, "_atscale_compression", None):
            self.active = model._atscale_compression == self.method  # type: ignore[attr-defined]
            return  # a second fit on the same module: the hook is already registered
        register_compression(model, self.method, self.powersgd_rank, self.powersgd_start_iter)
        model._atscale_compression = self.method  # type: ignore[attr-defined]
        self.active = True
