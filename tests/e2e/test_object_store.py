"""Survive the machine: run root in S3, a shared ``mlflow server``, SIGTERM, a brand-new machine, exact resume.

Everything is real and on loopback: moto's S3 server, an ``mlflow server`` (sqlite backend, artifacts
proxied into the moto bucket), the CLI as subprocesses stopped by a real SIGTERM. "A new machine" is a
fresh working directory after the first one is deleted entirely: only the bucket and the tracking
server remember the run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import mlflow
import pytest
import s3fs

from callbacks.spot import REQUEUE_EXIT_CODE
from callbacks.storage.remote_store import RemoteCheckpoints
from recipes import compare, promote, reproduce, scale
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
from tests.servers import S3Server, free_port, mlflow_server, moto_s3, moto_s3_strict, s3fs_fresh  # noqa: F401 - fixtures

EPOCHS = 2
BASE = ("--config", str(CONFIGS / "digits.yaml"), "--trainer.max_epochs", str(EPOCHS),
        "--trainer.log_every_n_steps", "1", *FAST)


def machine_env(workdir: Path, s3: S3Server, tracking_uri: str | None = None) -> dict[str, str]:
    """A CLI subprocess's environment on a machine with S3 credentials (and a shared tracking server)."""
    env = cli_env(workdir, **s3.env)
    if tracking_uri is not None:
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    return env


@pytest.mark.slow(covered_by="tests/e2e/test_team_server.py::"
                            "test_spot_run_resumes_on_a_wiped_machine_then_compare_promote_reproduce")
