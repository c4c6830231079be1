"""Elastic resume: a run stopped mid-epoch comes back on another number of processes and goes on exactly.

The CLI as a user runs it (real subprocesses, real SIGTERMs and fire drills, a real MLflow store), with a
per-sample trace (``tests/sample_trace.py``): in every epoch each training sample is trained exactly once
across the launches, whatever the world size of each launch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import CONFIGS, FAST, run_fit, runs_of

pytestmark = pytest.mark.timeout(900, func_only=True)

DIGITS = ("--config", str(CONFIGS / "digits.yaml"), *FAST, "--log_model", "false")
FSDP = ("--config", str(CONFIGS / "strategy/fsdp.yaml"))


def test_fsdp_fragment_starts_on_any_device_count(tmp_path: Path) -> None:
    """The FSDP fragment follows the world size (it pinned 2, so one device could not start)."""
    result = run_fit(tmp_path, *DIGITS, *FSDP, "--trainer.devices", "1", "--trainer.max_steps", "3",
                     "--run_name", "one")
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs_of(tmp_path, "digits")
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer.strategy.init_args.data_parallel_size"] == "auto"
