"""Pruning keeps ``keep`` checkpoints that verify: a forged or same-size-corrupt newest one is not counted."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from callbacks.checkpoint_io import AtomicCheckpointIO
from callbacks.storage import ckpt_store

PATTERN = "step=*.ckpt"


def _save(directory: Path, step: int) -> Path:
    path = directory / f"step={step:08d}.ckpt"
    AtomicCheckpointIO().save_checkpoint({"w": torch.arange(100) * step, "global_step": step, "epoch": 0}, path)
    return path


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def test_a_same_size_corrupt_newest_checkpoint_is_not_counted(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step)
    newest = tmp_path / "step=00000003.ckpt"
    size = newest.stat().st_size
    newest.write_bytes(b"\0" * size)  # same size, record untouched: only the SHA-256 tells
    removed = ckpt_store.prune(tmp_path, PATTERN, keep=2)
    assert removed == []
    assert sorted(p.name for p in tmp_path.glob(PATTERN)) == [
        "step=00000001.ckpt", "step=00000002.ckpt", "step=00000003.ckpt"]
    record = ckpt_store.newest_good(tmp_path)
    assert record is not None and record.global_step == 2


def test_a_forged_newest_checkpoint_with_a_recomputed_record_is_not_counted(tmp_path: Path) -> None:
    marker = tmp_path.parent / f"{tmp_path.name}-pwned"
    for step in (1, 2, 3):
        _save(tmp_path, step)
    forged = tmp_path / "step=00000004.ckpt"
    torch.save({"global_step": 4, "x": _Payload(marker)}, forged)
    ckpt_store.write_record(forged, 4, 0)  # its record recomputed: sizes and hash match
    removed = ckpt_store.prune(tmp_path, PATTERN, keep=2)
    assert not marker.exists()
    assert [p.name for p in removed] == ["step=00000001.ckpt"]
    assert [p.name for p in ckpt_store.candidates(tmp_path)] == [
        "step=00000004.ckpt", "step=00000003.ckpt", "step=00000002.ckpt"]
    assert [ckpt_store.read_record(p) is not None for p in ckpt_store.candidates(tmp_path)] == [False, True, True]


def test_a_checkpoint_changed_after_it_was_verified_is_verified_again(tmp_path: Path) -> None:
    for step in (1, 2):
        _save(tmp_path, step)
    assert ckpt_store.prune(tmp_path, PATTERN, keep=1) == [tmp_path / "step=00000001.ckpt"]
    _save(tmp_path, 1)  # an older one back, then the verified newest corrupted in place, same size
    newest = tmp_path / "step=00000002.ckpt"
    newest.write_bytes(b"\0" * newest.stat().st_size)
    assert ckpt_store.prune(tmp_path, PATTERN, keep=1) == []
    assert sorted(p.name for p in tmp_path.glob(PATTERN)) == ["step=00000001.ckpt", "step=00000002.ckpt"]


def test_a_save_awaiting_its_record_is_not_debris_even_if_an_older_record_came_later(tmp_path: Path) -> None:
    """A publish gate can write step 2's record after step 3's file: step 3 is pending, not a killed save."""
    _save(tmp_path, 1)
    older = tmp_path / "step=00000002.ckpt"
    torch.save({"w": torch.zeros(3), "global_step": 2, "epoch": 0}, older)
    pending = tmp_path / "step=00000003.ckpt"
    torch.save({"w": torch.ones(3), "global_step": 3, "epoch": 0}, pending)  # written, its record not yet
    os.utime(older, (1_000, 1_000))
    os.utime(pending, (2_000, 2_000))
    ckpt_store.write_record(older, 2, 0)  # step 2 published now, after step 3 was written
    ckpt_store.prune(tmp_path, PATTERN, keep=2)
    assert pending.exists()
    killed = tmp_path / "step=00000000.ckpt"  # a save cut short before the newest kept one was written
    torch.save({"global_step": 0}, killed)
    os.utime(killed, (500, 500))
    ckpt_store.prune(tmp_path, PATTERN, keep=2)
    assert not killed.exists() and pending.exists()
