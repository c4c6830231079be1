"""Shared test helpers: run the CLI as a user does (a real subprocess) against a sqlite MLflow store."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlflow
import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import Logger

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


_TEMPLATE_DB: Path | None = None


@pytest.fixture(scope="session", autouse=True)
def mlflow_template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty, migrated MLflow sqlite store, made once: migrating a new one takes seconds."""
    global _TEMPLATE_DB
    template = tmp_path_factory.getbasetemp() / "mlflow-template.db"
    mlflow.MlflowClient(f"sqlite:///{template}").search_experiments()
    _TEMPLATE_DB = template
    return template


def seed_mlflow_db(workdir: Path) -> None:
    """Give ``workdir`` a copy of the session's migrated, empty MLflow store, unless it has one."""
    if _TEMPLATE_DB is not None and not (workdir / "mlflow.db").exists():
        shutil.copy(_TEMPLATE_DB, workdir / "mlflow.db")


def cli_env(workdir: Path, **extra: str) -> dict[str, str]:
    """Environment of a CLI subprocess: the repo importable, MLflow in ``workdir/mlflow.db`` (seeded)."""
    seed_mlflow_db(workdir)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATSCALE_", "SLURM_", "MLFLOW_"))}
    env.update({
        "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlflow.db'}",
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    })
    env.update(extra)
    return env


def fit_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "recipes.fit", *args]


def run_fit(workdir: Path, *args: str, timeout: float = 600, env: dict[str, str] | None = None,
            check: bool = False) -> subprocess.CompletedProcess:
    """``python -m recipes.fit ARGS`` in ``workdir``; output captured as text."""
    result = subprocess.run(fit_command(*args), cwd=workdir, env=env or cli_env(workdir),
                            capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def client_for(workdir: Path) -> mlflow.MlflowClient:
    return mlflow.MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")


def runs_of(workdir: Path, experiment: str) -> list:
    client = client_for(workdir)
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id])


class TinyModule(LightningModule):
    """One ``Linear(2, 1)`` that never learns (lr 0): for tests of callbacks, where the model is beside the point.

    Batches are ``(x,)`` with ``x`` of shape ``(n, 2)``; validation logs ``val/x``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).sum()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/x", self.layer(batch[0]).sum())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class RecordingLogger(Logger):
    """A Lightning logger that keeps every ``log_metrics`` call in memory, for exact assertions."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))

    def values(self, key: str) -> list[tuple[int | None, float]]:
        return [(step, m[key]) for step, m in self.calls if key in m]


# Small, fast variants of the digits recipe for tests (the README's run uses the full config).
FAST = ("--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false")


@pytest.fixture
def tracked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's cwd and environment are a CLI subprocess's: MLflow in ``tmp_path/mlflow.db``."""
    for key, value in cli_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    for key in [k for k in os.environ if k.startswith(("ATSCALE_", "SLURM_"))]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    return tmp_path


_E2E_DIR = Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/e2e/ is end-to-end (``pytest -m "not e2e"`` runs the unit tests alone)."""
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(_E2E_DIR):
            item.add_marker(pytest.mark.e2e)
