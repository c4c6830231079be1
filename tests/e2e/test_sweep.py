"""``python -m recipes.sweep`` for real: trial processes of the digits recipe, a real Optuna storage (sqlite, and
PostgreSQL through the suite's throwaway server), real signals, and the MLflow runs they leave.

Each trial process costs ~15 s of start-up here, so the sweeps are tiny (a few trials of 1-3 short epochs).
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import mlflow
import optuna
import pytest
from optuna.trial import TrialState

from tests.conftest import CONFIGS, cli_env, client_for, run_module, start_module
from tests.servers import PostgresServer, postgres  # noqa: F401 - fixture

pytestmark = pytest.mark.e2e

LR = "model.init_args.optimizer.init_args.lr"
WIDTH = "model.init_args.width"
#: short trials: few batches per epoch, no model summary, each trial logs its model (promote needs it)
SHORT = ("--trainer.limit_train_batches", "12", "--trainer.limit_val_batches", "3",
         "--trainer.enable_model_summary", "false")
TIMEOUT = 900


def write_space(workdir: Path, **extra: object) -> Path:
    space = {LR: {"type": "float", "low": 1.0e-4, "high": 100.0, "log": True}, **extra}
    path = workdir / "space.yaml"
    path.write_text(json.dumps(space))  # JSON is YAML
    return path


def sweep_args(workdir: Path, name: str, trials: int, *args: str) -> list[str]:
    """Arguments of ``python -m recipes.sweep``."""
    return ["--config", str(CONFIGS / "digits.yaml"), "--space", str(workdir / "space.yaml"), "--trials", str(trials),
            "--name", name, *SHORT, *args]


def run_sweep(workdir: Path, name: str, trials: int, *args: str, env: dict[str, str] | None = None,
              expect: int = 0) -> subprocess.CompletedProcess:
    result = run_module("recipes.sweep", *sweep_args(workdir, name, trials, *args), cwd=workdir, env=env,
                        timeout=TIMEOUT)
    assert result.returncode == expect, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


def study_of(workdir: Path, name: str, storage: str | None = None) -> optuna.Study:
    """The sweep's study, read as the sweep opens it (under its schema lock: not racing its table creation)."""
    from recipes.sweep.study import open_storage

    url = storage or f"sqlite:///{workdir / 'runs' / 'digits' / name / 'study.db'}"
    if url not in _STORAGES:  # opened once: a poll is then one read, not a new engine and a schema check
        _STORAGES[url] = open_storage(url)
    return optuna.load_study(study_name=name, storage=_STORAGES[url])


_STORAGES: dict[str, optuna.storages.RDBStorage] = {}


def trial_runs(workdir: Path, name: str) -> dict[int, list[mlflow.entities.Run]]:
    client = client_for(workdir)
    exp = client.get_experiment_by_name("digits")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.sweep = '{name}'")
    out: dict[int, list] = {}
    for run in runs:
        out.setdefault(int(run.data.tags["trial"]), []).append(run)
    return out


def parent_run(workdir: Path, name: str) -> mlflow.entities.Run:
    client = client_for(workdir)
    exp = client.get_experiment_by_name("digits")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`atscale.sweep` = '{name}'")
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return runs[0]


def test_four_trial_sweep_finishes_with_four_child_runs_and_a_best_trial_that_promote_registers(
        tmp_path: Path) -> None:
    write_space(tmp_path, **{WIDTH: [16, 32]})
    result = run_sweep(tmp_path, "four", 4, "--parallel", "2", "--pruner", "none", "--trainer.max_epochs", "1")
    study = study_of(tmp_path, "four")
    trials = study.get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3]  # two waves of two parallel trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    runs = trial_runs(tmp_path, "four")
    assert sorted(runs) == [0, 1, 2, 3] and all(len(r) == 1 for r in runs.values())
    parent = parent_run(tmp_path, "four")
    for number, (run,) in runs.items():
        trial = study.trials[number]
        assert run.info.status == "FINISHED"
        assert run.info.run_name == f"four-t{number:03d}"
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.data.tags["sweep.state"] == "COMPLETE"
        assert float(run.data.params[LR]) == trial.params[LR]
        assert int(run.data.params[WIDTH]) == trial.params[WIDTH]
        assert run.data.metrics["val/acc"] == trial.value  # the trial's value is the run's last val/acc
    best = study.best_trial
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["sweep.best_trial"] == str(best.number)
    assert parent.data.tags["sweep.best_run_id"] == runs[best.number][0].info.run_id
    assert parent.data.metrics["sweep/best_value"] == best.value
    assert parent.data.metrics["sweep/trials_complete"] == 4.0
    artifacts = {a.path for a in client_for(tmp_path).list_artifacts(parent.info.run_id)}
    assert {"optimization_history.png", "parallel_coordinate.png", "trials.csv", "importances.json"} <= artifacts
    assert f"#{best.number} val/acc {best.value:.4f}" in result.stdout
    assert "baseline/linear_acc" in result.stdout and "importance" in result.stdout

    promoted = run_module("recipes.promote", "--experiment", "digits", "--sweep", "four", "--baseline", "none",
                          "--json", cwd=tmp_path, timeout=300)
    assert promoted.returncode == 0, promoted.stderr
    assert json.loads(promoted.stdout)["run_id"] == runs[best.number][0].info.run_id


