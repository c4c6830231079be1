"""Gradient noise scale estimators (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", appendix A.1), as plain Python: no torch, no Lightning.

The gradient of a batch of ``B`` examples is an unbiased estimate of the true gradient ``G`` with
covariance ``Sigma / B`` (``Sigma``: the per-example gradient covariance), so its squared norm has
expectation ``|G|^2 + tr(Sigma) / B``. Two batch sizes ``B_small < B_big`` with measured squared
norms ``g_small``, ``g_big`` give unbiased estimates of both terms::

    |G|^2     ~ (B_big * g_big - B_small * g_small) / (B_big - B_small)
    tr(Sigma) ~ (g_small - g_big) / (1 / B_small - 1 / B_big)

Each estimate from one step is noisy (``|G|^2`` can come out negative); the simple noise scale is the
ratio of their exponential moving averages, ``B_simple = EMA(tr Sigma) / EMA(|G|^2)``. Training
with batches well below ``B_simple`` wastes steps; well above it wastes examples (the critical batch
size is about ``B_simple`` when the Hessian is well conditioned).

Under DDP both norms come from one communication hook
(:class:`callbacks.utils.comm_hooks.NoiseScaleCommHook`).

Example::

    >>> grad_sq_norm_estimate(g_small=3.0, g_big=1.5, b_small=8, b_big=32)
    1.0
    >>> trace_sigma_estimate(g_small=3.0, g_big=1.5, b_small=8, b_big=32)
    16.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "NoiseScaleEMA",
    "grad_sq_norm_estimate",
    "suggest_batch_note",
    "trace_sigma_estimate",
]


def _check_batches(b_small: float, b_big: float) -> None:
    if not (b_small > 0 and b_big > b_small):
        raise ValueError(f"batch sizes b_small={b_small!r}, b_big={b_big!r} must satisfy 0 < b_small < b_big.")


def grad_sq_norm_estimate(g_small: float, g_big: float, b_small: float, b_big: float) -> float:
    """Unbiased estimate of the true gradient's squared norm ``|G|^2``.

    Args:
        g_small: squared norm of a gradient averaged over ``b_small`` examples.
        g_big: squared norm of a gradient averaged over ``b_big`` examples.
        b_small: the small batch size (> 0).
        b_big: the big batch size (> ``b_small``).

    Raises:
        ValueError: if not ``0 < b_small < b_big``.
    """
    _check_batches(b_small, b_big)
    return (b_big * g_big - b_small * g_small) / (b_big - b_small)


def trace_sigma_estimate(g_small: float, g_big: float, b_small: float, b_big: float) -> float:
    """Unbiased estimate of ``tr(Sigma)``, the trace of the per-example gradient covariance.

    Args: as :func:`grad_sq_norm_estimate`.

    Raises:
        ValueError: if not ``0 < b_small < b_big``.
    """
    _check_batches(b_small, b_big)
    return (g_small - g_big) / (1.0 / b_small - 1.0 / b_big)


@dataclass
class NoiseScaleEMA:
    """Exponential moving averages of the two estimates and their ratio, ``B_simple``.

    The first update initialises both averages to its values (no zero bias to correct).

    Args:
        beta: weight of the past in each average, in [0, 1) (0.99: about the last 100 steps).

    Raises:
        ValueError: if ``beta`` is outside [0, 1).

    Example::

        ema = NoiseScaleEMA(beta=0.9)
        ema.update(g_small=3.0, g_big=1.5, b_small=8, b_big=32)
        ema.b_simple   # 16.0
    """

    beta: float = 0.99
    grad_sq_norm: float | None = None
    trace_sigma: float | None = None
    updates: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.beta, (int, float)) and 0.0 <= self.beta < 1.0):
            raise ValueError(f"NoiseScaleEMA(beta={self.beta!r}) must lie in [0, 1).")

    def update(self, g_small: float, g_big: float, b_small: float, b_big: float) -> float:
        """Fold in one step's squared norms; returns the new ``B_simple`` (nan while undefined)."""
        g2 = grad_sq_norm_estimate(g_small, g_big, b_small, b_big)
        tr = trace_sigma_estimate(g_small, g_big, b_small, b_big)
        if self.grad_sq_norm is None or self.trace_sigma is None:
            self.grad_sq_norm, self.trace_sigma = g2, tr
        else:
            self.grad_sq_norm = self.beta * self.grad_sq_norm + (1.0 - self.beta) * g2
            self.trace_sigma = self.beta * self.trace_sigma + (1.0 - self.beta) * tr
        self.updates += 1
        return self.b_simple

    @property
    def b_simple(self) -> float:
        """``EMA(tr Sigma) / EMA(|G|^2)``; nan before the first update or while ``EMA(|G|^2) <= 0``."""
        if self.grad_sq_norm is None or self.trace_sigma is None or self.grad_sq_norm <= 0:
            return math.nan
        return self.trace_sigma / self.grad_sq_norm

    def state_dict(self) -> dict[str, float | int | None]:
        return {"beta": self.beta, "grad_sq_norm": self.grad_sq_norm, "trace_sigma": self.trace_sigma,
                "updates": self.updates}

    def load_state_dict(self, state: dict[str, float | int | None]) -> None:
        self.grad_sq_norm = state.get("grad_sq_norm")  # type: ignore[assignment]
        self.trace_sigma = state.get("trace_sigma")  # type: ignore[assignment]
        self.updates = int(state.get("updates") or 0)


def suggest_batch_note(b_simple: float, batch_used: int) -> str:
    """One line comparing the measured noise scale with the batch size used.

    Args:
        b_simple: the measured ``B_simple`` (nan when it could not be estimated).
        batch_used: the global batch size of the run (examples per optimizer step).
    """
    if not math.isfinite(b_simple) or b_simple <= 0:
        return f"not estimated (batch used {batch_used}): the true gradient's norm was not resolved above the noise"
    ratio = batch_used / b_simple
    if ratio < 0.5:
        verdict = "a larger batch (more devices) would still cut steps almost linearly"
    elif ratio <= 2.0:
        verdict = "the batch is near the critical size"
    else:
        verdict = "the batch is past the critical size: more examples per step buy few fewer steps"
    return f"suggests a batch of ~{b_simple:,.0f} vs {batch_used:,} used: {verdict}"
