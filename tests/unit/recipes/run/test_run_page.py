"""The run's MLflow page: shown once in the end table, MLflow's own per-end print turned off."""

from __future__ import annotations

import os

import pytest

from recipes.run.process import MLFLOW_QUIET_URL_ENV, quiet_known_noise
from recipes.run.tracking import run_page_url


@pytest.mark.parametrize(("uri", "page"), [
    ("http://127.0.0.1:5000", "http://127.0.0.1:5000/#/experiments/3/runs/abc"),
    ("https://user:pw@mlflow.example.org/root/", "https://mlflow.example.org/root/#/experiments/3/runs/abc"),
    ("http://TOKEN@[::1]:8080", "http://[::1]:8080/#/experiments/3/runs/abc"),
    ("sqlite:///mlflow.db", None),
    ("postgresql://u:p@db/mlflow", None),
])
def test_run_page_url(uri: str, page: str | None) -> None:
    assert run_page_url(uri, "3", "abc") == page


def test_mlflow_prints_no_url_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MLFLOW_QUIET_URL_ENV, raising=False)
    quiet_known_noise()
    assert os.environ[MLFLOW_QUIET_URL_ENV] == "true"
