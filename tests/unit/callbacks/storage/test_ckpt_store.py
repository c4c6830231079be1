"""callbacks.storage.ckpt_store: atomic files, integrity records, newest-good lookup, pruning, with exact values.

Records are checked against hand-known digests (SHA-256 of ``b"abc"`` is FIPS 180-2's first example).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch

from callbacks.storage import ckpt_store

ABC_SHA256 = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def _ckpt(directory: Path, step: int, saved_at: float | None = None) -> Path:
    """A checkpoint that loads safely (tensors only), published with its record."""
    path = directory / f"step={step:08d}.ckpt"
    directory.mkdir(parents=True, exist_ok=True)
    torch.save({"w": torch.full((4,), float(step))}, path)
    ckpt_store.write_record(path, step, step // 10)
    if saved_at is not None:  # a record written at a chosen time
        meta = ckpt_store.meta_path(path)
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "saved_at": saved_at}))
    return path


def test_meta_path_appends_the_suffix(tmp_path: Path) -> None:
    assert ckpt_store.meta_path(tmp_path / "step=00000001.ckpt") == tmp_path / "step=00000001.ckpt.meta.json"
    assert ckpt_store.meta_path("a/b") == Path("a/b.meta.json")


# ------------------------------------------------------------------------------------------------ atomic writes
def test_atomic_write_returns_size_and_sha256_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "x.bin"  # its folder is made
    assert ckpt_store.atomic_write(path, lambda f: f.write(b"abc")) == (3, ABC_SHA256)
    assert path.read_bytes() == b"abc"
    assert ckpt_store.atomic_write(path, lambda f: None) == (0, EMPTY_SHA256)  # replaced whole
    assert path.read_bytes() == b"" and os.listdir(path.parent) == ["x.bin"]


def test_a_failed_write_keeps_the_previous_file_and_removes_its_temporary(tmp_path: Path) -> None:
    path = tmp_path / "x.bin"
    path.write_bytes(b"old")

    def fail(f) -> None:
        f.write(b"partial")
        raise RuntimeError("the writer broke")

    with pytest.raises(RuntimeError, match="the writer broke"):
        ckpt_store.atomic_write(path, fail)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["x.bin"]


def test_the_files_oserror_comes_back_when_the_writer_turns_it_into_another_error(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    monkeypatch.setattr(ckpt_store, "open", lambda path, mode: open("/dev/full", mode, buffering=0), raising=False)
    counted = []

    def torch_like(f) -> None:  # torch.save catches the file's error and raises its own
        try:
            f.write(b"abc")
        except OSError as err:
            counted.append((f.size, f.sha.hexdigest()))
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos") from err

    with pytest.raises(OSError) as raised:
        ckpt_store.atomic_write(tmp_path / "x.bin", torch_like)
    assert raised.value.errno == 28 and isinstance(raised.value.__cause__, RuntimeError)  # ENOSPC, not torch's
    assert counted == [(3, ABC_SHA256)]
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------------------------ records
def test_a_files_record_holds_step_epoch_size_sha256_time_and_extra(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "step=00000007.ckpt"
    path.write_bytes(b"abc")
    monkeypatch.setattr(time, "time", lambda: 1234.5)
    record = ckpt_store.write_record(path, 7, 1, extra={"mlflow_run_id": "r1"})
    assert json.loads(ckpt_store.meta_path(path).read_text()) == {
        "global_step": 7, "epoch": 1, "size": 3, "sha256": ABC_SHA256, "saved_at": 1234.5,
        "extra": {"mlflow_run_id": "r1"}}
    assert record == ckpt_store.CheckpointRecord(path=path, global_step=7, epoch=1, size=3, sha256=ABC_SHA256,
                                                 saved_at=1234.5, extra={"mlflow_run_id": "r1"}, files=None)


def test_a_measured_size_and_sha256_are_written_as_given(tmp_path: Path) -> None:
    path = tmp_path / "x.ckpt"
    path.write_bytes(b"abc")
    record = ckpt_store.write_record(path, 1, 0, size=3, sha256="0" * 64)
    assert (record.size, record.sha256) == (3, "0" * 64)  # not recomputed: the writer measured them


def test_a_directorys_record_lists_every_file_with_its_size_and_sha256(tmp_path: Path) -> None:
    shards = tmp_path / "step=00000003"
    (shards / "sub").mkdir(parents=True)
    (shards / "a.distcp").write_bytes(b"abc")
    (shards / "sub" / ".metadata").write_bytes(b"")
    record = ckpt_store.write_record(shards, 3, 0)
    assert record.files == ckpt_store.file_digests(shards) == {
        "a.distcp": {"size": 3, "sha256": ABC_SHA256}, "sub/.metadata": {"size": 0, "sha256": EMPTY_SHA256}}
    assert (record.size, record.sha256) == (3, None)
    assert ckpt_store.read_record(shards, verify_hash=False) == record


def test_file_sha256_reads_in_chunks(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ckpt_store, "_CHUNK", 2)
    (tmp_path / "f").write_bytes(b"abc")
    assert ckpt_store.file_sha256(tmp_path / "f") == ABC_SHA256


def test_read_record_gives_back_what_was_written(tmp_path: Path) -> None:
    path = _ckpt(tmp_path, 20)
    written = json.loads(ckpt_store.meta_path(path).read_text())
    record = ckpt_store.read_record(path)
    assert record is not None
    assert (record.global_step, record.epoch, record.size, record.sha256, record.saved_at) == (
        20, 2, path.stat().st_size, ckpt_store.file_sha256(path), written["saved_at"])


@pytest.mark.parametrize(("damage", "warning"), [
    ("no record", "Checkpoint {path} has no integrity record (an interrupted save?); skipping it."),
    ("no checkpoint", "Checkpoint {path} named by {meta} is missing; skipping it."),
    ("truncated", "Checkpoint {path} is truncated or changed ({size} bytes, record says {recorded}); skipping it."),
    ("same size, other bytes", "Checkpoint {path} fails its SHA-256 check (corrupt); skipping it."),
])
def test_a_checkpoint_its_record_does_not_vouch_for_is_skipped_with_a_warning(tmp_path: Path, caplog, damage: str,
                                                                              warning: str) -> None:
    path = _ckpt(tmp_path, 5)
    recorded = path.stat().st_size
    data = path.read_bytes()
    if damage == "no record":
        ckpt_store.meta_path(path).unlink()
    elif damage == "no checkpoint":
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(data[:-10])
    else:
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with caplog.at_level(logging.WARNING, logger=ckpt_store.__name__):
        assert ckpt_store.read_record(path) is None
    assert caplog.messages == [warning.format(path=path, meta=ckpt_store.meta_path(path), size=recorded - 10,
                                              recorded=recorded)]


def test_sizes_only_skips_the_sha256_and_the_safe_load(tmp_path: Path) -> None:
    path = _ckpt(tmp_path, 5)
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    record = ckpt_store.read_record(path, verify_hash=False)
    assert record is not None and record.global_step == 5


def test_an_unreadable_record_is_skipped(tmp_path: Path, caplog) -> None:
    path = _ckpt(tmp_path, 5)
    ckpt_store.meta_path(path).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger=ckpt_store.__name__):
        assert ckpt_store.read_record(path) is None
    (message,) = caplog.messages
    assert message.startswith(f"Checkpoint record {ckpt_store.meta_path(path)} is unreadable (") and \
        message.endswith(f"); skipping {path}.")


# ------------------------------------------------------------------------------------------------------ lookups
def test_candidates_are_ordered_by_step_then_record_time_unreadable_last(tmp_path: Path) -> None:
    a = _ckpt(tmp_path, 10, saved_at=5.0)
    b = _ckpt(tmp_path, 30, saved_at=1.0)
    c = tmp_path / "step=00000020.ckpt"
    c.write_bytes(b"x")
    ckpt_store.meta_path(c).write_text("garbage")
    d = tmp_path / "step=00000030-validated.ckpt"  # the same step, written later
    d.write_bytes(b"x")
    ckpt_store.write_record(d, 30, 3)
    ckpt_store.meta_path(d).write_text(json.dumps({**json.loads(ckpt_store.meta_path(d).read_text()),
                                                   "saved_at": 2.0}))
    (tmp_path / "other.ckpt").write_bytes(b"no record")
    assert ckpt_store.candidates(tmp_path, "step=*.ckpt") == [d, b, a, c]
    assert ckpt_store.candidates(tmp_path / "missing") == []


def test_newest_good_skips_the_newest_when_it_fails(tmp_path: Path) -> None:
    _ckpt(tmp_path, 10)
    newest = _ckpt(tmp_path, 20)
    newest.write_bytes(newest.read_bytes()[:-1])
    record = ckpt_store.newest_good(tmp_path, "step=*.ckpt")
    assert record is not None and record.global_step == 10
    assert ckpt_store.newest_good(tmp_path / "empty") is None


def test_remove_deletes_the_record_and_the_checkpoint_file_or_directory(tmp_path: Path) -> None:
    path = _ckpt(tmp_path, 1)
    shards = tmp_path / "step=00000002"
    shards.mkdir()
    (shards / "a.distcp").write_bytes(b"abc")
    ckpt_store.write_record(shards, 2, 0)
    ckpt_store.remove(path)
    ckpt_store.remove(shards)
    ckpt_store.remove(tmp_path / "never-there.ckpt")
    assert os.listdir(tmp_path) == []


def test_verified_record_hashes_again_only_after_the_files_changed(tmp_path: Path, monkeypatch) -> None:
    path = _ckpt(tmp_path, 1)
    calls: list[bool] = []
    read = ckpt_store.read_record
    monkeypatch.setattr(ckpt_store, "read_record", lambda p, verify_hash=True: calls.append(verify_hash) or read(
        p, verify_hash))
    monkeypatch.setattr(ckpt_store, "_verified", {})
    assert ckpt_store.verified_record(path) is not None
    assert ckpt_store.verified_record(path) is not None
    os.utime(path)  # a touch changes its ctime
    assert ckpt_store.verified_record(path) is not None
    assert calls == [True, False, True]


# ------------------------------------------------------------------------------------------------------ pruning
def test_prune_keeps_the_newest_good_and_deletes_older_ones_and_stale_debris(tmp_path: Path) -> None:
    paths = [_ckpt(tmp_path, step) for step in (10, 20, 30)]
    debris = tmp_path / ".step=00000040.ckpt.tmp-123"  # a writer killed mid-save, before the newest kept one
    unrecorded = tmp_path / "step=00000025.ckpt"  # an interrupted save, never published
    for stale in (debris, unrecorded):
        stale.write_bytes(b"half")
        os.utime(stale, (1.0, 1.0))
    later = tmp_path / "step=00000050.ckpt"  # written after the newest kept one: may await its record
    later.write_bytes(b"pending")
    os.utime(later, (time.time() + 60, time.time() + 60))
    removed = ckpt_store.prune(tmp_path, "step=*.ckpt", keep=2)
    assert sorted(removed) == sorted([paths[0], debris, unrecorded])
    assert sorted(os.listdir(tmp_path)) == sorted([
        "step=00000020.ckpt", "step=00000020.ckpt.meta.json", "step=00000030.ckpt", "step=00000030.ckpt.meta.json",
        "step=00000050.ckpt"])


def test_prune_with_nothing_good_deletes_nothing(tmp_path: Path) -> None:
    bad = _ckpt(tmp_path, 10)
    bad.write_bytes(bad.read_bytes()[:-1])
    (tmp_path / ".step=00000011.ckpt.tmp-9").write_bytes(b"half")
    assert ckpt_store.prune(tmp_path, "step=*.ckpt", keep=1) == []
    assert len(os.listdir(tmp_path)) == 3
