"""Scale the learning rate with the global batch size, with gradual warmup (Goyal et al. 2017).

When the device count changes, the global batch ``B = per-device batch x devices x
accumulate_grad_batches`` changes with it. The linear scaling rule multiplies the learning rate by
``k = B / base_batch_size``; because a large step from the first iteration diverges, the rate ramps
linearly from the configured (base) rate to ``k x`` base over ``warmup_steps`` optimizer steps
("gradual warmup", section 2.2 of the paper). ``sqrt`` scaling (``k = sqrt(B / base_batch_size)``)
keeps the gradient noise per step constant instead, the usual choice for Adam-type optimizers. The
``inverse_sqrt`` schedule then decays the rate as ``a_t = a_0 / sqrt(t)``, the step size of the
O(1/sqrt(T)) convergence rate of convex SGD.

The callback multiplies whatever rate the optimizer (and any configured LR scheduler) has by the
multiplier of the current step, every step in ``on_train_batch_start``, and puts the scheduled rate
back right after the optimizer step (a torch optimizer step post-hook), so schedulers keep
computing from their own values: the rate used is ``scheduled_lr x multiplier(step)``.

With ``s`` the optimizer step (0-based), ``W`` the warmup steps and ``k`` the scale::

    multiplier(s) = 1 + (k - 1) s / W             for s < W       (warmup: base lr -> k x base lr)
                  = k                              for s >= W      (schedule="constant")
                  = k sqrt((W + 1) / (s + 1))      for s >= W      (schedule="inverse_sqrt")

=================  =========================================================================
key                meaning
=================  =========================================================================
``lr/actual``      learning rate of the first param group used at this optimizer step
``lr/actual_pgN``  the same for param group N >= 1, when there are several
``lr/scale``       ``k``, logged once at train start
``lr/batch``       the global batch ``B`` that ``k`` was computed from, logged once
=================  =========================================================================

Copy with it: nothing; this file works alone.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size
from typing_extensions import override

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

log = logging.getLogger(__name__)

MODES = ("none", "linear", "sqrt")
SCHEDULES = ("constant", "inverse_sqrt")


def batch_scale(mode: str, global_batch: int, base_batch_size: int) -> float:
    """The factor ``k`` the learning rate is scaled by at full warmup.

    Args:
        mode: ``"none"`` (1), ``"linear"`` (``B / B0``) or ``"sqrt"`` (``sqrt(B / B0)``).
        global_batch: examples per optimizer step over all devices, ``B``.
        base_batch_size: the batch the configured learning rate was tuned for, ``B0``.
    """
    ratio = global_batch / base_batch_size
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[mode]


def lr_multiplier(step: int, scale: float, warmup_steps: int, schedule: str = "constant") -> float:
    """The factor applied to the scheduled learning rate at optimizer step ``step`` (0-based).

    Example::

        >>> [lr_multiplier(s, scale=2.0, warmup_steps=4) for s in range(6)]
        [1.0, 1.25, 1.5, 1.75, 2.0, 2.0]
        >>> lr_multiplier(3, scale=1.0, warmup_steps=0, schedule="inverse_sqrt")   # 1/sqrt(t), t = 4
        0.5
    """
    if step < warmup_steps:
        return 1.0 + (scale - 1.0) * step / warmup_steps
    if schedule == "inverse_sqrt":
        return scale * math.sqrt((warmup_steps + 1) / (step + 1))
    return scale


class LRScaling(Callback):
    """Scale the learning rate with the global batch, warm it up, and optionally decay it as 1/sqrt(t).

    Args:
        mode: ``"none"``, ``"linear"`` (Goyal et al.'s rule) or ``"sqrt"``.
        base_batch_size: the global batch the configured learning rate was tuned for.
        warmup_steps: optimizer steps of the linear ramp from the base rate to the scaled one (0: none).
        schedule: ``"constant"`` after warmup, or ``"inverse_sqrt"`` (``a_t = a_0 / sqrt(t)``).
        batch_size: examples per device per micro-batch; default: the datamodule's ``batch_size``,
            else the train loader's, else the size of the first training batch.

    Raises:
        ValueError: on an unknown ``mode`` or ``schedule``, ``base_batch_size < 1``,
            ``warmup_steps < 0`` or ``batch_size < 1``.

    Example::

        # tuned at batch 32 on one device; on 8 devices the rate ramps to 8x over 500 steps
        trainer = Trainer(callbacks=[LRScaling(mode="linear", base_batch_size=32, warmup_steps=500)])

    From the CLI::

        python -m recipes.fit --config configs/digits.yaml --config configs/strategy/ddp.yaml \\
            --trainer.callbacks+=callbacks.lr_scaling.LRScaling --trainer.callbacks.mode=linear \\
            --trainer.callbacks.base_batch_size=32 --trainer.callbacks.warmup_steps=100
    """

    def __init__(
        self,
        mode: Literal["none", "linear", "sqrt"] = "linear",
        base_batch_size: int = 32,
        warmup_steps: int = 0,
        schedule: Literal["constant", "inverse_sqrt"] = "constant",
        batch_size: int | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"LRScaling(mode={mode!r}) is not one of {', '.join(MODES)}.")
        if schedule not in SCHEDULES:
            raise ValueError(f"LRScaling(schedule={schedule!r}) is not one of {', '.join(SCHEDULES)}.")
        if isinstance(base_batch_size, bool) or not isinstance(base_batch_size, int) or base_batch_size < 1:
            raise ValueError(f"LRScaling(base_batch_size={base_batch_size!r}) must be an integer >= 1.")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"LRScaling(warmup_steps={warmup_steps!r}) must be an integer >= 0.")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"LRScaling(batch_size={batch_size!r}) must be an integer >= 1 or None.")
        self.mode = mode
        self.base_batch_size = base_batch_size
        self.warmup_steps = warmup_steps
        self.schedule = schedule
        self.batch_size = batch_size
        self.global_batch: int | None = None
        self.scale: float | None = None
        self._scheduled: list[list[float]] | None = None  # per optimizer, per param group
        self._handles: list[Any] = []
        self._logged_step = -1
        self._applied_step = -1

    # ------------------------------------------------------------------------------------------ setup
    def _per_device_batch(self, trainer: Trainer) -> int | None:
        if self.batch_size is not None:
            return self.batch_size
        for source in (trainer.datamodule, trainer.train_dataloader):
            value = getattr(source, "batch_size", None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    def _set_scale(self, trainer: Trainer, per_device: int) -> None:
        self.global_batch = per_device * trainer.world_size * trainer.accumulate_grad_batches
        self.scale = batch_scale(self.mode, self.global_batch, self.base_batch_size)
        log.info("LRScaling: global batch %d (%d x %d devices x %d accumulated), base %d -> lr x %.4g (%s)",
                 self.global_batch, per_device, trainer.world_size, trainer.accumulate_grad_batches,
                 self.base_batch_size, self.scale, self.mode)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({"lr/scale": self.scale, "lr/batch": float(self.global_batch)},
                                   step=trainer.global_step)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        per_device = self._per_device_batch(trainer)
        if per_device is not None:
            self._set_scale(trainer, per_device)
        for index, optimizer in enumerate(trainer.optimizers):
            self._handles.append(optimizer.register_step_post_hook(self._restore_hook(index)))

    def _restore_hook(self, index: int) -> Any:
        def restore(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if self._scheduled is not None:
                for group, lr in zip(optimizer.param_groups, self._scheduled[index], strict=True):
                    group["lr"] = lr
                if index == len(self._scheduled) - 1:
                    self._scheduled = None

        return restore

    # ------------------------------------------------------------------------------------------ steps
    def multiplier(self, step: int) -> float:
        """The multiplier of optimizer step ``step`` (1 before the scale is known)."""
        return lr_multiplier(step, self.scale if self.scale is not None else 1.0, self.warmup_steps, self.schedule)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.scale is None:
            self._set_scale(trainer, extract_batch_size(batch))
        step = trainer.global_step
        if self._scheduled is not None and self._applied_step != step:
            self._restore_all(trainer)  # the last step was skipped (e.g. an fp16 overflow): no post-hook ran
        if self._scheduled is None:  # not applied yet in this accumulation window
            factor = self.multiplier(step)
            self._applied_step = step
            self._scheduled = [[group["lr"] for group in opt.param_groups] for opt in trainer.optimizers]
            for opt in trainer.optimizers:
                for group in opt.param_groups:
                    group["lr"] = group["lr"] * factor
        if trainer.is_global_zero and step != self._logged_step and trainer.optimizers:
            self._logged_step = step
            groups = trainer.optimizers[0].param_groups
            metrics = {"lr/actual": float(groups[0]["lr"])}
            metrics.update({f"lr/actual_pg{i}": float(g["lr"]) for i, g in enumerate(groups) if i})
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def _restore_all(self, trainer: Trainer) -> None:
        if self._scheduled is not None:
            for opt, lrs in zip(trainer.optimizers, self._scheduled, strict=False):
                for group, lr in zip(opt.param_groups, lrs, strict=True):
                    group["lr"] = lr
            self._scheduled = None

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        # A checkpoint taken mid accumulation window must hold the scheduled rates, not the scaled ones.
        if self._scheduled is None:
            return
        for state, lrs in zip(checkpoint.get("optimizer_states", []), self._scheduled, strict=False):
            for group, lr in zip(state.get("param_groups", []), lrs, strict=False):
                group["lr"] = lr

    @override
    def teardown(self, trainer: Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore_all(trainer)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
