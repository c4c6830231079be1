"""Every RNG a training step may draw from (Python, NumPy, torch, CUDA), captured as tensors and plain values.

Tensors, strings and numbers load under ``torch.load(weights_only=True)`` and pass through gloo's object
collectives, so a checkpoint can carry each rank's state and a resume can be bitwise exact. The long
state vectors are tensors, not lists: as ~6,300 Python ints they were pickled one by one at every save.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """This process's RNG states (safe for ``weights_only`` loading and gloo)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        # Mersenne Twister words are < 2**32: exact in int64
        "python": [version, torch.tensor(internal, dtype=torch.int64), gauss],
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _ints(values: Any) -> list[int]:
    """A tensor's or a list's integers (checkpoints of earlier versions hold lists)."""
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (or its earlier all-lists form)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(_ints(internal)), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(_ints(keys), dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.as_tensor(s, dtype=torch.uint8) for s in state["cuda"]])
