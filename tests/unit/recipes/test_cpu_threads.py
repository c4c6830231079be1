"""recipes.fit's CPU thread defaults: the environment set before torch starts (one end-to-end launch checks it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.fit import cpu_thread_env, cpu_threads_setting
from recipes.run.common import UsageError
from recipes.run.process import apply_cpu_threads
from tests.conftest import CONFIGS, FAST, REPO, cli_env, run_fit


def test_setting_from_the_command_line() -> None:
    assert cpu_threads_setting(["--config", "configs/digits.yaml"]) == "auto"
    assert cpu_threads_setting(["--cpu_threads", "1", "--config", "x"]) == "1"
    assert cpu_threads_setting(["--cpu_threads=torch"]) == "torch"
    assert cpu_threads_setting(["--cpu_threads=2", "--cpu_threads", "3"]) == "3"  # the last one wins
    assert cpu_threads_setting(["--cpu_threads"]) == "auto"  # no value: the CLI reports it


def test_environment_for_each_setting() -> None:
    assert cpu_thread_env("auto", {}) == {}  # spinning threads, which AdaptiveCpuThreads thins under load
    assert cpu_thread_env("torch", {}) == {}
    assert cpu_thread_env("2", {}) == {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "2"}
    # what the user or a launcher (torchrun: OMP_NUM_THREADS=1) set wins
    assert cpu_thread_env("2", {"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_NUM_THREADS": "2"}
    assert cpu_thread_env("2", {"OMP_NUM_THREADS": "1"}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    # auto never sets a count: Lightning's DDP launcher divides the cores only when OMP_NUM_THREADS is unset
    assert "OMP_NUM_THREADS" not in cpu_thread_env("auto", {"WORLD_SIZE": "2"})


def test_cli_checks_and_applies_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    apply_cpu_threads("auto")
    apply_cpu_threads("torch")
    apply_cpu_threads("3")
    assert calls == [3]
    for bad in ("0", "two", "-1"):
        with pytest.raises(UsageError, match="--cpu_threads"):
            apply_cpu_threads(bad)


def test_importing_the_entry_point_changes_no_environment() -> None:
    """Only ``python -m recipes.fit`` exports OpenMP's settings; an import (a test, a tool) leaves os.environ be."""
    code = ("import os, sys; sys.argv = ['x', '--cpu_threads', '3']; before = dict(os.environ); import recipes.fit; "
            "print(dict(os.environ) == before)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.e2e
def test_a_count_on_the_command_line_reaches_openmp_before_torch_starts(tmp_path: Path) -> None:
    """``--cpu_threads 3``: OMP_NUM_THREADS=3 and sleeping waits in the process's environment, torch at 3 threads."""
    record = tmp_path / "threads.json"
    callback = json.dumps({"class_path": "tests.faults.RecordThreads", "init_args": {"path": str(record)}})
    env = {k: v for k, v in cli_env(tmp_path).items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    run_fit(tmp_path, "--config", str(CONFIGS / "digits.yaml"), *FAST, "--trainer.max_steps", "1", "--log_model",
            "false", "--cpu_threads", "3", f"--trainer.callbacks+={callback}", env=env, check=True)
    assert json.loads(record.read_text()) == {"threads": 3, "OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "PASSIVE"}
