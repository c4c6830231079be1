"""A team's tracking server for real: ``mlflow server`` on a throwaway PostgreSQL, artifacts proxied into a
moto bucket (tests/servers.py: ``postgres``, ``team_server``), run roots in the bucket, machines as folders.

On it: a sweep (``recipes.scale``), 8 concurrent runs of a new experiment, a spot-interrupted run resumed from
the bucket on a wiped machine (final weights bitwise equal to an uninterrupted run), then compare, promote and
reproduce from yet another machine; one MLflow run per run name throughout.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import mlflow
import pytest

from callbacks.manifest import log_training_input, training_input
from callbacks.spot import REQUEUE_EXIT_CODE
from tests.conftest import (
    CONFIGS,
    FAST,
    assert_bitwise_equal,
    cli_env,
    final_weights,
    remote_final_weights,
    run_fit,
    run_module,
    start_fit,
)
from tests.servers import (  # noqa: F401 - fixtures
    PostgresServer,
    TeamServer,
    moto_s3,
    postgres,
    s3fs_fresh,
    team_server,
)

pytestmark = pytest.mark.e2e

DIGITS = ("--config", str(CONFIGS / "digits.yaml"), "--trainer.log_every_n_steps", "1", *FAST)
TOOL_TIMEOUT = 600


def team_env(workdir: Path, team: TeamServer) -> dict[str, str]:
    """A machine of the team: the shared server, the bucket's credentials (for the run root only)."""
    return cli_env(workdir, MLFLOW_TRACKING_URI=team.tracking_uri, **team.s3.env)


def tool(workdir: Path, team: TeamServer, module: str, *args: str) -> subprocess.CompletedProcess:
    return run_module(module, *args, cwd=workdir, env=team_env(workdir, team), timeout=TOOL_TIMEOUT)


def one_run_per_name(client: mlflow.MlflowClient, experiment: str) -> dict[str, mlflow.entities.Run]:
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, experiment
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    names = [r.info.run_name for r in runs]
    assert len(names) == len(set(names)), sorted(names)
    return {r.info.run_name: r for r in runs}


def test_postgres_is_real_runs_unprivileged_and_checks_passwords(postgres: PostgresServer) -> None:
    with postgres.connect() as conn, conn.cursor() as cur:
        cur.execute("SELECT version()")
        assert cur.fetchone()[0].startswith("PostgreSQL ")
    pid = int((postgres.datadir / "postmaster.pid").read_text().split()[0])
    assert os.stat(f"/proc/{pid}").st_uid != 0  # PostgreSQL refuses root; the fixture drops to another user
    import psycopg

    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(host=postgres.host, port=postgres.port, user=postgres.user, password="wrong",
                        dbname="postgres", connect_timeout=5)


def test_the_server_keeps_runs_in_postgres_and_artifacts_in_the_bucket(team_server: TeamServer,
                                                                        tmp_path: Path) -> None:
    client = mlflow.MlflowClient(team_server.tracking_uri)
    exp_id = client.create_experiment("team-smoke")
    run = client.create_run(exp_id, run_name="smoke")
    client.log_metric(run.info.run_id, "m", 1.5)
    (tmp_path / "a.txt").write_text("x")
    client.log_artifact(run.info.run_id, str(tmp_path / "a.txt"))
    client.set_terminated(run.info.run_id)
    with team_server.postgres.connect("mlflow") as conn, conn.cursor() as cur:  # the rows are in PostgreSQL
        cur.execute("SELECT name, status FROM runs WHERE run_uuid = %s", (run.info.run_id,))
        assert cur.fetchone() == ("smoke", "FINISHED")
        cur.execute("SELECT value FROM metrics WHERE run_uuid = %s AND key = 'm'", (run.info.run_id,))
        assert cur.fetchone() == (1.5,)
    assert f"mlartifacts/{exp_id}/{run.info.run_id}/artifacts/a.txt" in team_server.s3.keys(team_server.bucket)