def test_a_hopeless_learning_rate_is_pruned_after_its_first_epoch_and_its_run_is_not_failed(tmp_path: Path) -> None:
    write_space(tmp_path)
    run_sweep(tmp_path, "prune", 2, "--pruner", "median", "--pruner-startup", "1", "--pruner-warmup", "0",
              "--trainer.max_epochs", "3", "--log_model", "false", "--cost.instance", "a3-highgpu-1g",
              "--enqueue", json.dumps({LR: 0.003}), "--enqueue", json.dumps({LR: 50.0}))
    good, hopeless = study_of(tmp_path, "prune").get_trials()
    assert good.state == TrialState.COMPLETE and sorted(good.intermediate_values) == [0, 1, 2]
    assert hopeless.params[LR] == 50.0
    assert hopeless.state == TrialState.PRUNED
    assert sorted(hopeless.intermediate_values) == [0]  # stopped after its first of 3 epochs
    assert hopeless.user_attrs["pruned_at_epoch"] == 0
    (run,) = trial_runs(tmp_path, "prune")[1]
    assert run.info.status == "FINISHED"
    assert run.data.tags["pruned"] == "true" and run.data.tags["sweep.state"] == "PRUNED"
    history = client_for(tmp_path).get_metric_history(run.info.run_id, "val/acc")
    assert len(history) == 1
    # what pruning saved: the rest of the pruned run's own projection when it stopped (2 of its 3 epochs)
    saved = run.data.metrics["cost/projected_usd"] - run.data.metrics["cost/usd"]
    assert saved > 0
    parent = parent_run(tmp_path, "prune")
    assert parent.data.metrics["sweep/saved_by_pruning_usd"] == saved
    assert parent.data.metrics["sweep/trials_pruned"] == 1.0


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the sweep exited ({proc.returncode}) before {what}:\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_sigterm_mid_trial_then_relaunch_ends_with_exactly_n_trials_the_interrupted_one_resumed(
        tmp_path: Path) -> None:
    write_space(tmp_path)
    args = ("--pruner", "none", "--trainer.max_epochs", "3", "--trainer.limit_train_batches", "60",
            "--data.init_args.batch_size", "8", "--log_model", "false",
            "--enqueue", json.dumps({LR: 0.003}), "--enqueue", json.dumps({LR: 0.002}))
    env = cli_env(tmp_path)
    proc = start_module("recipes.sweep", *sweep_args(tmp_path, "spot", 2, *args), cwd=tmp_path, env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        db = tmp_path / "runs" / "digits" / "spot" / "study.db"

        def second_trial_mid_training() -> bool:
            if not db.exists():
                return False
            try:
                trials = study_of(tmp_path, "spot").get_trials()
            except Exception:  # the study is being created
                return False
            return len(trials) == 2 and len(trials[1].intermediate_values) >= 1

        wait_for(second_trial_mid_training, 600, "trial 1's first epoch", proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 75, out[-4000:]
    first, second = study_of(tmp_path, "spot").get_trials()
    assert first.state == TrialState.COMPLETE and second.state == TrialState.WAITING
    assert second.params == {LR: 0.002}
    assert parent_run(tmp_path, "spot").info.status == "KILLED"
    (interrupted,) = trial_runs(tmp_path, "spot")[1]
    assert interrupted.info.status == "KILLED"
    completed_at = first.datetime_complete

    again = run_sweep(tmp_path, "spot", 2, *args)
    first, second = study_of(tmp_path, "spot").get_trials()
    assert [first.state, second.state] == [TrialState.COMPLETE, TrialState.COMPLETE]
    assert first.datetime_complete == completed_at  # not rerun
    assert "trial 0 " not in again.stdout
    assert "trial 1 resumes (spot-t001)" in again.stdout
    assert second.user_attrs["attempts"] == 2 and sorted(second.intermediate_values) == [0, 1, 2]
    runs = trial_runs(tmp_path, "spot")
    assert sorted(runs) == [0, 1] and all(len(r) == 1 for r in runs.values())
    (resumed,) = runs[1]
    assert resumed.info.run_id == interrupted.info.run_id  # the same MLflow run, continued
    assert resumed.info.status == "FINISHED"
    assert resumed.data.metrics["spot/interruptions"] == 1.0  # resumed from the notice checkpoint
    steps = [m.step for m in client_for(tmp_path).get_metric_history(resumed.info.run_id, "val/acc")]
    assert steps == [59, 119, 179]  # one validation per epoch (at its last step), none trained twice
    assert parent_run(tmp_path, "spot").info.status == "FINISHED"


def test_a_budget_stops_the_sweep_before_its_trials_and_the_parent_run_logs_the_spend(tmp_path: Path) -> None:
    write_space(tmp_path)
    # $0.0002 is 0.07 s at $11.06/h: the first trial always starts (nothing spent), no trial ever bills so
    # little that a second fits (a trial's bill follows the machine's speed, so a larger budget is a coin toss)
    result = run_sweep(tmp_path, "money", 3, "--budget-usd", "0.0002", "--cost.instance", "a3-highgpu-1g",
                       "--pruner", "none", "--trainer.max_epochs", "1", "--log_model", "false")
    states = [t.state for t in study_of(tmp_path, "money").get_trials()]
    assert states == [TrialState.COMPLETE, TrialState.WAITING, TrialState.WAITING]
    (run,) = trial_runs(tmp_path, "money")[0]
    spent = run.data.metrics["cost/usd"]
    # the rule: spent + the running trials' projection + one more trial (the finished trials' mean) > budget
    assert spent + spent > 0.0002
    assert (f"budget: ${spent:.4f} spent + $0.0000 projected for the running trials + ${spent:.4f} for one more "
            "> $0.0002: no new trial starts") in result.stdout
    parent = parent_run(tmp_path, "money")
    assert parent.data.metrics["sweep/spent_usd"] == spent
    assert parent.data.metrics["sweep/budget_usd"] == 0.0002
    assert parent.data.metrics["sweep/trials_waiting"] == 2.0
    assert parent.data.tags["sweep.stopped_by"] == "budget"
    assert "stopped by the budget" in result.stdout


def test_two_processes_share_one_postgresql_study_without_duplicating_trials(
        tmp_path: Path, postgres: PostgresServer) -> None:
    write_space(tmp_path)
    storage = postgres.create_database("sweep_shared")
    env = cli_env(tmp_path)
    args = ("--storage", storage, "--pruner", "none", "--trainer.max_epochs", "1", "--log_model", "false")
    procs = [start_module("recipes.sweep", *sweep_args(tmp_path, "team", 4, *args), cwd=tmp_path, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=TIMEOUT)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    started = [{int(line.split()[1]) for line in out.splitlines() if line.startswith("trial ") and " starts " in line}
               for out in outs]
    assert started[0] & started[1] == set()
    assert started[0] | started[1] == {0, 1, 2, 3}
    assert started[0] and started[1]  # both machines worked
    trials = study_of(tmp_path, "team", storage).get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3]
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    assert [t.user_attrs["attempts"] for t in trials] == [1, 1, 1, 1]
    assert len({t.params[LR] for t in trials}) == 4  # each trial drew its own parameters
    runs = trial_runs(tmp_path, "team")
    assert sorted(runs) == [0, 1, 2, 3] and all(len(r) == 1 for r in runs.values())
    assert parent_run(tmp_path, "team").info.status == "FINISHED"


def test_eight_sweeps_opening_a_new_postgresql_storage_at_once_all_get_it(postgres: PostgresServer) -> None:
    """Optuna creates its tables in a new database: done by several processes at once, all but one crashed."""
    from concurrent.futures import ThreadPoolExecutor

    from recipes.sweep.study import open_storage

    for attempt in range(3):  # a race: three fresh databases
        url = postgres.create_database(f"sweep_race_{attempt}")
        barrier = threading.Barrier(8)

        def open_it(_: int, url: str = url, barrier: threading.Barrier = barrier) -> str:
            barrier.wait()
            return type(open_storage(url)).__name__

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(open_it, range(8))) == ["RDBStorage"] * 8
