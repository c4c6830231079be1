"""The verified local copy as several readers share it: one fetch per file, the budget, and no file left half-made."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from datamodules.verified_chunks import DataDamaged, VerifiedFiles

FILES = {f"chunk-0-{k}.bin": bytes([k]) * 1000 for k in range(6)}


class SlowStore:
    """A bucket whose GETs take ``delay`` seconds and are counted."""

    def __init__(self, delay: float = 0.0, files: dict[str, bytes] = FILES) -> None:
        self.delay, self.files, self.gets = delay, files, []
        self.lock = threading.Lock()

    def cat_file(self, path: str) -> bytes:
        with self.lock:
            self.gets.append(path.rsplit("/", 1)[1])
        time.sleep(self.delay)
        return self.files[path.rsplit("/", 1)[1]]


def _copy(tmp_path: Path, store: SlowStore, budget: int = 1 << 40) -> VerifiedFiles:
    expected = {name: hashlib.sha256(data).hexdigest() for name, data in FILES.items()}
    files = VerifiedFiles("s3://bucket/data/train", expected, str(tmp_path / "cache"), budget)
    files._fs_and_root = lambda: (store, "bucket/data/train")  # the store above, not a network
    return files


def test_readers_of_one_missing_file_share_its_fetch(tmp_path: Path) -> None:
    store = SlowStore(delay=0.3)
    files = _copy(tmp_path, store)
    got: list[bytes] = []
    readers = [threading.Thread(target=lambda: got.append(files.read("chunk-0-1.bin"))) for _ in range(4)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    assert got == [FILES["chunk-0-1.bin"]] * 4
    assert store.gets == ["chunk-0-1.bin"]  # one GET; the others waited for it and read the copy
    assert files.read("chunk-0-1.bin") == FILES["chunk-0-1.bin"] and store.gets == ["chunk-0-1.bin"]


def test_a_copy_that_rotted_is_fetched_again_and_a_bad_fetch_never_lands(tmp_path: Path) -> None:
    store = SlowStore()
    files = _copy(tmp_path, store)
    files.read("chunk-0-2.bin")
    local = files.local_dir / "chunk-0-2.bin"
    local.write_bytes(b"\0" * 1000)  # the disk rotted: hashed at the next read, fetched again
    assert files.read("chunk-0-2.bin") == FILES["chunk-0-2.bin"] and store.gets.count("chunk-0-2.bin") == 2
    store.files = {**FILES, "chunk-0-3.bin": b"x" * 1000}  # the bucket's copy is damaged
    with pytest.raises(DataDamaged, match=r"chunk-0-3.bin: SHA-256 [0-9a-f]{12} \(1000 bytes\), not the prepared"):
        files.read("chunk-0-3.bin")
    assert not (files.local_dir / "chunk-0-3.bin").exists()
    assert not list(files.local_dir.glob("*.part"))


def test_the_budget_deletes_the_oldest_never_a_file_about_to_be_read(tmp_path: Path) -> None:
    files = _copy(tmp_path, SlowStore(), budget=3000)  # three files of 1000 bytes
    for k in range(3):
        files.read(f"chunk-0-{k}.bin")
        os.utime(files.local_dir / f"chunk-0-{k}.bin", (k, k))  # oldest first: 0, 1, 2
    files.keep({"chunk-0-0.bin"})
    files.read("chunk-0-3.bin")  # over budget: chunk 1 goes (chunk 0 is kept, though older)
    assert sorted(p.name for p in files.local_dir.glob("*.bin")) == ["chunk-0-0.bin", "chunk-0-2.bin",
                                                                     "chunk-0-3.bin"]
    assert not (files.local_dir / ".chunk-0-1.bin.lock").exists()  # its lock goes with it


def test_a_dead_fetchs_partial_file_is_removed_at_the_next_start_a_live_ones_kept(tmp_path: Path) -> None:
    files = _copy(tmp_path, SlowStore())
    files.read("chunk-0-0.bin")
    dead = subprocess_pid_that_exited()
    stale = files.local_dir / f".chunk-0-1.bin.{dead}.abc123.part"
    live = files.local_dir / f".chunk-0-2.bin.{os.getpid()}.def456.part"
    stale.write_bytes(b"half")
    live.write_bytes(b"half")
    _copy(tmp_path, SlowStore())  # the next reader of this copy (a relaunch)
    assert not stale.exists() and live.exists()


def subprocess_pid_that_exited() -> int:
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    return int(child.stdout)