def test_relaunch_on_a_new_machine_resumes_from_the_bucket_exactly(
        moto_s3: S3Server, mlflow_server, s3fs_fresh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = moto_s3.make_bucket("atscale-e2e")
    tracking = mlflow_server(bucket, tmp_path / "server")
    reference = tmp_path / "reference"  # an uninterrupted run, local everything
    reference.mkdir()
    run_fit(reference, *BASE, "--run_name", "ref", "--log_model", "false", check=True)

    args = (*BASE, "--runs_root", f"s3://{bucket}/runs", "--run_name", "spot")
    machine_a = tmp_path / "machine-a"
    machine_a.mkdir()
    proc = start_fit(machine_a, *args, env=machine_env(machine_a, moto_s3, tracking), stdout=subprocess.DEVNULL,
                     stderr=subprocess.PIPE, text=True)
    staged = machine_a / "runs" / "digits" / "spot" / "checkpoints"
    deadline = time.monotonic() + 300
    while not list(staged.glob("step=*.meta.json")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(random.Random(8).uniform(0.0, 0.5))  # somewhere in epoch 1
    os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == REQUEUE_EXIT_CODE, stderr[-3000:]
    assert f"uploaded to s3://{bucket}/runs/digits/spot/checkpoints (upload " in stderr
    checkpoint_url = f"s3://{bucket}/runs/digits/spot/checkpoints"
    for key, value in moto_s3.env.items():
        monkeypatch.setenv(key, value)
    interrupted_at = RemoteCheckpoints(checkpoint_url, tmp_path / "peek").read_pointer()["global_step"]
    assert 0 < interrupted_at < 90  # 45 steps an epoch, 2 epochs: stopped before the end

    shutil.rmtree(machine_a)  # the machine is gone, and its disk with it
    machine_b = tmp_path / "machine-b"
    machine_b.mkdir()
    result = run_fit(machine_b, *args, env=machine_env(machine_b, moto_s3, tracking))
    assert result.returncode == 0, result.stderr[-4000:]
    assert (f"Resuming from {checkpoint_url}/step={interrupted_at:08d}.ckpt (step {interrupted_at}; downloaded "
            in result.stderr)

    assert_bitwise_equal(final_weights(reference, "ref"), remote_final_weights(checkpoint_url, tmp_path / "dl"))

    client = mlflow.MlflowClient(tracking_uri=tracking)
    experiment = client.get_experiment_by_name("digits")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "spot"
    interruptions = client.get_metric_history(run.info.run_id, "spot/interruptions")
    assert [m.value for m in interruptions] == [1.0]
    assert len(client.get_metric_history(run.info.run_id, "spot/upload_s")) == 1
    assert {"config.yaml", "manifest.json"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    (model,) = list(client.search_logged_models([experiment.experiment_id]))
    assert model.source_run_id == run.info.run_id
    keys = moto_s3.keys(bucket, "mlartifacts/")  # the server proxies every artifact into the bucket
    assert f"mlartifacts/{experiment.experiment_id}/{run.info.run_id}/artifacts/config.yaml" in keys
    assert f"mlartifacts/{experiment.experiment_id}/models/{model.model_id}/artifacts/MLmodel" in keys
    run_files = moto_s3.keys(bucket, "runs/digits/spot/")
    assert {"runs/digits/spot/config.yaml", "runs/digits/spot/manifest.json"} <= set(run_files)
    # ModelCheckpoint kept its best-k list across machines: one best checkpoint (top 1), none left behind
    best = [k for k in run_files if k.startswith("runs/digits/spot/checkpoints/best-") and k.endswith(".ckpt")]
    assert len(best) == 1, best
    assert "The dirpath has changed" not in result.stderr

    # the team's tools work against the same server from yet another machine
    machine_c = tmp_path / "machine-c"
    machine_c.mkdir()
    env = machine_env(machine_c, moto_s3, tracking)
    compared = run_module("recipes.compare", "--experiment", "digits", "--json", cwd=machine_c, env=env, timeout=300)
    assert compared.returncode == 0, compared.stderr[-3000:]
    assert [row["run_id"] for row in json.loads(compared.stdout)["runs"]] == [run.info.run_id]
    promoted = run_module("recipes.promote", "--experiment", "digits", "--baseline", "none", "--json", cwd=machine_c,
                          env=env, timeout=300)
    assert promoted.returncode == 0, promoted.stderr[-3000:]
    assert json.loads(promoted.stdout)["run_id"] == run.info.run_id
    assert client.get_model_version_by_alias("digits", "champion").run_id == run.info.run_id
    reproduced = run_module("recipes.reproduce", run.info.run_id, "--dry_run", cwd=machine_c, env=env, timeout=300)
    assert reproduced.returncode == 0, reproduced.stderr[-3000:]
    assert f"Rerunning run {run.info.run_id} (spot)" in reproduced.stdout


def test_bad_remote_inputs_fail_before_training_with_exit_2(
        moto_s3: S3Server, moto_s3_strict: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    bucket = moto_s3.make_bucket("atscale-bad-inputs")
    cases = [
        (machine_env(tmp_path, moto_s3), "s3://atscale-no-such-bucket/runs",
         "error: --runs_root s3://atscale-no-such-bucket/runs: the bucket or container does not exist "
         "(The specified bucket does not exist)"),
        (machine_env(tmp_path, moto_s3_strict), f"s3://{bucket}/runs",
         f"error: --runs_root s3://{bucket}/runs: access denied; check the credentials"),
    ]
    for env, root, message in cases:
        result = run_fit(tmp_path, *BASE, "--runs_root", root, "--run_name", "bad", env=env, timeout=120)
        assert result.returncode == 2, (root, result.stderr[-3000:])
        assert message in result.stderr, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
    # an unreachable tracking server: fit's case is in test_bad_input.py; the sweep and the team's tools here,
    # called in-process (their check is the same code path as under a subprocess, without the imports' cost)
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", dead)
    monkeypatch.chdir(tmp_path)
    tools = [(scale.main, ["--config", str(CONFIGS / "digits.yaml"), "--devices", "1,2",
                           "--runs-root", f"s3://{bucket}/runs"]),
             (compare.main, ["--experiment", "digits"]), (promote.main, ["--experiment", "digits"]),
             (reproduce.main, ["0123abcd"])]
    for main, argv in tools:
        assert main(argv) == 2, main.__module__
        assert f"error: MLflow tracking server {dead} is unreachable" in capsys.readouterr().err, main.__module__
    # the sweep checks its runs root before it opens a parent run: first with no credentials at all
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to find, and no waiting for one
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    sweep = ["--config", str(CONFIGS / "digits.yaml"), "--devices", "1,2", "--runs-root", f"s3://{bucket}/runs"]
    s3fs.S3FileSystem.clear_instance_cache()
    assert scale.main(sweep) == 2
    assert (f"error: --runs-root s3://{bucket}/runs: no credentials found (environment variables, a profile or an "
            "instance role" in capsys.readouterr().err)
    for key, value in moto_s3.env.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    assert scale.main([*sweep[:-1], "s3://atscale-no-such-bucket/runs"]) == 2
    assert ("error: --runs-root s3://atscale-no-such-bucket/runs: the bucket or container does not exist"
            in capsys.readouterr().err)
    s3fs.S3FileSystem.clear_instance_cache()
    assert not list(mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_experiments(
        filter_string="name = 'digits'"))  # no parent run was opened
    assert not (tmp_path / "runs").exists()  # nothing was trained or staged
    assert moto_s3.keys(bucket) == []  # and nothing written: the probe removes itself
