"""What a user adds to a Trainer: every callback and checkpoint plugin of atscale, by name.

The modules at this level are the callbacks and plugins; the machinery they share lives in
``analysis/`` (pure math: scaling laws, comm and cost models, checkpoint interval, noise scale, prices),
``storage/`` (atomic checkpoint files, object storage, safe loading) and ``utils/`` (DDP comm hook
composition, interruption notices, timing helpers). Each callback's docstring names the files to copy
with it into another project.

Names are imported on first use (``from callbacks import StepTiming``), so importing
``callbacks.analysis`` alone never pulls in torch or Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> module (relative to this package) that defines it.
_EXPORTS = {
    "AdaptiveCpuThreads": "cpu_threads",
    "FixedCpuThreads": "cpu_threads",
    "Baselines": "baselines",
    "AtomicCheckpointIO": "checkpoint_io",
    "BoundedAsyncCheckpointIO": "checkpoint_io",
    "GradientCompression": "compression",
    "CostTracker": "cost",
    "ElasticResume": "elastic",
    "LMBaselines": "lm_baselines",
    "LRScaling": "lr_scaling",
    "Manifest": "manifest",
    "LogModel": "mlflow_model",
    "PublishedModelCheckpoint": "model_checkpoint",
    "GradientNoiseScale": "noise_scale",
    "RunProgressBar": "progress",
    "SpotCheckpoint": "spot",
    "TokenThroughput": "throughput",
    "StepTiming": "timing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
