"""Measure the gradient noise scale ``B_simple`` during training (McCandlish et al. 2018, app. A.1).

``B_simple = tr(Sigma) / |G|^2`` is the batch size at which the gradient's noise and its signal are
about equal: below it, doubling the batch nearly halves the steps needed; far above it, extra examples
buy little. Estimating it needs the squared norm of the gradient at two batch sizes in the same step
(the estimators are in :mod:`callbacks.analysis.gradient_noise`), and training already computes both:

* **several processes (DDP)**: a DDP communication hook sees each bucket's local gradient before the
  all-reduce (``B_small`` = the per-rank batch; its squared norm is averaged over ranks) and the
  averaged gradient after it (``B_big`` = the global batch);
* **one process**: with ``accumulate_grad_batches = A >= 2`` the micro-batch gradients are recovered
  in ``on_after_backward`` by differencing the accumulated ``.grad`` (``B_small`` = the micro-batch),
  and the accumulated gradient is the big batch (``B_big = A x`` micro-batch). Without accumulation
  on one process there is only one batch size and nothing is estimated (a warning says so). This
  path keeps one fp32 copy of the gradients between micro-batches.

Both squared norms are taken before gradient clipping. Steps whose micro-batches differ in size (the
short last batch of an epoch) are skipped. Under fp16 mixed precision the two norm EMAs include the
loss scale squared; ``B_simple``, a ratio, does not.

DDP allows one communication hook per module. This callback's hook wraps the all-reduce and
composes with other hooks through :func:`callbacks.utils.comm_hooks.add_comm_hook_wrapper`: callbacks that
follow that convention (StepTiming does, with its optional compression as the base hook) all observe
the same buckets. A hook registered directly by other code cannot be wrapped after the fact; the
callback then disables itself and says which hook is in the way.

============================  =======================================================================
key                           meaning
============================  =======================================================================
``noise_scale/b_simple``      ``EMA(tr Sigma) / EMA(|G|^2)``, examples
``noise_scale/grad_sq_norm``  ``EMA(|G|^2)``, the true gradient's squared norm
``noise_scale/trace_sigma``   ``EMA(tr Sigma)``, the per-example gradient variance
``noise_scale/batch_used``    the global batch per optimizer step (``B_big``)
``noise_scale/batch_small``   the smaller batch of the estimate (``B_small``)
============================  =======================================================================

Copy with it (paths under ``callbacks/``, each folder with an ``__init__.py``): ``analysis/gradient_noise.py``,
``utils/{comm_hooks,compat}.py``.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size
from typing_extensions import override

from .analysis.gradient_noise import NoiseScaleEMA, suggest_batch_note
from .utils.comm_hooks import NoiseScaleCommHook, add_comm_hook_wrapper

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = ["GradientNoiseScale", "NoiseScaleCommHook", "add_comm_hook_wrapper"]

log = logging.getLogger(__name__)


class GradientNoiseScale(Callback):
    """Estimate and log the gradient noise scale ``B_simple`` and compare it with the batch used.

    Args:
        beta: weight of the past in the EMAs of ``|G|^2`` and ``tr(Sigma)`` (0.99: about 100 steps).
        log_every_n_steps: log every this many optimizer steps (default: the trainer's
            ``log_every_n_steps``); the last value is always logged at train end.

    Raises:
        ValueError: if ``beta`` is outside [0, 1) or ``log_every_n_steps < 1``.

    Example::

        # one process: needs gradient accumulation to see two batch sizes
        trainer = Trainer(accumulate_grad_batches=4, callbacks=[GradientNoiseScale()])

        # DDP: the per-rank and the global batch
        python -m recipes.fit --config configs/digits.yaml --config configs/strategy/ddp.yaml \\
            --trainer.callbacks+=callbacks.noise_scale.GradientNoiseScale
    """

    def __init__(self, beta: float = 0.99, log_every_n_steps: int | None = None) -> None:
        self.ema = NoiseScaleEMA(beta)  # validates beta
        if log_every_n_steps is not None and (not isinstance(log_every_n_steps, int) or log_every_n_steps < 1):
            raise ValueError(f"GradientNoiseScale(log_every_n_steps={log_every_n_steps!r}) must be an integer >= 1.")
        self.log_every_n_steps = log_every_n_steps
        self.mode: str | None = None  # "ddp", "accumulation" or None (disabled)
        self.disabled_reason: str | None = None
        self.batch_small: int | None = None
        self.batch_used: int | None = None
        self._hook: NoiseScaleCommHook | None = None
        self._micro_sizes: list[int] = []
        self._micro_sq: list[torch.Tensor] = []
        self._prev: list[torch.Tensor] | None = None
        self._logged_step = -1

    # ------------------------------------------------------------------------------------------ setup
    def _disable(self, reason: str) -> None:
        self.mode, self.disabled_reason = None, reason
        log.warning("GradientNoiseScale disabled: %s", reason)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self._micro_sizes, self._micro_sq, self._prev = [], [], None
        model = trainer.strategy.model
        if trainer.world_size > 1:
            if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
                self._disable(f"{type(trainer.strategy).__name__} over {trainer.world_size} processes is not DDP; "
                              "the estimate needs DDP's comm hook (or one process with gradient accumulation).")
                return
            self._hook = NoiseScaleCommHook()
            try:
                add_comm_hook_wrapper(model, self._hook)
            except RuntimeError as err:
                self._disable(str(err))
                return
            self.mode = "ddp"
        elif trainer.accumulate_grad_batches >= 2:
            self.mode = "accumulation"
        else:
            self._disable("one process without gradient accumulation sees one batch size only; set "
                          "trainer.accumulate_grad_batches >= 2 (or run on several processes with DDP).")

    # ------------------------------------------------------------------------------------------ steps
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.mode is not None:
            self._micro_sizes.append(extract_batch_size(batch))

    @staticmethod
    def _grads(pl_module: pl.LightningModule) -> list[torch.Tensor]:
        return [p.grad.detach() for p in pl_module.parameters() if p.grad is not None]

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        if self.mode != "accumulation":
            return
        grads = self._grads(pl_module)
        scale = float(trainer.accumulate_grad_batches)  # Lightning divides each micro-batch loss by A
        if self._prev is None:
            sq = sum((g.float() * scale).pow(2).sum() for g in grads)
        else:
            sq = sum(((g.float() - p) * scale).pow(2).sum() for g, p in zip(grads, self._prev, strict=True))
        self._micro_sq.append(torch.as_tensor(sq))
        self._prev = [g.float().clone() for g in grads]

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self.mode is None:
            return
        sizes, self._micro_sizes = self._micro_sizes, []
        accumulate = trainer.accumulate_grad_batches
        if self.mode == "accumulation":
            micro_sq, self._micro_sq, self._prev = self._micro_sq, [], None
            usable = len(micro_sq) == accumulate and len(set(sizes)) == 1
            if not usable:
                return
            g_small = float(torch.stack(micro_sq).mean())
            g_big = float(sum(g.float().pow(2).sum() for g in self._grads(pl_module)))
            b_small, b_big = sizes[0], sizes[0] * accumulate
        else:
            assert self._hook is not None
            local, g_big, buckets = self._hook.pop()
            # every rank takes part in this reduce at every optimizer step, whatever it then skips
            g_small = float(trainer.strategy.reduce(torch.tensor(local, device=pl_module.device), reduce_op="mean"))
            usable = buckets > 0 and len(set(sizes)) == 1 and len(sizes) == accumulate
            if not usable:
                return
            b_small = sizes[0] * accumulate
            b_big = b_small * trainer.world_size
        if not (math.isfinite(g_small) and math.isfinite(g_big)):
            return  # an fp16 overflow step
        self.batch_small, self.batch_used = b_small, b_big
        self.ema.update(g_small, g_big, b_small, b_big)
        every = self.log_every_n_steps or trainer.log_every_n_steps or 1
        if (trainer.global_step + 1) % every == 0:
            self._log(trainer, trainer.global_step + 1)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        if self.ema.updates:
            self._log(trainer, trainer.global_step)

    def _log(self, trainer: Trainer, step: int) -> None:
        """Log the estimate as of ``step`` optimizer steps done (rank 0; once per step)."""
        if not trainer.is_global_zero or step == self._logged_step:
            return
        self._logged_step = step
        metrics = {
            "noise_scale/b_simple": self.ema.b_simple,
            "noise_scale/grad_sq_norm": float(self.ema.grad_sq_norm or 0.0),
            "noise_scale/trace_sigma": float(self.ema.trace_sigma or 0.0),
            "noise_scale/batch_used": float(self.batch_used or 0),
            "noise_scale/batch_small": float(self.batch_small or 0),
        }
        metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    # ----------------------------------------------------------------------------------------- report
    def summary_rows(self, metrics: dict[str, float]) -> list[tuple[str, str]]:
        """Rows for the end summary: ``B_simple`` and the batch size it suggests against the one used."""
        if self.disabled_reason is not None:
            return [("noise_scale", f"not measured: {self.disabled_reason}")]
        if not self.ema.updates or self.batch_used is None:
            return []
        b = self.ema.b_simple
        return [("noise_scale/b_simple", f"{b:,.1f}" if math.isfinite(b) else "n/a"),
                ("noise_scale/batch", suggest_batch_note(b, self.batch_used))]

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"ema": self.ema.state_dict(), "batch_small": self.batch_small, "batch_used": self.batch_used}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.ema.load_state_dict(state_dict.get("ema", {}))
        self.batch_small = state_dict.get("batch_small")
        self.batch_used = state_dict.get("batch_used")
