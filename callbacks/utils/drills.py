"""Fire drills: real SIGTERMs to this process at chosen moments, to rehearse an interruption end to end.

Each drill fires once over the run's whole life: the keys of the drills fired are part of the spot
callback's checkpointed state, so a relaunch does not repeat them. The signal goes through the same
handler as a real notice and is agreed across ranks at the next step boundary like one. No Lightning import.
"""

from __future__ import annotations

import logging
import os
import random
import signal

__all__ = ["FireDrill"]

log = logging.getLogger(__name__)


class FireDrill:
    """When to send the drill's SIGTERM: after given steps, during given epochs' validation, or at random.

    Args:
        steps: global steps after which to fire.
        validation_epochs: epochs whose validation is interrupted (at its first batch).
        rate: per-step probability of a drill (seeded by ``seed``).
        seed: seed of the random drill.
    """

    def __init__(self, steps: list[int] | None = None, validation_epochs: list[int] | None = None,
                 rate: float = 0.0, seed: int = 0) -> None:
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"SpotCheckpoint(drill_rate={rate!r}) must lie in [0, 1).")
        self.steps = set(steps or [])
        self.validation_epochs = set(validation_epochs or [])
        self.rate = rate
        self._rng = random.Random(seed)
        #: Keys of the drills fired over the run's life (kept in checkpoints).
        self.fired: set[str] = set()

    def after_step(self, step: int) -> None:
        """Fire if ``step`` is a drill step, or by the random draw."""
        if step in self.steps:
            self.fire(f"step:{step}")
        elif self.rate and self._rng.random() < self.rate:
            self.fire(f"random:{step}")

    def in_validation(self, epoch: int) -> None:
        """Fire if ``epoch``'s validation is drilled."""
        if epoch in self.validation_epochs:
            self.fire(f"validation:{epoch}")

    def fire(self, key: str) -> None:
        """Send this process a real SIGTERM, once per ``key``."""
        if key in self.fired:
            return
        self.fired.add(key)
        log.warning("SpotCheckpoint fire drill (%s): sending SIGTERM to this process.", key)
        os.kill(os.getpid(), signal.SIGTERM)
