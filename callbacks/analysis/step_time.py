"""The arithmetic of a step's time breakdown: serial share, Amdahl's ``s``, interval unions. No torch.

A step is split into :data:`PARTS` that add up to it (see :mod:`callbacks.timing`); the
:data:`SERIAL_PARTS` do not shrink when more data-parallel devices share a fixed global batch.
"""

from __future__ import annotations

import math

from .keys import predicted_speedup_key
from .scaling import amdahl_speedup

__all__ = ["PARTS", "PREDICT_N", "SERIAL_PARTS", "amdahl_predictions", "amdahl_serial_fraction", "overlap",
           "serial_fraction", "union_length"]

#: Parts of a step, in timeline order (they sum to the step).
PARTS = ("data", "forward", "backward", "comm_exposed", "optimizer")
#: Parts that do not shrink with more data-parallel devices (numerator of the serial fraction).
SERIAL_PARTS = ("data", "comm_exposed", "optimizer")
#: Device counts whose Amdahl speedup is logged.
PREDICT_N = (2, 4, 8, 16, 32, 64)


def serial_fraction(parts: dict[str, float], checkpoint_per_step: float = 0.0) -> float:
    """Serial share of a step: the parts that more data-parallel devices do not shrink, over the step.

    ``s = (data + comm_exposed + optimizer + checkpoint_per_step) / (sum(parts) + checkpoint_per_step)``.

    Args:
        parts: seconds per step of each of :data:`PARTS` (missing ones count 0).
        checkpoint_per_step: checkpoint stall amortized over the steps (total stall / steps).

    Returns:
        ``s`` in [0, 1]; ``0.0`` for an empty step.

    Raises:
        ValueError: if a part or ``checkpoint_per_step`` is negative.

    Example::

        >>> serial_fraction({"data": 1, "forward": 3, "backward": 4, "comm_exposed": 1, "optimizer": 1})
        0.3
    """
    values = {key: float(parts.get(key, 0.0)) for key in PARTS}
    for key, value in (*values.items(), ("checkpoint_per_step", checkpoint_per_step)):
        if value < 0 or math.isnan(value):
            raise ValueError(f"serial_fraction: `{key}={value!r}` must be >= 0.")
    total = sum(values.values()) + checkpoint_per_step
    if total <= 0:
        return 0.0
    return (sum(values[key] for key in SERIAL_PARTS) + checkpoint_per_step) / total


def amdahl_serial_fraction(share: float, world_size: int = 1) -> float:
    """Amdahl's ``s`` (a fraction of one device's time) from the serial share of a step on ``world_size`` devices.

    The parallel part of a step on ``W`` devices would take ``W`` times as long on one device, so
    ``s = share / (share + W (1 - share))``.

    Args:
        share: serial share of the measured step, in [0, 1] (:func:`serial_fraction`).
        world_size: devices ``W`` the step was measured on (>= 1).

    Returns:
        ``s`` in [0, 1]; ``share`` itself when ``W = 1``.

    Raises:
        ValueError: if ``share`` is outside [0, 1] or ``world_size < 1``.

    Example::

        >>> amdahl_serial_fraction(0.5, 2)  # 1 s serial + 1 s parallel on 2 devices = 1 + 2 s on one
        0.3333333333333333
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"amdahl_serial_fraction: `share={share!r}` must be in [0, 1].")
    if int(world_size) != world_size or world_size < 1:
        raise ValueError(f"amdahl_serial_fraction: `world_size={world_size!r}` must be an integer >= 1.")
    if share == 0.0:
        return 0.0
    return share / (share + world_size * (1.0 - share))


def amdahl_predictions(s: float, devices: tuple[int, ...] = PREDICT_N) -> dict[str, float]:
    """``{"amdahl/predicted_speedup_N": 1/(s + (1-s)/N)}`` for each N in ``devices``."""
    return {predicted_speedup_key(n): float(amdahl_speedup(n, s)) for n in devices}


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping ``(start, end)`` intervals."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def overlap(a: float, b: float, events: list[tuple[float, float]]) -> float:
    """Length of ``[a, b]`` covered by the (disjoint) ``events``."""
    return sum(max(0.0, min(b, e1) - max(a, e0)) for e0, e1 in events)
