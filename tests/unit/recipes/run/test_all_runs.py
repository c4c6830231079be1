"""Tools read every run of an experiment, however many: MLflow answers a search one page at a time.

The store here answers at most 2 runs a page (MLflow's store caps a page as this one does, at a higher number), so
a handful of hand-made runs in a real SQLite store crosses pages: a reader that asked once (``max_results=5000``)
lost every run past the first page without a word.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow
import pytest
from mlflow.entities import Metric

from recipes import compare, promote
from recipes.run import common
from recipes.sweeps import report


def _runs(client: mlflow.MlflowClient, experiment_id: str, n: int, tags: dict[str, str] | None = None) -> list[str]:
    ids = []
    for i in range(n):
        run_id = client.create_run(experiment_id, run_name=f"r{i}", start_time=1000 * (i + 1),
                                   tags={"trial": str(i), **(tags or {})}).info.run_id
        client.log_batch(run_id, metrics=[Metric("val/acc", 0.1 * i, 1000 * (i + 1), 0)])
        client.set_terminated(run_id, "FINISHED", end_time=1000 * (i + 2))
        ids.append(run_id)
    return ids


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[mlflow.MlflowClient, str]:
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    search = client.search_runs

    def two_a_page(*args: Any, max_results: int = 1000, **kwargs: Any) -> Any:
        return search(*args, max_results=min(max_results, 2), **kwargs)

    monkeypatch.setattr(client, "search_runs", two_a_page)
    return client, client.create_experiment("digits", artifact_location=str(tmp_path / "mlruns"))


def test_every_page_is_read(store: tuple[mlflow.MlflowClient, str]) -> None:
    client, experiment_id = store
    made = _runs(client, experiment_id, 5)
    got = common.all_runs(client, [experiment_id], order_by=["attributes.start_time ASC"])
    assert [r.info.run_id for r in got] == made


def test_compare_and_promote_see_the_run_past_the_first_page(store: tuple[mlflow.MlflowClient, str]) -> None:
    client, experiment_id = store
    made = _runs(client, experiment_id, 5)
    assert len(compare.compare(client, "digits", "val/acc", show_all=True).rows) == 5
    runs = promote.runs_with_metric(client, experiment_id, "digits", "val/acc")
    assert promote.best_run(runs, "digits", "val/acc", "max").info.run_id == made[-1]  # the best is the last made


def test_a_sweeps_trials_past_the_first_page_are_counted(store: tuple[mlflow.MlflowClient, str]) -> None:
    client, experiment_id = store
    _runs(client, experiment_id, 5, tags={"sweep": "s"})
    assert sorted(report.child_runs(client, experiment_id, "s")) == [0, 1, 2, 3, 4]
