"""Compress DDP gradient communication: fp16/bf16 casts, PowerSGD low-rank factors or top-k sparsification.

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

``topk`` (:mod:`callbacks.utils.topk`) sends each parameter's ``topk_ratio`` largest entries of gradient +
residual (values and indices, one ``all_gather``) and keeps the rest as a per-rank residual (error
feedback). The residuals of every rank go into the checkpoint, so a resumed run continues bitwise as if
uninterrupted; a resume on a different world size starts them at zero (with a warning).

Copy with it (paths under ``callbacks/``, each folder with an ``__init__.py``): ``utils/{comm_hooks,compat,topk}.py``.

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

from .utils.comm_hooks import add_comm_hook_wrapper, composed_hook

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch import Trainer

__all__ = ["METHODS", "GradientCompression", "register_compression"]

log = logging.getLogger(__name__)

#: Compression methods: 16-bit casts of the bucket, PowerSGD's low-rank factors or top-k (both with error feedback).
METHODS = ("fp16", "bf16", "powersgd", "topk")
#: Checkpoint key of the top-k residuals: a ``[world size, parameters]`` fp32 tensor, one row per rank.
TOPK_RESIDUALS_KEY = "atscale_topk_residuals"


def register_compression(ddp: torch.nn.parallel.DistributedDataParallel, method: str, powersgd_rank: int = 1,
                         powersgd_start_iter: int = 10, topk_ratio: float = 0.01) -> Any:
    """Make ``method`` the communication of ``ddp``'s composed comm hook, with its wire-bytes meter.

    Returns:
        The hook's state for ``topk`` (a :class:`callbacks.utils.topk.TopKState`: the residuals), else None.

    Raises:
        ValueError: for an unknown method.
        RuntimeError: if another compression (or a foreign hook) already owns the module's hook.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    group = ddp.process_group
    if method == "topk":
        from .utils.topk import TopKState, make_meter, topk_hook

        topk_state = TopKState(ddp.module.parameters(), topk_ratio, group)
        add_comm_hook_wrapper(ddp, _passthrough, base=(topk_hook, topk_state),
                              meter=make_meter(topk_state)).compression = method
        return topk_state
    if method in ("fp16", "bf16"):
        hook = default_hooks.fp16_compress_hook if method == "fp16" else default_hooks.bf16_compress_hook

        def half_meter(bucket: dist.GradBucket) -> Callable[[], int]:
            sent = bucket.buffer().numel() * 2
            return lambda: sent

        add_comm_hook_wrapper(ddp, _passthrough, base=(hook, group), meter=half_meter).compression = method
        return None
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

    add_comm_hook_wrapper(ddp, finish_each_bucket, base=(powerSGD_hook.powerSGD_hook, state),
                          meter=powersgd_meter).compression = method
    return None


def _passthrough(bucket: dist.GradBucket, inner: Callable[[dist.GradBucket], Any]) -> Any:
    return inner(bucket)


class GradientCompression(Callback):
    """Compress DDP gradient communication: torch's fp16/bf16 or PowerSGD hooks, or top-k with error feedback.

    Args:
        method: ``fp16`` or ``bf16`` (2 bytes per element), ``powersgd`` (low-rank, error feedback) or
            ``topk`` (each parameter's ``topk_ratio`` largest entries, values + indices, error feedback).
        powersgd_rank: PowerSGD's ``matrix_approximation_rank`` (raise it if accuracy suffers).
        powersgd_start_iter: PowerSGD's ``start_powerSGD_iter``: plain all-reduce before it (>= 2).
        topk_ratio: ``topk``: fraction of each parameter's entries sent per step, in (0, 1] (1: dense).

    Raises:
        ValueError: for an unknown method or an out-of-range number (the message names it).
    """

    def __init__(self, method: Literal["fp16", "bf16", "powersgd", "topk"] = "fp16", powersgd_rank: int = 1,
                 powersgd_start_iter: int = 10, topk_ratio: float = 0.01) -> None:
        if method not in METHODS:
            raise ValueError(f"GradientCompression(method={method!r}) is not one of {', '.join(METHODS)}.")
        for name, value, low in (("powersgd_rank", powersgd_rank, 1), ("powersgd_start_iter", powersgd_start_iter, 2)):
            if isinstance(value, bool) or int(value) != value or value < low:
                raise ValueError(f"GradientCompression({name}={value!r}) must be an integer >= {low}.")
        if isinstance(topk_ratio, bool) or not (isinstance(topk_ratio, (int, float)) and 0 < topk_ratio <= 1):
            raise ValueError(f"GradientCompression(topk_ratio={topk_ratio!r}) must be in (0, 1].")
        self.method = method
        self.powersgd_rank = int(powersgd_rank)
        self.powersgd_start_iter = int(powersgd_start_iter)
        self.topk_ratio = float(topk_ratio)
        self.active = False
        self.topk_state: Any = None
        self._pending_residuals: Any = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            log.warning("GradientCompression(%s): the model is not DDP-wrapped; gradients are not compressed.",
                        self.method)
            return
        composed = composed_hook(model)
        if composed is not None and composed.compression:
            self.active = composed.compression == self.method
            return  # a second fit on the same module: the hook is already registered
        self.topk_state = register_compression(model, self.method, self.powersgd_rank, self.powersgd_start_iter,
                                               self.topk_ratio)
        self.active = True
        if self.topk_state is not None and self._pending_residuals is not None:
            rows, self._pending_residuals = self._pending_residuals, None
            if rows.shape[0] != trainer.world_size:
                log.warning("GradientCompression(topk): the checkpoint holds residuals of %d ranks, this run has %d; "
                            "the residuals start at zero.", rows.shape[0], trainer.world_size)
            else:
                self.topk_state.load_flat_residual(rows[trainer.global_rank])

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Top-k: every rank's residual, gathered (a collective: every rank saves together, as Lightning does)."""
        if self.topk_state is None:
            return
        flat = self.topk_state.flat_residual()
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            rows = [torch.empty_like(flat) for _ in range(trainer.world_size)]
            dist.all_gather(rows, flat, group=self.topk_state.process_group)
        else:
            rows = [flat]
        checkpoint[TOPK_RESIDUALS_KEY] = torch.stack(rows).cpu()

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._pending_residuals = checkpoint.get(TOPK_RESIDUALS_KEY)
