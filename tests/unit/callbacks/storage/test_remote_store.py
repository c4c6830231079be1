"""Checkpoints in object storage against a real S3 API (moto's server on 127.0.0.1).

Publication order (objects, record, pointer last), the pointer's checksums, resume falling back past
a half-uploaded checkpoint, directory (sharded) checkpoints, pruning, and early errors naming the URL.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import secrets
import threading
import warnings
from pathlib import Path

import pytest
import s3fs
import torch
import torch.distributed.checkpoint as dcp

from callbacks.checkpoint_io import AtomicCheckpointIO, mirror_of
from callbacks.storage import ckpt_store, remote_store
from callbacks.storage.remote_store import POINTER_NAME, RemoteCheckpoints, StoreError
from tests.servers import S3Server, moto_s3, moto_s3_strict  # noqa: F401 - fixtures


def _use(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point s3fs at ``server`` through the environment, as a user's credentials and endpoint would."""
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def bucket(moto_s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    _use(moto_s3, monkeypatch)
    yield moto_s3.make_bucket(f"ckpt-{secrets.token_hex(4)}")
    s3fs.S3FileSystem.clear_instance_cache()


def shard_dir(directory: Path, shards: dict[str, bytes]) -> Path:
    """A distributed checkpoint directory: a real ``.metadata`` (of an empty state, so the shards' bytes are
    never read and it loads safely) and the given shard files."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save({}, checkpoint_id=directory, no_dist=True)
    for name, data in shards.items():
        (directory / name).write_bytes(data)
    return directory


def save(io: AtomicCheckpointIO, directory: Path, name: str, step: int, run_id: str = "run-1") -> Path:
    path = directory / name
    io.save_checkpoint({"global_step": step, "epoch": step // 10, "w": torch.full((64,), float(step)),
                        "atscale": {"mlflow_run_id": run_id, "rng": [{"python": [1, 2]}]}}, path)
    return path


def test_publish_writes_objects_then_record_then_a_pointer_with_checksums(
        bucket: str, moto_s3: S3Server, tmp_path: Path) -> None:
    url = f"s3://{bucket}/runs/exp/run/checkpoints"
    io = AtomicCheckpointIO(mirror=RemoteCheckpoints(url, tmp_path))
    save(io, tmp_path, "step=00000010.ckpt", 10)
    newest = save(io, tmp_path, "step=00000020.ckpt", 20)

    prefix = "runs/exp/run/checkpoints/"
    assert sorted(moto_s3.keys(bucket, prefix)) == [prefix + k for k in (
        POINTER_NAME, "step=00000010.ckpt", "step=00000010.ckpt.meta.json",
        "step=00000020.ckpt", "step=00000020.ckpt.meta.json")]
    client = moto_s3.client()
    body = client.get_object(Bucket=bucket, Key=prefix + "step=00000020.ckpt")["Body"].read()
    assert body == newest.read_bytes()
    pointer = json.loads(client.get_object(Bucket=bucket, Key=prefix + POINTER_NAME)["Body"].read())
    assert pointer["name"] == "step=00000020.ckpt" and pointer["global_step"] == 20 and pointer["epoch"] == 2
    assert pointer["files"] == {"": {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}}
    assert pointer["extra"] == {"mlflow_run_id": "run-1"}  # the run id travels; RNG states stay in the file
    # the pointer is the newest record, written after it: the same bytes
    record = client.get_object(Bucket=bucket, Key=prefix + "step=00000020.ckpt.meta.json")["Body"].read()
    assert json.loads(record) == pointer


def test_a_new_machine_resumes_from_the_pointer(bucket: str, tmp_path: Path) -> None:
    url = f"s3://{bucket}/c"
    io = AtomicCheckpointIO(mirror=RemoteCheckpoints(url, tmp_path / "a"))
    save(io, tmp_path / "a", "step=00000010.ckpt", 10)
    original = save(io, tmp_path / "a", "step=00000020.ckpt", 20)

    fresh = tmp_path / "b" / "checkpoints"
    record = RemoteCheckpoints(url, fresh).fetch_newest_good()
    assert record is not None and record.global_step == 20 and record.path == fresh / "step=00000020.ckpt"
    assert record.path.read_bytes() == original.read_bytes()
    assert record.extra == {"mlflow_run_id": "run-1"}
    assert ckpt_store.newest_good(fresh) == record  # published locally too, with its integrity record


@pytest.mark.parametrize("damage", ["truncated", "missing", "same-size-corrupt"])
def test_pointer_to_an_incomplete_checkpoint_falls_back_to_the_previous(
        bucket: str, moto_s3: S3Server, tmp_path: Path, damage: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """An upload killed half-way: the pointer names step 20, whose object is not what it says."""
    url = f"s3://{bucket}/c"
    io = AtomicCheckpointIO(mirror=RemoteCheckpoints(url, tmp_path / "a"))
    previous = save(io, tmp_path / "a", "step=00000010.ckpt", 10)
    newest = save(io, tmp_path / "a", "step=00000020.ckpt", 20)
    client, key = moto_s3.client(), "c/step=00000020.ckpt"
    data = newest.read_bytes()
    if damage == "truncated":
        client.put_object(Bucket=bucket, Key=key, Body=data[: len(data) // 2])
    elif damage == "missing":
        client.delete_object(Bucket=bucket, Key=key)
    else:
        client.put_object(Bucket=bucket, Key=key, Body=data[:100] + bytes(64) + data[164:])

    with caplog.at_level(logging.WARNING, logger="callbacks.storage.remote_store"):
        record = RemoteCheckpoints(url, tmp_path / "b").fetch_newest_good()
    assert record is not None and record.global_step == 10
    assert record.path.read_bytes() == previous.read_bytes()
    expected = {
        "truncated": f"Checkpoint {url}/step=00000020.ckpt is incomplete: step=00000020.ckpt has {len(data) // 2} "
                     f"bytes, its record says {len(data)}; skipping it.",
        "missing": f"Checkpoint {url}/step=00000020.ckpt is incomplete: step=00000020.ckpt is missing "
                   "(an upload killed half-way?); skipping it.",
        "same-size-corrupt": f"Checkpoint {url}/step=00000020.ckpt is corrupt: step=00000020.ckpt fails its "
                             "size/SHA-256 check; skipping it.",
    }[damage]
    assert expected in caplog.messages
    assert not (tmp_path / "b" / "step=00000020.ckpt").exists()  # nothing half-downloaded left behind
    assert [p.name for p in (tmp_path / "b").iterdir() if p.name.startswith(".")] == [".locks"]


def test_sharded_directory_checkpoint_round_trips_and_a_missing_shard_is_skipped(
        bucket: str, moto_s3: S3Server, tmp_path: Path) -> None:
    url = f"s3://{bucket}/fsdp"
    mirror = RemoteCheckpoints(url, tmp_path / "a")
    for step in (5, 9):
        shards = shard_dir(tmp_path / "a" / f"step={step:08d}.ckpt",
                           {f"__{rank}_0.distcp": bytes([rank, step]) * 1000 for rank in range(2)})
        ckpt_store.write_record(shards, step, 0, extra={"mlflow_run_id": "r"})
        mirror.publish(shards)

    record = RemoteCheckpoints(url, tmp_path / "b").fetch_newest_good()
    assert record is not None and record.global_step == 9 and record.path.is_dir()
    assert sorted(p.name for p in record.path.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert (record.path / "__1_0.distcp").read_bytes() == bytes([1, 9]) * 1000

    moto_s3.client().delete_object(Bucket=bucket, Key="fsdp/step=00000009.ckpt/__1_0.distcp")
    record = RemoteCheckpoints(url, tmp_path / "c").fetch_newest_good()
    assert record is not None and record.global_step == 5


def test_a_staged_copy_that_verifies_is_not_downloaded_again(bucket: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"s3://{bucket}/c"
    mirror = RemoteCheckpoints(url, tmp_path)
    path = save(AtomicCheckpointIO(mirror=mirror), tmp_path, "step=00000003.ckpt", 3)

    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("downloaded a checkpoint the machine already has")

    relaunch = RemoteCheckpoints(url, tmp_path)
    monkeypatch.setattr(relaunch.fs, "get_file", no_download)
    record = relaunch.fetch_newest_good()
    assert record is not None and record.path == path and record.global_step == 3


def test_the_pointer_never_moves_back_and_prune_keeps_the_newest(bucket: str, moto_s3: S3Server,
                                                                  tmp_path: Path) -> None:
    url = f"s3://{bucket}/c"
    mirror = RemoteCheckpoints(url, tmp_path)
    io = AtomicCheckpointIO(mirror=mirror)
    for step in (10, 30, 20, 40):  # 20 arrives after 30 (a slow best-checkpoint save)
        save(io, tmp_path, f"step={step:08d}.ckpt", step)
        if step == 20:
            assert mirror.read_pointer()["name"] == "step=00000030.ckpt"
    moto_s3.client().put_object(Bucket=bucket, Key="c/step=00000005.ckpt", Body=b"debris of a killed upload")
    moto_s3.client().put_object(Bucket=bucket, Key="c/step=00000050.ckpt", Body=b"an upload in flight")

    removed = mirror.prune("step=*.ckpt", keep=2)
    assert sorted(removed) == ["step=00000005.ckpt", "step=00000010.ckpt", "step=00000020.ckpt"]
    assert [r["name"] for r in mirror.records()] == ["step=00000040.ckpt", "step=00000030.ckpt"]
    assert "c/step=00000050.ckpt" in moto_s3.keys(bucket, "c/")
    assert mirror.read_pointer()["name"] == "step=00000040.ckpt"


def test_remove_deletes_both_copies(bucket: str, moto_s3: S3Server, tmp_path: Path) -> None:
    io = AtomicCheckpointIO(mirror=RemoteCheckpoints(f"s3://{bucket}/c", tmp_path))
    path = save(io, tmp_path, "best-000-00000007.ckpt", 7)
    assert mirror_of(io) is io.mirror
    io.remove_checkpoint(path)
    assert not path.exists() and not ckpt_store.meta_path(path).exists()
    assert moto_s3.keys(bucket, "c/best") == []


def test_early_errors_name_the_url(bucket: str, moto_s3: S3Server, moto_s3_strict: S3Server,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    remote_store.check_writable(f"s3://{bucket}/runs")  # a good one passes and leaves nothing behind
    assert moto_s3.keys(bucket) == []
    with pytest.raises(StoreError, match=r"^s3://no-such-bucket-atscale/runs: the bucket or container does "
                                         r"not exist \(The specified bucket does not exist\)$"):
        remote_store.check_writable("s3://no-such-bucket-atscale/runs")
    _use(moto_s3_strict, monkeypatch)
    with pytest.raises(StoreError, match=rf"^s3://{bucket}/runs: access denied; check the credentials"):
        remote_store.check_writable(f"s3://{bucket}/runs")


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed")
def test_a_missing_backend_names_the_extra_to_install() -> None:
    with pytest.raises(StoreError, match=r"^gs://b/runs: no filesystem for gs:// is installed "
                                         r"\(pip install 'atscale\[gcs\]'\)$"):
        remote_store.check_writable("gs://b/runs")


def test_local_locations_are_not_remote() -> None:
    assert not remote_store.is_remote("runs") and not remote_store.is_remote("/abs/runs")
    assert not remote_store.is_remote("file:///abs/runs")
    assert remote_store.local_path("file:///abs/runs") == Path("/abs/runs")
    assert remote_store.is_remote("s3://b/runs") and remote_store.is_remote("az://c/runs")
    assert remote_store.join("s3://b/runs/", "exp", "/run") == "s3://b/runs/exp/run"


def test_fresh_moves_the_remote_checkpoints_aside(bucket: str, moto_s3: S3Server, tmp_path: Path) -> None:
    mirror = RemoteCheckpoints(f"s3://{bucket}/r/checkpoints", tmp_path)
    save(AtomicCheckpointIO(mirror=mirror), tmp_path, "step=00000004.ckpt", 4)
    assert mirror.move_aside("before-x") == f"s3://{bucket}/r/checkpoints.before-x"
    assert mirror.records() == [] and mirror.read_pointer() is None
    assert sorted(moto_s3.keys(bucket, "r/")) == [f"r/checkpoints.before-x/{k}" for k in (
        POINTER_NAME, "step=00000004.ckpt", "step=00000004.ckpt.meta.json")]
    assert mirror.move_aside("again") is None  # nothing left to move


def test_explicit_ckpt_path_url_is_downloaded_verified_and_names_its_run(bucket: str, moto_s3: S3Server,
                                                                         tmp_path: Path) -> None:
    from recipes.run.context import UsageError, explicit_checkpoint

    url = f"s3://{bucket}/r/checkpoints"
    original = save(AtomicCheckpointIO(mirror=RemoteCheckpoints(url, tmp_path / "a")), tmp_path / "a",
                    "step=00000006.ckpt", 6, run_id="abc123")
    path, run_id = explicit_checkpoint(f"{url}/step=00000006.ckpt", tmp_path / "b")
    assert Path(path) == tmp_path / "b" / "step=00000006.ckpt" and run_id == "abc123"
    assert Path(path).read_bytes() == original.read_bytes()
    with pytest.raises(UsageError, match=rf"^--ckpt_path {url}/nope.ckpt: {url}/nope.ckpt has no checkpoint record"):
        explicit_checkpoint(f"{url}/nope.ckpt", tmp_path / "c")
    moto_s3.client().put_object(Bucket=bucket, Key="r/checkpoints/step=00000006.ckpt", Body=b"cut short")
    with pytest.raises(UsageError, match=r"step=00000006.ckpt is incomplete or corrupt"):
        explicit_checkpoint(f"{url}/step=00000006.ckpt", tmp_path / "d")


def test_a_newer_staged_checkpoint_is_uploaded_and_wins_over_the_bucket(bucket: str, tmp_path: Path) -> None:
    """The same machine relaunched after an upload died: it must not go back to the bucket's older step."""
    from recipes.run.context import newest_of_bucket_and_staging

    url = f"s3://{bucket}/r/checkpoints"
    mirror = RemoteCheckpoints(url, tmp_path)
    save(AtomicCheckpointIO(mirror=mirror), tmp_path, "step=00000010.ckpt", 10)
    save(AtomicCheckpointIO(mirror=None), tmp_path, "step=00000020.ckpt", 20)  # its upload never happened
    record = newest_of_bucket_and_staging(mirror, ckpt_store.newest_good(tmp_path))
    assert record is not None and record.global_step == 20 and record.path == tmp_path / "step=00000020.ckpt"
    assert mirror.read_pointer()["name"] == "step=00000020.ckpt"
    elsewhere = RemoteCheckpoints(url, tmp_path / "elsewhere").fetch_newest_good()  # and now in the bucket
    assert elsewhere is not None and elsewhere.global_step == 20
    assert elsewhere.path.read_bytes() == record.path.read_bytes()


def test_a_staged_checkpoint_of_another_run_never_wins(bucket: str, tmp_path: Path) -> None:
    """The bucket was started afresh elsewhere (a new MLflow run): this machine's old, higher step stays local."""
    from recipes.run.context import newest_of_bucket_and_staging

    mirror = RemoteCheckpoints(f"s3://{bucket}/r/checkpoints", tmp_path / "bucket-copy")
    save(AtomicCheckpointIO(mirror=mirror), tmp_path / "bucket-copy", "step=00000030.ckpt", 30, run_id="new-run")
    save(AtomicCheckpointIO(mirror=None), tmp_path / "old", "step=00000900.ckpt", 900, run_id="old-run")
    record = newest_of_bucket_and_staging(mirror, ckpt_store.newest_good(tmp_path / "old"))
    assert record is not None and record.global_step == 30 and record.extra["mlflow_run_id"] == "new-run"
    assert mirror.read_pointer()["global_step"] == 30


def test_checkpoints_that_all_fail_verification_stop_the_run_with_a_clear_error(
        bucket: str, moto_s3: S3Server, tmp_path: Path) -> None:
    """Starting over beside broken records would see every new checkpoint pruned against them."""
    from jsonargparse import Namespace

    from recipes.run.context import (
        RunContext,
        UsageError,
        resolve_resume,
    )

    run_url = f"s3://{bucket}/runs/exp/run"
    ctx = RunContext("exp", "run", tmp_path / "run", "sqlite://", None, None, run_url)
    save(AtomicCheckpointIO(mirror=ctx.remote_checkpoints()), tmp_path / "writer", "step=00000004.ckpt", 4)
    moto_s3.client().put_object(Bucket=bucket, Key="runs/exp/run/checkpoints/step=00000004.ckpt", Body=b"torn")
    with pytest.raises(UsageError, match=rf"^none of the 1 checkpoint\(s\) of {run_url} verifies"):
        resolve_resume(Namespace(ckpt_path=None, fresh=False), ctx)


def test_malformed_records_are_ignored_with_a_warning(bucket: str, moto_s3: S3Server, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    mirror = RemoteCheckpoints(f"s3://{bucket}/c", tmp_path)
    save(AtomicCheckpointIO(mirror=mirror), tmp_path, "step=00000001.ckpt", 1)
    broken = {"name": "step=00000009.ckpt", "files": {"": {"size": 1, "sha256": "x"}}, "epoch": 0, "saved_at": 1.0}
    moto_s3.client().put_object(Bucket=bucket, Key="c/step=00000009.ckpt.meta.json", Body=json.dumps(broken))
    with caplog.at_level(logging.WARNING, logger="callbacks.storage.remote_store"):
        assert [r["name"] for r in mirror.records()] == ["step=00000001.ckpt"]  # no global_step: ignored
    assert (f"s3://{bucket}/c/step=00000009.ckpt.meta.json is not a checkpoint record (fields missing or of the "
            "wrong type); ignoring it.") in caplog.messages


def test_ranks_of_one_machine_fetching_together_download_once(bucket: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"s3://{bucket}/c"
    shards = shard_dir(tmp_path / "a" / "step=00000002.ckpt",
                       {f"__{rank}_0.distcp": bytes([rank]) * 50_000 for rank in range(2)})
    ckpt_store.write_record(shards, 2, 0)
    RemoteCheckpoints(url, tmp_path / "a").publish(shards)

    fetchers = [RemoteCheckpoints(url, tmp_path / "b") for _ in range(2)]
    assert fetchers[0].fs is fetchers[1].fs  # fsspec shares one filesystem instance
    downloads: list[str] = []
    real = fetchers[0].fs.get_file

    def counted(rpath: str, lpath: str, **kwargs: object) -> None:
        downloads.append(rpath)
        real(rpath, lpath, **kwargs)

    monkeypatch.setattr(fetchers[0].fs, "get_file", counted)
    results: list[object] = []
    threads = [threading.Thread(target=lambda f=f: results.append(f.fetch_newest_good())) for f in fetchers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == 2 and all(r is not None and r.path == tmp_path / "b" / shards.name for r in results)
    assert len(downloads) == 3  # .metadata and two shards, fetched once: the second rank found them staged
    assert (tmp_path / "b" / shards.name / "__1_0.distcp").read_bytes() == bytes([1]) * 50_000


def test_store_outages_during_prune_and_remove_are_logged_not_raised(bucket: str, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    mirror = RemoteCheckpoints(f"s3://{bucket}/c", tmp_path)
    save(AtomicCheckpointIO(mirror=mirror), tmp_path, "best-000-00000001.ckpt", 1)

    def outage(*args: object, **kwargs: object) -> None:
        raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr(mirror.fs, "ls", outage)
    monkeypatch.setattr(mirror.fs, "exists", outage)
    with caplog.at_level(logging.ERROR, logger="callbacks.storage.remote_store"):
        assert mirror.try_prune("step=*.ckpt", keep=1) == []
        mirror.try_remove("best-000-00000001.ckpt")
    assert caplog.messages == [
        f"Could not prune s3://{bucket}/c (ConnectionResetError: connection reset by peer); older checkpoints stay "
        "in the bucket until the next save.",
        f"Could not delete s3://{bucket}/c/best-000-00000001.ckpt (ConnectionResetError: connection reset by peer); "
        "it stays in the bucket."]


def test_a_failed_upload_is_logged_and_training_goes_on(bucket: str, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    io = AtomicCheckpointIO(mirror=RemoteCheckpoints("s3://atscale-bucket-gone/r/checkpoints", tmp_path))
    with caplog.at_level(logging.ERROR, logger="callbacks.storage.remote_store"):
        path = save(io, tmp_path, "step=00000008.ckpt", 8)
    assert io.upload_failures == 1
    assert ckpt_store.newest_good(tmp_path).path == path  # the local checkpoint is published and intact
    (message,) = caplog.messages
    assert message.startswith(f"Could not upload checkpoint {path} to s3://atscale-bucket-gone/r/checkpoints "
                              "(FileNotFoundError: The specified bucket does not exist); training goes on")


def test_download_progress_counts_every_byte_across_shards(bucket: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    class Recorder:
        completed: list[int] = []

        def update(self, task: int, completed: int) -> None:
            self.completed.append(completed)

    shards = shard_dir(tmp_path / "a" / "step=00000001.ckpt",
                       {"__0_0.distcp": b"x" * 3000, "__1_0.distcp": b"y" * 5000})
    total = 8000 + (shards / ".metadata").stat().st_size
    ckpt_store.write_record(shards, 1, 0)
    RemoteCheckpoints(f"s3://{bucket}/p", tmp_path / "a").publish(shards)

    recorder = Recorder()
    monkeypatch.setattr(remote_store, "_progress",
                        contextlib.contextmanager(lambda description, total: iter([remote_store._RichBytes(
                            recorder, 0)])))
    remote = RemoteCheckpoints(f"s3://{bucket}/p", tmp_path / "b")
    assert remote.fetch_newest_good() is not None
    assert recorder.completed[-1] == total and recorder.completed == sorted(recorder.completed)
    assert remote.last_fetch is not None and remote.last_fetch[0] == total


def test_checkpoint_state_from_another_machine_is_moved_to_this_directory() -> None:
    from recipes.run.cli_callbacks import relocate_checkpoint_state

    old, new = "/home/a/work/runs/digits/spot/checkpoints", "/scratch/b/runs/digits/spot/checkpoints"
    state = {"dirpath": old, "best_model_path": f"{old}/best-000-00000045.ckpt", "best_model_score": 0.9,
             "kth_best_model_path": f"{old}/best-000-00000045.ckpt", "last_model_path": "",
             "best_k_models": {f"{old}/best-000-00000045.ckpt": 0.9}}
    assert relocate_checkpoint_state(state, new)
    assert state == {"dirpath": new, "best_model_path": f"{new}/best-000-00000045.ckpt", "best_model_score": 0.9,
                     "kth_best_model_path": f"{new}/best-000-00000045.ckpt", "last_model_path": "",
                     "best_k_models": {f"{new}/best-000-00000045.ckpt": 0.9}}
    other_run = {"dirpath": "/home/a/work/runs/digits/other/checkpoints", "best_model_path": "x"}
    assert not relocate_checkpoint_state(other_run, new)  # another run's state is left for Lightning to refuse
    assert other_run["dirpath"] == "/home/a/work/runs/digits/other/checkpoints"
    assert not relocate_checkpoint_state({"dirpath": new}, new)