@pytest.mark.timeout(1200)
@pytest.mark.slow(covered_by="tests/e2e/test_sweep.py::test_two_processes_share_one_postgresql_study_without_duplicating_trials")
def test_sweep_on_the_team_server(team_server: TeamServer, tmp_path: Path) -> None:
    result = tool(tmp_path, team_server, "recipes.scale", "--config", str(CONFIGS / "digits.yaml"),
                  "--devices", "1,2", "--steps", "6", "--warmup", "2", "--experiment", "team-sweep",
                  "--runs-root", f"s3://{team_server.bucket}/sweep", "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    # --json promises only JSON on stdout; against a server MLflow writes "View run ... at: http://..." there
    # when a run ends, unless MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT is set
    assert result.stdout.lstrip().startswith("{") and "View run" not in result.stdout, result.stdout[:600]
    data = json.loads(result.stdout)
    client = mlflow.MlflowClient(team_server.tracking_uri)
    parent = client.get_run(data["parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert sorted(a.path for a in client.list_artifacts(parent.info.run_id)) == \
        ["scaling.csv", "scaling.json", "scaling.png"]
    children = [client.get_run(p["run_id"]) for p in data["points"]]
    assert [c.data.tags["mlflow.parentRunId"] for c in children] == [parent.info.run_id] * 2
    assert {c.info.status for c in children} == {"FINISHED"}
    runs = one_run_per_name(client, "team-sweep")
    assert len(runs) == 3  # the parent and its two points
    keys = team_server.s3.keys(team_server.bucket, "mlartifacts/")
    exp_id = parent.info.experiment_id
    assert f"mlartifacts/{exp_id}/{parent.info.run_id}/artifacts/scaling.png" in keys


def test_launches_starting_together_all_record_the_shared_dataset_input(team_server: TeamServer) -> None:
    """8 launches log the same new dataset at once: the store's unique row goes to one, and the others still link it.

    PostgreSQL answers the losers with a unique violation (a 400 from the server, which MLflow's client does not
    retry); before ``log_training_input`` asked again, one of the 8 concurrent fits failed in CI on it.
    """
    from datamodules.digits import DigitsDataModule

    client = mlflow.MlflowClient(team_server.tracking_uri)
    datamodule = DigitsDataModule()
    dataset_input = training_input(datamodule, datamodule.fingerprint())
    for round_ in range(3):
        experiment = client.create_experiment(f"dataset-race-{round_}-{os.getpid()}")
        run_ids = [client.create_run(experiment).info.run_id for _ in range(8)]
        barrier = threading.Barrier(len(run_ids))
        recorded: dict[str, bool] = {}

        def launch(run_id: str, barrier: threading.Barrier = barrier, recorded: dict[str, bool] = recorded) -> None:
            own_client = mlflow.MlflowClient(team_server.tracking_uri)
            barrier.wait()
            recorded[run_id] = log_training_input(own_client, run_id, dataset_input)

        threads = [threading.Thread(target=launch, args=(run_id,)) for run_id in run_ids]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert recorded == dict.fromkeys(run_ids, True)
        for run_id in run_ids:
            inputs = client.get_run(run_id).inputs.dataset_inputs
            assert [(i.dataset.name, i.dataset.digest) for i in inputs] == \
                [("DigitsDataModule", datamodule.fingerprint()[:36])]


@pytest.mark.timeout(1200)
def test_eight_concurrent_runs_of_a_new_experiment(team_server: TeamServer, tmp_path: Path) -> None:
    """8 launches at once, none of which finds the experiment: all create or join it, each is one run."""
    names = [f"c{i}" for i in range(8)]
    procs = {}
    for name in names:
        workdir = tmp_path / name
        workdir.mkdir()
        procs[name] = start_fit(
            workdir, *DIGITS, "--experiment", "team-concurrent", "--run_name", name,
            "--runs_root", f"s3://{team_server.bucket}/concurrent", "--trainer.max_epochs", "1",
            "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2", "--log_model", "false",
            env=team_env(workdir, team_server), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    errors = {name: proc.communicate(timeout=1100)[1] for name, proc in procs.items()}
    failed = {name: errors[name][-2500:] for name, proc in procs.items() if proc.returncode != 0}
    assert not failed, failed
    client = mlflow.MlflowClient(team_server.tracking_uri)
    runs = one_run_per_name(client, "team-concurrent")
    assert sorted(runs) == names
    assert {r.info.status for r in runs.values()} == {"FINISHED"}
    steps = {name: [m.step for m in client.get_metric_history(r.info.run_id, "train/loss")]
             for name, r in runs.items()}
    assert all(sorted(s) == [0, 1, 2, 3] for s in steps.values()), steps
    # one validation each; the eight runs share seed, data and config, so they reach the same accuracy
    val_acc = {name: [m.value for m in client.get_metric_history(r.info.run_id, "val/acc")]
               for name, r in runs.items()}
    assert all(len(v) == 1 for v in val_acc.values()), val_acc
    assert len({v[0] for v in val_acc.values()}) == 1 and 0 < next(iter(val_acc.values()))[0] < 1, val_acc
    for name in names:
        assert f"concurrent/team-concurrent/{name}/config.yaml" in team_server.s3.keys(
            team_server.bucket, f"concurrent/team-concurrent/{name}/")


@pytest.mark.timeout(1800)
def test_spot_run_resumes_on_a_wiped_machine_then_compare_promote_reproduce(
        team_server: TeamServer, s3fs_fresh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = tmp_path / "reference"  # an uninterrupted run, local everything (experiment "digits")
    reference.mkdir()
    run_fit(reference, *DIGITS, "--trainer.max_epochs", "2", "--run_name", "ref", "--log_model", "false",
            check=True)
    base = (*DIGITS, "--experiment", "team-spot", "--trainer.max_epochs", "2")

    bucket = team_server.bucket
    runs_root = f"s3://{bucket}/team"
    args = (*base, "--runs_root", runs_root, "--run_name", "spot")
    machine_a = tmp_path / "machine-a"
    machine_a.mkdir()
    proc = start_fit(machine_a, *args, env=team_env(machine_a, team_server), stdout=subprocess.DEVNULL,
                     stderr=subprocess.PIPE, text=True)
    staged = machine_a / "runs" / "team-spot" / "spot" / "checkpoints"
    deadline = time.monotonic() + 600
    while not list(staged.glob("step=*.meta.json")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(random.Random(18).uniform(0.0, 0.5))  # somewhere in epoch 1
    os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == REQUEUE_EXIT_CODE, stderr[-3000:]
    checkpoints = f"{runs_root}/team-spot/spot/checkpoints"
    assert f"uploaded to {checkpoints} (upload " in stderr

    shutil.rmtree(machine_a)  # the machine is gone, and its disk with it
    machine_b = tmp_path / "machine-b"
    machine_b.mkdir()
    result = run_fit(machine_b, *args, env=team_env(machine_b, team_server), timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"Resuming from {checkpoints}/step=" in result.stderr
    for key, value in team_server.s3.env.items():
        monkeypatch.setenv(key, value)
    assert_bitwise_equal(final_weights(reference, "ref"), remote_final_weights(checkpoints, tmp_path / "dl"))

    client = mlflow.MlflowClient(team_server.tracking_uri)
    (run,) = one_run_per_name(client, "team-spot").values()
    assert run.info.status == "FINISHED" and run.info.run_name == "spot"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "spot/interruptions")] == [1.0]
    experiment_id = run.info.experiment_id
    (model,) = list(client.search_logged_models([experiment_id]))
    assert model.source_run_id == run.info.run_id
    assert f"mlartifacts/{experiment_id}/models/{model.model_id}/artifacts/MLmodel" in team_server.s3.keys(
        bucket, f"mlartifacts/{experiment_id}/")

    # the team's tools, from yet another machine
    machine_c = tmp_path / "machine-c"
    machine_c.mkdir()
    compared = tool(machine_c, team_server, "recipes.compare", "--experiment", "team-spot", "--json")
    assert compared.returncode == 0, compared.stderr[-3000:]
    assert [row["run_id"] for row in json.loads(compared.stdout)["runs"]] == [run.info.run_id]
    promoted = tool(machine_c, team_server, "recipes.promote", "--experiment", "team-spot", "--baseline", "none",
                    "--json")
    assert promoted.returncode == 0, promoted.stderr[-3000:]
    assert json.loads(promoted.stdout)["run_id"] == run.info.run_id
    version = client.get_model_version_by_alias("team-spot", "champion")
    assert version.run_id == run.info.run_id
    # a real rerun from the run's own record on the server (config and manifest artifacts from the bucket):
    # exit 0 means every compared final metric is identical
    reproduced = tool(machine_c, team_server, "recipes.reproduce", run.info.run_id, "--run_name", "spot-repro")
    assert reproduced.returncode == 0, reproduced.stdout[-3000:] + reproduced.stderr[-3000:]
    runs = one_run_per_name(client, "team-spot")
    assert sorted(runs) == ["spot", "spot-repro"]
    assert runs["spot-repro"].data.tags.get("reproduces") == run.info.run_id
    assert runs["spot-repro"].info.status == "FINISHED"
