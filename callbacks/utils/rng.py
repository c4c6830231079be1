"""Every RNG a training step may draw from (Python, NumPy, torch, CUDA), captured as tensors and plain values.

Tensors, strings and numbers load under ``torch.load(weights_only=True)`` and pass through gloo's object
collectives, so a checkpoint can carry each rank's state and a resume can be bitwise exact. The long
state vectors are tensors, not lists: as ~6,300 Python ints they were pickled one by one at every save.

A checkpoint of ``N`` ranks resumed on ``M`` (:func:`restore_rank_rng`): rank ``r`` continues rank
``r mod N``'s streams; ranks ``r >= N`` then reseed every generator from a number drawn from that stream
and their rank, so that no two ranks share dropout masks or noise.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["restore_rank_rng", "rng_state", "set_rng_state"]


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


def restore_rank_rng(states: list[dict[str, Any]], rank: int) -> int:
    """Restore rank ``rank``'s RNG from a checkpoint's per-rank ``states`` of any length; return the rank used.

    The same world size gives each rank its own state back (a bitwise resume). On another world size
    rank ``r`` takes state ``r mod len(states)``; ranks beyond the saved ones are reseeded from it (see
    the module docstring), deterministically, so a relaunch on the same world repeats itself.
    """
    source = rank % len(states)
    set_rng_state(states[source])
    if rank >= len(states):
        drawn = int(torch.randint(0, 2**31 - 1, (1,)).item())
        seed = (drawn + 1_000_003 * rank) % 2**32
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)  # CUDA's generators too
    return source


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
