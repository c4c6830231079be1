"""No checkpoint the project reads may run code, and a full disk during a save says so and keeps the previous one.

Every attack here is a real pickle payload (an object whose ``__reduce__`` runs ``exec``) placed where an
attacker with write access to a run's checkpoint folder, or to the bucket it is mirrored to, would put it:

- in a distributed checkpoint's ``.metadata`` (read by torch's ``FileSystemReader`` with plain ``pickle.load``),
  edited in place with the same size, so a size-only record still matches;
- in a non-tensor item of a ``.distcp`` shard (read by torch's default load planner with ``weights_only=False``);
- as a forged newest ``.ckpt`` file whose record the attacker recomputed (size and SHA-256 match).

The test passes only if the payload's marker file never appears, the lookups fall back to the previous good
checkpoint with a warning naming the file, and ``recipes.sample`` refuses with one ``error:`` line.

These are the in-process cases (the safe reader, the lookups, the bucket fetch, a real full tmpfs); the CLI's
(``recipes.sample``, relaunches of ``recipes.fit``) are in tests/e2e/test_untrusted_checkpoints.py.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import pickle
import re
import subprocess
from pathlib import Path, PosixPath

import pytest
import torch
import torch.distributed.checkpoint as dcp

from callbacks.checkpoint_io import AtomicCheckpointIO, BoundedAsyncCheckpointIO
from callbacks.storage import ckpt_store, safe_load
from callbacks.storage.remote_store import RemoteCheckpoints
from tests.conftest import (
    Payload,
    forge_file,
    gpt_dcp_checkpoint,
    marker,  # noqa: F401 - fixture
    shard_with_a_payload_item,
    tamper_metadata_same_size,
    tiny_gpt,
)

# dcp.save(..., no_dist=True) warns that it saves in one process, as asked
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def save_file(directory: Path, step: int) -> Path:
    path = directory / f"step={step:08d}.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": step, "epoch": 0, "w": torch.full((64,), float(step))},
                                         path)
    return path




# ------------------------------------------------------------ the safe reader
def test_real_distributed_checkpoint_loads_through_the_safe_reader(tmp_path: Path) -> None:
    directory = gpt_dcp_checkpoint(tmp_path / "ck")
    with open(directory / ".metadata", "rb") as handle:
        reference = pickle.load(handle)  # trusted here: the test wrote it
    metadata = safe_load.load_dcp_metadata(directory)
    assert metadata.state_dict_metadata == reference.state_dict_metadata
    assert metadata.storage_data == reference.storage_data
    safe_load.check(directory)

    model, optimizer = tiny_gpt(seed=1)
    optimizer.param_groups[0]["lr"] = 0.5
    state = {"state_dict": model.state_dict(), "optimizer_0": optimizer.state_dict()}
    safe_load.load_distributed(state, directory)
    expected_model, expected_optimizer = tiny_gpt(seed=0)
    expected = expected_model.state_dict()
    assert all(torch.equal(state["state_dict"][k], expected[k]) for k in expected)
    exp_avg = expected_optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(state["optimizer_0"]["state"][0]["exp_avg"], exp_avg)
    assert state["optimizer_0"]["param_groups"][0]["lr"] == 1e-3  # a non-tensor item, through the safe path


class _PickledByName:
    """Pickles as ``getattr(owner, name)``: how Python 3.11.2 (Debian 12's) pickles an enum member."""

    def __init__(self, owner: object, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self) -> tuple:
        return getattr, (self.owner, self.name)


def test_an_enum_member_pickled_by_name_loads_and_nothing_else_by_getattr(tmp_path: Path) -> None:
    """A checkpoint written under Python 3.11.2 names ``builtins.getattr`` for its ``_MEM_FORMAT_ENCODING``: the
    safe reader refused every FSDP checkpoint written there. The member loads; getattr of anything else does not."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    def load(obj: object) -> object:
        return safe_load.read_metadata(io.BytesIO(pickle.dumps(obj, protocol=4)), tmp_path / ".metadata")

    member = _PickledByName(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")
    assert b"getattr" in pickle.dumps(member, protocol=4)
    # it loads (as the member; it is no metadata, so the reader stops there)
    with pytest.raises(safe_load.CheckpointRejected, match="holds a _MEM_FORMAT_ENCODING, not checkpoint metadata"):
        load(member)
    for forged, named in [(_PickledByName(_MEM_FORMAT_ENCODING, "__class__"), r"getattr\('_MEM_FORMAT_ENCODING', "
                                                                              r"'__class__'\), which is not a member"),
                          (_PickledByName(PosixPath, "home"), r"getattr\('PosixPath', 'home'\)")]:
        with pytest.raises(safe_load.CheckpointRejected, match=named):
            load(forged)


def test_tampered_metadata_is_refused_by_the_safe_reader(tmp_path: Path, marker: Path) -> None:
    directory = gpt_dcp_checkpoint(tmp_path / "ck")
    tamper_metadata_same_size(directory, marker)
    with pytest.raises(safe_load.CheckpointRejected, match=r"\.metadata.*builtins\.exec"):
        safe_load.load_dcp_metadata(directory)
    with pytest.raises(safe_load.CheckpointRejected, match=r"builtins\.exec"):
        safe_load.load_distributed({"state_dict": {}}, directory)
    with pytest.raises(safe_load.CheckpointRejected, match=re.escape(str(directory))):
        safe_load.check(directory)


def test_payload_in_a_shard_item_is_refused(tmp_path: Path, marker: Path) -> None:
    directory = shard_with_a_payload_item(tmp_path / "ck", marker)
    safe_load.load_dcp_metadata(directory)  # the metadata itself is clean
    with pytest.raises(safe_load.CheckpointRejected, match="exec"):
        safe_load.check(directory)
    with pytest.raises(safe_load.CheckpointRejected, match="exec"):
        safe_load.load_distributed({"state_dict": {"w": torch.zeros(4)}, "extra": None}, directory)


def test_metadata_naming_a_file_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "ck"
    dcp.save({"w": torch.ones(4)}, checkpoint_id=directory, no_dist=True)
    with open(directory / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    with open(directory / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)  # only allowed classes: a clean pickle, but it points outside
    with pytest.raises(safe_load.CheckpointRejected, match="outside the checkpoint"):
        safe_load.check(directory)


@pytest.mark.parametrize("kind", ["zip", "plain-pickle"])
def test_forged_file_is_refused_by_the_cheap_check(tmp_path: Path, marker: Path, kind: str) -> None:
    path = save_file(tmp_path, 1)
    safe_load.check(path)
    forge_file(path, marker, kind)
    with pytest.raises(safe_load.CheckpointRejected, match=re.escape(str(path))):
        safe_load.check(path)


# ------------------------------------------------------- records and lookups
def test_directory_records_hold_every_file_hash(tmp_path: Path) -> None:
    directory = gpt_dcp_checkpoint(tmp_path / "step=00000001.ckpt")
    record = ckpt_store.write_record(directory, 1, 0)
    on_disk = json.loads(ckpt_store.meta_path(directory).read_text())
    names = sorted(f.relative_to(directory).as_posix() for f in directory.rglob("*") if f.is_file())
    assert sorted(on_disk["files"]) == names == sorted(record.files) and ".metadata" in names
    assert on_disk["files"][".metadata"] == {"size": (directory / ".metadata").stat().st_size,
                                             "sha256": ckpt_store.file_sha256(directory / ".metadata")}
    assert on_disk["size"] == sum(f["size"] for f in on_disk["files"].values())
    assert ckpt_store.read_record(directory) == record


@pytest.mark.parametrize("record_kind", ["hashed", "size-only (older code)", "forged (recomputed)"])
def test_tampered_metadata_is_skipped_for_the_previous_directory(tmp_path: Path, marker: Path, record_kind: str,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    good = gpt_dcp_checkpoint(tmp_path / "step=00000001.ckpt", seed=1)
    ckpt_store.write_record(good, 1, 0)
    newest = gpt_dcp_checkpoint(tmp_path / "step=00000002.ckpt", seed=2)
    ckpt_store.write_record(newest, 2, 0)
    if record_kind == "size-only (older code)":
        for path in (good, newest):
            data = json.loads(ckpt_store.meta_path(path).read_text())
            del data["files"]
            ckpt_store.meta_path(path).write_text(json.dumps(data))
        assert ckpt_store.read_record(good) is not None  # an old run still resumes
    tamper_metadata_same_size(newest, marker)
    if record_kind == "forged (recomputed)":
        ckpt_store.write_record(newest, 2, 0)

    with caplog.at_level(logging.WARNING, logger="callbacks.storage.ckpt_store"):
        assert ckpt_store.read_record(newest) is None
        record = ckpt_store.newest_good(tmp_path)
    assert record is not None and record.path == good and record.global_step == 1
    if record_kind == "hashed":
        assert f"Checkpoint {newest} fails its SHA-256 check on .metadata (corrupt or changed); skipping it." \
            in caplog.messages
    else:
        assert any(m.startswith(f"Checkpoint {newest} cannot be loaded safely (") and "builtins.exec" in m
                   and m.endswith("); skipping it.") for m in caplog.messages), caplog.messages


def test_a_shard_file_added_or_removed_fails_the_record(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = gpt_dcp_checkpoint(tmp_path / "step=00000001.ckpt")
    ckpt_store.write_record(directory, 1, 0)
    (directory / "meta.pt").rename(tmp_path / "aside")
    (directory / "extra.bin").write_bytes(b"x" * (tmp_path / "aside").stat().st_size)  # same total size
    with caplog.at_level(logging.WARNING, logger="callbacks.storage.ckpt_store"):
        assert ckpt_store.read_record(directory) is None
    assert (f"Checkpoint {directory} does not hold the files its record lists (missing: meta.pt; unexpected: "
            "extra.bin); skipping it.") in caplog.messages


@pytest.mark.parametrize("kind", ["zip", "plain-pickle"])
def test_forged_newest_file_is_skipped_for_the_previous(tmp_path: Path, marker: Path, kind: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    previous = save_file(tmp_path, 10)
    newest = save_file(tmp_path, 20)
    forge_file(newest, marker, kind)
    with caplog.at_level(logging.WARNING, logger="callbacks.storage.ckpt_store"):
        record = ckpt_store.newest_good(tmp_path)
    assert record is not None and record.path == previous and record.global_step == 10
    (message,) = caplog.messages
    assert message.startswith(f"Checkpoint {newest} cannot be loaded safely (") and message.endswith(
        "); skipping it.")


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_the_bucket_fetch_skips_a_forged_newest_checkpoint(tmp_path: Path, marker: Path, kind: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A forged object in the bucket whose record was recomputed (checksums match): never staged, never resumed."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    mirror = RemoteCheckpoints(f"file://{bucket}", tmp_path / "a")
    for step in (10, 20):
        path = tmp_path / "a" / f"step={step:08d}.ckpt"
        if kind == "file":
            AtomicCheckpointIO(mirror=mirror).save_checkpoint(
                {"global_step": step, "epoch": 0, "w": torch.full((64,), float(step))}, path)
        else:
            ckpt_store.write_record(gpt_dcp_checkpoint(path, seed=step), step, 0)
            (bucket / path.name).mkdir()  # a local "bucket" has directories (fsspec's local put makes none)
            mirror.publish(path)
    name = "step=00000020.ckpt"
    remote_record = json.loads((bucket / f"{name}.meta.json").read_text())
    if kind == "file":
        torch.save({"x": Payload(marker)}, bucket / name)
        forged, rel = bucket / name, ""
    else:
        tamper_metadata_same_size(bucket / name, marker)
        forged, rel = bucket / name / ".metadata", ".metadata"
    remote_record["files"][rel] = {"size": forged.stat().st_size, "sha256": ckpt_store.file_sha256(forged)}
    for record_name in (f"{name}.meta.json", "latest.json"):
        (bucket / record_name).write_text(json.dumps(remote_record))

    with caplog.at_level(logging.WARNING, logger="callbacks.storage.remote_store"):
        record = RemoteCheckpoints(f"file://{bucket}", tmp_path / "b").fetch_newest_good()
    assert record is not None and record.global_step == 10 and record.path == tmp_path / "b" / "step=00000010.ckpt"
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [
        ".locks", "step=00000010.ckpt", "step=00000010.ckpt.meta.json"]  # nothing of the forged one staged
    (message,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert message.startswith(f"Checkpoint file://{bucket}/{name} cannot be loaded safely (") and "exec" in message


# ------------------------------------------------------------------ full disk
@pytest.fixture
def full_disk(tmp_path: Path) -> Path:
    """A 256 KiB tmpfs: a checkpoint bigger than that really fills it (ENOSPC from the kernel)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_raises_enospc_and_keeps_the_previous_checkpoint(full_disk: Path, mode: str) -> None:
    io = AtomicCheckpointIO() if mode == "sync" else BoundedAsyncCheckpointIO(AtomicCheckpointIO())
    previous = full_disk / "step=00000001.ckpt"
    io.save_checkpoint({"global_step": 1, "epoch": 0, "w": torch.arange(1000)}, previous)
    if mode == "async":
        io.teardown()
    before = {p.name: p.read_bytes() for p in full_disk.iterdir()}
    assert sorted(before) == ["step=00000001.ckpt", "step=00000001.ckpt.meta.json"]

    big = full_disk / "step=00000002.ckpt"
    with pytest.raises(OSError) as err:
        io.save_checkpoint({"global_step": 2, "epoch": 0, "w": torch.zeros(200_000)}, big)  # 800 kB
        if mode == "async":
            io.teardown()  # the writer thread's error surfaces here
    assert err.value.errno == errno.ENOSPC
    message = str(err.value)
    assert f"could not write checkpoint {big} (No space left on device)" in message
    assert "the previous checkpoints are intact" in message
    assert {p.name: p.read_bytes() for p in full_disk.iterdir()} == before  # no temporary file left either
    record = ckpt_store.newest_good(full_disk)
    assert record is not None and record.path == previous and record.global_step == 1


def test_atomic_write_reraises_the_oserror_torch_wraps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's zip writer turns the file's OSError into ``RuntimeError: ... unexpected pos``: get the errno back."""

    class FullAfter1000Bytes:
        def __init__(self, path: Path, mode: str) -> None:
            self._file, self._written = open(path, mode), 0

        def write(self, data: bytes) -> int:
            if self._written + len(data) > 1000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self._written += len(data)
            return self._file.write(data)

        def __getattr__(self, name: str) -> object:
            return getattr(self._file, name)

        def __enter__(self) -> FullAfter1000Bytes:
            return self

        def __exit__(self, *exc: object) -> None:
            self._file.close()

    monkeypatch.setattr(ckpt_store, "open", FullAfter1000Bytes, raising=False)
    with pytest.raises(OSError) as err:
        ckpt_store.atomic_write(tmp_path / "x.ckpt", lambda handle: torch.save({"w": torch.zeros(10_000)}, handle))
    assert err.value.errno == errno.ENOSPC
    assert isinstance(err.value.__cause__, RuntimeError) and "unexpected pos" in str(err.value.__cause__)
    assert list(tmp_path.iterdir()) == []


