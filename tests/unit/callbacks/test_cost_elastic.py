"""CostTracker on an elastic run: each segment is billed on the instances it ran on."""

from __future__ import annotations

from pathlib import Path

import pytest

from callbacks import cost
from callbacks.cost import CostTracker
from tests.conftest import RecordingLogger
from tests.unit.callbacks.test_cost import FakeTime, SaveThenDie, TimedModel, _trainer

H100_ON_DEMAND = 11.06  # a3-highgpu-1g, USD per instance-hour (callbacks/analysis/prices.yaml)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(cost, "time", fake)
    return fake


def test_a_run_resumed_on_fewer_instances_bills_each_segment_on_its_own(tmp_path: Path, clock: FakeTime) -> None:
    ckpt = tmp_path / "checkpoints" / "step=4.ckpt"
    first = CostTracker(instance="a3-highgpu-1g", instances=2, log_every_n_steps=100)
    _trainer(tmp_path, [first, SaveThenDie(ckpt, save_at=4, die_at=4)], RecordingLogger()).fit(TimedModel(clock))
    logger = RecordingLogger()
    second = CostTracker(instance="a3-highgpu-1g", instances=1, restart_s=30.0, log_every_n_steps=100)
    _trainer(tmp_path, [second], logger).fit(TimedModel(clock), ckpt_path=ckpt)
    final = logger.calls[-1][1]
    # 4 steps x 2 s on 2 instances = 16 instance-s; then 30 s restart + 6 steps x 2 s on 1 instance = 42
    assert second.instance_s() == 16 + 42
    assert final["cost/billed_s"] == 8 + 30 + 12
    assert final["cost/instances"] == 1.0
    assert final["cost/usd"] == pytest.approx(58 / 3600 * H100_ON_DEMAND, rel=1e-12)
