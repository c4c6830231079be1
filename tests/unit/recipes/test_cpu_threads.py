"""recipes.fit's CPU thread defaults: the environment set before torch starts (no training)."""

from __future__ import annotations

import pytest

from recipes.cli import UsageError, apply_cpu_threads
from recipes.fit import cpu_thread_env, cpu_threads_setting


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
