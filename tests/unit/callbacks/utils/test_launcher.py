"""A started rank's orderly stop is reported by the process that launched it (callbacks/utils/launcher.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment

from callbacks.utils.launcher import reported_exit_code, started_by_lightning


@pytest.mark.parametrize(("local_rank", "environment", "started"), [
    (1, LightningEnvironment(), True),  # started by Lightning's launcher: the launching process reports the stop
    (0, LightningEnvironment(), False),  # the launching process itself
    (1, TorchElasticEnvironment(), False),  # torchrun started it: its agent reads every rank's code
    (1, SLURMEnvironment(), False),  # srun started it
    (0, None, False),  # one process (no cluster environment)
])
def test_started_by_lightning(local_rank: int, environment: object, started: bool) -> None:
    strategy = SimpleNamespace(cluster_environment=environment) if environment is not None else SimpleNamespace()
    assert started_by_lightning(SimpleNamespace(local_rank=local_rank, strategy=strategy)) is started


@pytest.mark.parametrize(("code", "started", "reported"), [
    (75, True, 0), (130, True, 0),  # orderly stops of a started rank: its launching process reports them
    (75, False, 75), (130, False, 130),  # the launching process, a torchrun or SLURM rank: its own code
    (1, True, 1), (-9, True, -9),  # a failure is never an orderly stop: Lightning's launcher ends the others
    (0, True, 0), (0, False, 0),
])
def test_reported_exit_code(code: int, started: bool, reported: int) -> None:
    assert reported_exit_code(code, started, (75, 130)) == reported


def test_a_hung_started_rank_exits_0_so_the_launching_process_keeps_its_75() -> None:
    """The watchdog's exit of a hung job (SpotCheckpoint: only 75 is orderly there). Lightning's launcher SIGKILLs
    the launching process as soon as a rank it started exits non-zero: a started rank whose watchdog fired first
    turned the launch's 75 into -9, and the MLflow run (rank 0's) stayed RUNNING."""
    started = SimpleNamespace(local_rank=1, strategy=SimpleNamespace(cluster_environment=LightningEnvironment()))
    assert reported_exit_code(75, started_by_lightning(started), (75,)) == 0
