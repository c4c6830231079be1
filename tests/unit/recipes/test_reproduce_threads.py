"""recipes.reproduce reruns with the original's CPU thread count, on which CPU results depend."""

from __future__ import annotations

from pathlib import Path

import mlflow

from recipes.reproduce import THREADS_METRIC, original_thread_env


def test_the_rerun_gets_the_original_count(tmp_path: Path, capsys) -> None:
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.create_run(client.create_experiment("e"))
    client.log_metric(run.info.run_id, THREADS_METRIC, 3.0, step=0)
    logged = client.get_run(run.info.run_id)
    assert original_thread_env(logged, {"OMP_NUM_THREADS": "1"}) == {"OMP_NUM_THREADS": "3"}
    assert capsys.readouterr().out == "CPU threads: 3 per process, as the original run had.\n"
    assert original_thread_env(logged, {"OMP_NUM_THREADS": "3"}) == {}  # already so: nothing said
    assert original_thread_env(client.get_run(client.create_run("0").info.run_id), {}) == {}  # none logged
