"""callbacks.utils.drills: each drill a real SIGTERM, fired once over the run's life."""

from __future__ import annotations

import os
import signal

import pytest

from callbacks.utils.drills import FireDrill


def test_each_drill_fires_once(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, signum: sent.append((pid, signum)))
    drill = FireDrill(steps=[3], validation_epochs=[1])
    for step in (1, 3, 3, 4):
        drill.after_step(step)
    drill.in_validation(0)
    drill.in_validation(1)
    drill.in_validation(1)
    assert sent == [(os.getpid(), signal.SIGTERM)] * 2
    assert drill.fired == {"step:3", "validation:1"}


def test_a_resumed_drill_does_not_fire_again(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[int] = []
    monkeypatch.setattr(os, "kill", lambda pid, signum: sent.append(signum))
    drill = FireDrill(steps=[3])
    drill.fired = {"step:3"}  # restored from the checkpoint
    drill.after_step(3)
    assert sent == []


def test_the_random_drill_is_seeded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "kill", lambda pid, signum: None)
    fired = []
    for _ in range(2):
        drill = FireDrill(rate=0.2, seed=7)
        for step in range(50):
            drill.after_step(step)
        fired.append(sorted(drill.fired))
    assert fired[0] == fired[1] and fired[0]


def test_a_rate_outside_0_1_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"drill_rate=1\.5"):
        FireDrill(rate=1.5)
