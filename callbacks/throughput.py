"""Tokens per second and model FLOPs utilisation (MFU) of a sequence model, through Lightning's ThroughputMonitor.

Lightning's ``ThroughputMonitor`` does the measuring; this subclass configures what YAML cannot
(the functions that count samples and tokens in a batch) and replaces its peak-FLOP/s table
with dense figures. MFU (PaLM, Chowdhery et al. 2022, app. B) is achieved model FLOP/s over the
device's peak *dense* bf16 FLOP/s. Lightning's table lists the H200 (and others) at the sparse
figure, twice the dense one, which would halve every MFU; :data:`DENSE_BF16_TFLOPS` holds the
dense numbers from NVIDIA's datasheets, and ``peak_tflops`` overrides them. On a CPU, or a GPU
not in the table, MFU is unavailable (not logged, and said so in the summary) unless
``peak_tflops`` is given.

The module's ``flops_per_batch`` attribute (FLOPs of the latest batch on one device) is read
after every batch, as ThroughputMonitor does; ``recipes.gpt.GPT`` sets it from PaLM's formula.

Logged on rank 0 every ``log_every_n_steps`` once ``window_size`` batches have been seen
(ThroughputMonitor's keys; ``validate/...`` likewise during validation):

==============================  ==================================================
key                             meaning
==============================  ==================================================
``train/device/tokens_per_sec`` tokens per second on one device
``train/tokens_per_sec``        tokens per second over all devices (world size > 1)
``train/device/flops_per_sec``  model FLOP/s on one device
``train/device/mfu``            device FLOP/s / peak dense FLOP/s (when known)
``train/lengths``               tokens seen by one device since training (re)started
==============================  ==================================================

Copy with it (paths under ``callbacks/``, each folder with an ``__init__.py``): ``utils/compat.py``,
``analysis/keys.py``.
"""

from __future__ import annotations

import logging
import re
import warnings
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from .analysis import keys
from .utils.compat import KeyedThroughputMonitor

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

log = logging.getLogger(__name__)

#: Peak dense bf16 tensor-core TFLOP/s per GPU (NVIDIA datasheets; half the "with sparsity" figure).
#: Each row: the words a ``torch.cuda.get_device_name()`` must contain, and the figure; first match wins.
DENSE_BF16_TFLOPS: tuple[tuple[frozenset[str], float], ...] = (
    (frozenset({"h200", "nvl"}), 835.0),
    (frozenset({"h200"}), 989.0),  # H200 SXM
    (frozenset({"h100", "nvl"}), 835.0),
    (frozenset({"h100", "pcie"}), 756.0),
    (frozenset({"h100"}), 989.0),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    (frozenset({"a100"}), 312.0),
    (frozenset({"l40s"}), 362.0),
    (frozenset({"l4"}), 121.0),
)


def dense_peak_tflops(device_name: str) -> float | None:
    """Peak dense bf16 TFLOP/s of a GPU named as ``torch.cuda.get_device_name`` names it; ``None`` if unknown."""
    words = set(re.split(r"[\s\-_]+", device_name.lower()))
    return next((tflops for needed, tflops in DENSE_BF16_TFLOPS if needed <= words), None)


def peak_flops(device: torch.device, peak_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device: ``peak_tflops`` if given, else the table's figure for a CUDA device, else ``None``."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    tflops = dense_peak_tflops(torch.cuda.get_device_name(device))
    return None if tflops is None else tflops * 1e12


def _inputs(batch: Any) -> torch.Tensor:
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def batch_samples(batch: Any) -> int:
    """Sequences in a batch: rows of its input (a tensor, or the first element of an ``(x, y)`` pair)."""
    return int(_inputs(batch).size(0))


def batch_tokens(batch: Any) -> int:
    """Tokens in a batch: elements of its ``(batch, length)`` input."""
    return int(_inputs(batch).numel())


class TokenThroughput(KeyedThroughputMonitor):
    """ThroughputMonitor for ``(batch, length)`` token batches, with dense peak FLOP/s for MFU.

    Args:
        peak_tflops: peak FLOP/s of one device, in TFLOP/s (default: :data:`DENSE_BF16_TFLOPS` on a
            known GPU; none on a CPU, so no MFU there).
        window_size: batches in the rolling window that rates are averaged over.

    Raises:
        ValueError: when ``peak_tflops`` is not positive or ``window_size`` < 2.

    Example::

        trainer = Trainer(callbacks=[TokenThroughput(peak_tflops=989)], log_every_n_steps=10)
        trainer.fit(GPT(), datamodule=TextDataModule())   # logs train/device/tokens_per_sec, train/device/mfu
    """

    def __init__(self, peak_tflops: float | None = None, window_size: int = 50) -> None:
        if peak_tflops is not None and peak_tflops <= 0:
            raise ValueError(f"TokenThroughput(peak_tflops={peak_tflops!r}) must be positive.")
        if window_size < 2:
            raise ValueError(f"TokenThroughput(window_size={window_size!r}) must be >= 2 (rates need two points).")
        super().__init__(batch_size_fn=batch_samples, length_fn=batch_tokens, window_size=window_size)
        self.peak_tflops = peak_tflops
        self.device_name = "cpu"
        self.last: dict[str, float] = {}

    @override
    def setup(self, trainer: Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        with warnings.catch_warnings():  # its own table's lookup: replaced below
            warnings.simplefilter("ignore")
            super().setup(trainer, pl_module, stage)
        device = trainer.strategy.root_device
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        self.set_available_flops(peak_flops(device, self.peak_tflops))
        if self.available_flops is None and trainer.is_global_zero:
            log.info("TokenThroughput: no peak FLOP/s known for %s, so no MFU; set peak_tflops to get one.",
                     self.device_name)

    @override
    def metric_key(self, key: str) -> str:
        # Lightning's ThroughputMonitor names the lengths it counts "items": for a language model they are tokens
        return key.replace("items_per_sec", "tokens_per_sec")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self.last = {key: float(value) for key, value in trainer.logged_metrics.items()
                     if key.startswith(keys.TRAIN_PREFIX) and key.endswith(("tokens_per_sec", "flops_per_sec", "mfu"))}

    def summary_rows(self, metrics: dict[str, float]) -> list[tuple[str, str]]:
        """Rows for the end summary: tokens/s and MFU of the last logged window."""
        device_rate = self.last.get(keys.DEVICE_TOKENS_PER_SEC_KEY)
        if device_rate is None:
            return [("tokens/s", f"not measured (fewer than window_size={self._window()} batches were logged)")]
        total = self.last.get(keys.TOKENS_PER_SEC_KEY, device_rate)
        rows = [("tokens/s", f"{total:,.0f} (per device {device_rate:,.0f})")]
        mfu = self.last.get(keys.MFU_KEY)
        if self.available_flops is None:
            rows.append(("MFU", f"unavailable: no peak FLOP/s known for {self.device_name} "
                                "(set the TokenThroughput callback's peak_tflops)"))
        elif mfu is not None:
            rows.append(("MFU", f"{100 * mfu:.1f}% of {self.available_flops / 1e12:,.0f} TFLOP/s per device"))
        return rows

    def _window(self) -> int:
        return int(self.kwargs.get("window_size", 100))
