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
from recipes.sweep import report


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


@pytest.fixture
def experiments_two_a_page(store: tuple[mlflow.MlflowClient, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``search_experiments`` answers 2 a page here (MLflow's answers 1,000 unless asked for more)."""
    client, _ = store
    search = client.search_experiments

    def two_a_page(*args: Any, max_results: int = 1000, **kwargs: Any) -> Any:
        return search(*args, max_results=min(max_results, 2), **kwargs)

    monkeypatch.setattr(client, "search_experiments", two_a_page)


def test_the_sweep_in_the_experiment_past_the_first_page_is_found(store, experiments_two_a_page) -> None:
    """Before: ``find_sweep`` asked for the experiments once, and a sweep past the first page was 'no such sweep'."""
    client, _ = store
    for name in ("a", "b", "c"):
        client.create_experiment(name)
    last = client.get_experiment_by_name("c").experiment_id
    parent = client.create_run(last, run_name="s", tags={"atscale.kind": "sweep", "atscale.sweep": "s"}).info.run_id
    assert promote.find_sweep(client, "s").info.run_id == parent
    with pytest.raises(common.UsageError, match=r"no such sweep in the tracking store \(sweeps there: s\)"):
        promote.find_sweep(client, "other")
    with pytest.raises(common.UsageError, match="experiments there: Default, a, b, c, digits"):
        common.get_experiment(client, "nope", "sqlite://")


def test_a_sweeps_unpruned_trials_are_selected_by_the_store(store) -> None:
    client, experiment_id = store
    _runs(client, experiment_id, 5, tags={"sweep": "s"})
    pruned = client.create_run(experiment_id, run_name="p", tags={"sweep": "s", "pruned": "true"}).info.run_id
    client.log_batch(pruned, metrics=[Metric("val/acc", 0.99, 0, 0)])
    _runs(client, experiment_id, 2, tags={"sweep": "other"})
    trials = promote.sweep_trials(client, experiment_id, "s", "digits", "val/acc")
    assert sorted(r.info.run_name for r in trials) == ["r0", "r1", "r2", "r3", "r4"]


def test_a_name_with_a_quote_is_found(store) -> None:
    """Before: ``it\\'s`` in a filter matched nothing, without an error (MLflow reads no escaped quote)."""
    client, experiment_id = store
    made = client.create_run(experiment_id, run_name="it's").info.run_id
    assert common.find_run(client, [experiment_id], "it's").info.run_id == made
    assert common.quoted("a") == "'a'" and common.quoted("it's") == '"it\'s"'
    with pytest.raises(common.UsageError, match="both"):
        common.quoted("""it's "x\"""")


def test_every_page_of_logged_models_is_read(store, monkeypatch: pytest.MonkeyPatch) -> None:
    """``search_logged_models`` answers 100 a page; the run's model is looked for on every page."""
    client, experiment_id = store
    run = client.get_run(_runs(client, experiment_id, 1)[0])
    for i in range(3):
        client.create_logged_model(experiment_id, name=f"other{i}", source_run_id=run.info.run_id)
    model = client.create_logged_model(experiment_id, name="model", source_run_id=run.info.run_id)
    client.finalize_logged_model(model.model_id, "READY")
    search = client.search_logged_models
    asked: list[str | None] = []

    def one_a_page(*args: Any, max_results: int | None = None, **kwargs: Any) -> Any:
        asked.append(kwargs.get("filter_string"))
        return search(*args, max_results=1, **kwargs)

    monkeypatch.setattr(client, "search_logged_models", one_a_page)
    assert promote.logged_model_uri(client, run) == f"models:/{model.model_id}"
    assert all("name = 'model'" in f for f in asked)
