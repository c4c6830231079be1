"""The server fixtures really serve: s3fs reaches moto through env vars alone, the strict moto rejects made-up
credentials, and a real MLflow server proxies artifacts into the moto bucket for a client without S3 credentials."""

# Fixtures are imported by name, so the test arguments that request them shadow the imports (F811).

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import fsspec
import pytest
import s3fs  # noqa: F401  (dev dependencies: missing or broken is a failure, not a skip)

from tests.servers import (  # noqa: F401
    S3Server,
    free_port,
    mlflow_server,
    moto_s3,
    moto_s3_strict,
    s3fs_fresh,
    start_process,
)


def unique(prefix: str) -> str:
    """A bucket/experiment name no other test in the session uses (the servers are session-wide)."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def use_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """Point this process at a server the way a user would: environment variables only."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_moto_s3fs_roundtrip_through_env_vars(moto_s3: S3Server, monkeypatch: pytest.MonkeyPatch,
                                              s3fs_fresh: None) -> None:
    bucket = moto_s3.make_bucket(unique("roundtrip"))
    use_env(monkeypatch, moto_s3.env)
    data = os.urandom(4096)

    fs, path = fsspec.core.url_to_fs(f"s3://{bucket}/ckpt/epoch=1.ckpt")
    fs.pipe_file(path, data)
    fs.pipe_file(f"{bucket}/other/x.txt", b"x")

    body = moto_s3.client().get_object(Bucket=bucket, Key="ckpt/epoch=1.ckpt")["Body"].read()
    assert body == data
    assert moto_s3.keys(bucket) == ["ckpt/epoch=1.ckpt", "other/x.txt"]
    assert moto_s3.keys(bucket, prefix="ckpt/") == ["ckpt/epoch=1.ckpt"]


def test_moto_missing_bucket_is_file_not_found(moto_s3: S3Server, monkeypatch: pytest.MonkeyPatch,
                                               s3fs_fresh: None) -> None:
    use_env(monkeypatch, moto_s3.env)
    fs, path = fsspec.core.url_to_fs(f"s3://{unique('no-such-bucket')}/x")
    with pytest.raises(FileNotFoundError, match="The specified bucket does not exist"):
        fs.pipe_file(path, b"x")


def test_strict_moto_rejects_made_up_credentials(moto_s3_strict: S3Server, monkeypatch: pytest.MonkeyPatch,
                                                 s3fs_fresh: None) -> None:
    from botocore.exceptions import ClientError

    bucket = moto_s3_strict.make_bucket(unique("strict"))
    use_env(monkeypatch, moto_s3_strict.env)
    assert os.environ["AWS_ACCESS_KEY_ID"] == "AKIAWRONGWRONGWRONG1"

    fs, path = fsspec.core.url_to_fs(f"s3://{bucket}/ckpt/last.ckpt")
    with pytest.raises(PermissionError, match="Access Key Id you provided does not exist") as err:
        fs.pipe_file(path, b"weights")
    cause = err.value.__cause__
    assert isinstance(cause, ClientError)
    assert cause.response["Error"]["Code"] == "InvalidAccessKeyId"
    assert cause.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert moto_s3_strict.keys(bucket) == []


def test_strict_moto_accepts_its_admin_credentials(moto_s3_strict: S3Server, monkeypatch: pytest.MonkeyPatch,
                                                   s3fs_fresh: None) -> None:
    """Control for the test above: the same write through s3fs succeeds with credentials the server knows."""
    assert moto_s3_strict.admin_env is not None
    bucket = moto_s3_strict.make_bucket(unique("strict-ok"))
    use_env(monkeypatch, moto_s3_strict.admin_env)

    fs, path = fsspec.core.url_to_fs(f"s3://{bucket}/ckpt/last.ckpt")
    fs.pipe_file(path, b"weights")
    assert moto_s3_strict.keys(bucket) == ["ckpt/last.ckpt"]


def test_start_process_reports_log_tail_when_server_dies(tmp_path: Path) -> None:
    log = tmp_path / "boom.log"
    cmd = [sys.executable, "-c", "print('boom: cannot bind', flush=True); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match=r"exited with 3[\s\S]*boom: cannot bind"):
        start_process(cmd, {**os.environ}, log, f"http://127.0.0.1:{free_port()}/", timeout=30)


@pytest.mark.slow(covered_by="tests/e2e/test_team_server.py::"
                            "test_the_server_keeps_runs_in_postgres_and_artifacts_in_the_bucket")
def test_mlflow_server_proxies_artifacts_into_moto(moto_s3: S3Server, mlflow_server, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3
    import mlflow

    bucket = moto_s3.make_bucket(unique("mlflow"))
    url = mlflow_server(bucket, tmp_path / "server")

    # The client side has no S3 credentials or endpoint and no ambient tracking URI: only the server talks to S3.
    for key in list(os.environ):
        if key.startswith(("AWS_", "MLFLOW_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert boto3.Session().get_credentials() is None

    client = mlflow.MlflowClient(tracking_uri=url)
    exp_id = client.create_experiment(unique("servers"))
    assert client.get_experiment(exp_id).artifact_location.startswith("mlflow-artifacts:")
    run_id = client.create_run(exp_id).info.run_id
    data = os.urandom(1024)
    artifact = tmp_path / "ckpt.bin"
    artifact.write_bytes(data)
    client.log_artifact(run_id, str(artifact))
    client.log_metric(run_id, "val_loss", 0.25, step=3)
    client.set_terminated(run_id, "FINISHED")

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics == {"val_loss": 0.25}
    assert [(f.path, f.file_size) for f in client.list_artifacts(run_id)] == [("ckpt.bin", len(data))]
    fetched = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="ckpt.bin", tracking_uri=url,
                                                       dst_path=str(tmp_path / "download")))
    assert fetched.read_bytes() == data

    key = f"mlartifacts/{exp_id}/{run_id}/artifacts/ckpt.bin"
    assert moto_s3.keys(bucket, prefix="mlartifacts/") == [key]
    assert moto_s3.client().get_object(Bucket=bucket, Key=key)["Body"].read() == data
