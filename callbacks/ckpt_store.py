"""Crash-safe checkpoint files: atomic publication, integrity records, newest-good lookup, pruning.

A checkpoint ``X`` (a file, or a directory of distributed shards) counts as good only once its
record ``X.meta.json`` exists and the bytes on disk still match it (size, and SHA-256 for a
file). The record is written atomically *after* the checkpoint is complete, so a writer killed
at any moment leaves either a good checkpoint or one that lookups skip: nothing ever replaces a
good checkpoint in place, because every save gets a fresh name.

No Lightning import: the spot callback and the checkpoint IO share this module, and the CLI uses
it to find what to resume from.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

META_SUFFIX = ".meta.json"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class CheckpointRecord:
    """What a checkpoint's ``.meta.json`` says about it."""

    path: Path
    global_step: int
    epoch: int
    size: int
    sha256: str | None
    saved_at: float
    extra: dict[str, Any]


def meta_path(path: str | os.PathLike) -> Path:
    """The integrity record of checkpoint ``path``."""
    return Path(f"{os.fspath(path)}{META_SUFFIX}")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through it."""

    def __init__(self, handle: IO[bytes]) -> None:
        self._handle = handle
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self._handle.write(data)

    def flush(self) -> None:
        self._handle.flush()


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None]) -> tuple[int, str]:
    """Write a file through ``write(file_object)`` so that ``path`` appears complete or not at all.

    The bytes go to a temporary sibling, are fsynced, then renamed over ``path``; a failure
    (ENOSPC, a kill) leaves any previous ``path`` untouched and removes the temporary file.

    Returns:
        ``(size, sha256 hex digest)`` of what was written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            writer = _HashingWriter(handle)
            write(writer)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return writer.size, writer.sha.hexdigest()


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_record(
    path: str | os.PathLike,
    global_step: int,
    epoch: int,
    size: int | None = None,
    sha256: str | None = None,
    extra: dict[str, Any] | None = None,
) -> CheckpointRecord:
    """Publish checkpoint ``path`` as good by writing its record (atomically, last).

    For a file, pass the ``size``/``sha256`` measured while writing (or they are computed);
    for a directory of shards, the record holds the total size only.
    """
    path = Path(path)
    if path.is_dir():
        size, sha256 = _dir_size(path), None
    elif size is None or sha256 is None:
        size, sha256 = path.stat().st_size, file_sha256(path)
    record = {
        "global_step": int(global_step),
        "epoch": int(epoch),
        "size": int(size),
        "sha256": sha256,
        "saved_at": time.time(),
        "extra": extra or {},
    }
    payload = json.dumps(record, indent=1).encode()
    atomic_write(meta_path(path), lambda f: f.write(payload))
    return CheckpointRecord(path=path, **{k: record[k] for k in ("global_step", "epoch", "size", "sha256")},
                            saved_at=record["saved_at"], extra=record["extra"])


def read_record(path: str | os.PathLike, verify_hash: bool = True) -> CheckpointRecord | None:
    """The record of ``path`` if the checkpoint on disk matches it, else ``None`` (with a warning)."""
    path = Path(path)
    meta = meta_path(path)
    try:
        data = json.loads(meta.read_text())
    except FileNotFoundError:
        log.warning("Checkpoint %s has no integrity record (an interrupted save?); skipping it.", path)
        return None
    except (OSError, ValueError) as err:
        log.warning("Checkpoint record %s is unreadable (%s); skipping %s.", meta, err, path)
        return None
    if not path.exists():
        log.warning("Checkpoint %s named by %s is missing; skipping it.", path, meta)
        return None
    size = _dir_size(path) if path.is_dir() else path.stat().st_size
    if size != data["size"]:
        log.warning("Checkpoint %s is truncated or changed (%d bytes, record says %d); skipping it.",
                    path, size, data["size"])
        return None
    if verify_hash and data.get("sha256") and file_sha256(path) != data["sha256"]:
        log.warning("Checkpoint %s fails its SHA-256 check (corrupt); skipping it.", path)
        return None
    return CheckpointRecord(
        path=path,
        global_step=int(data["global_step"]),
        epoch=int(data["epoch"]),
        size=int(data["size"]),
        sha256=data.get("sha256"),
        saved_at=float(data["saved_at"]),
        extra=dict(data.get("extra") or {}),
    )


def candidates(directory: str | os.PathLike, pattern: str = "*") -> list[Path]:
    """Checkpoints in ``directory`` that have a record, newest record first (unverified)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for meta in directory.glob(pattern + META_SUFFIX):
        try:
            data = json.loads(meta.read_text())
            key = (int(data["global_step"]), float(data["saved_at"]))
        except (OSError, ValueError, KeyError):
            key = (-1, 0.0)
        found.append((key, Path(os.fspath(meta)[: -len(META_SUFFIX)])))
    return [p for _, p in sorted(found, key=lambda kv: kv[0], reverse=True)]


def newest_good(directory: str | os.PathLike, pattern: str = "*") -> CheckpointRecord | None:
    """The newest checkpoint in ``directory`` (by global step, then save time) that verifies."""
    for path in candidates(directory, pattern):
        record = read_record(path)
        if record is not None:
            return record
    return None


def remove(path: str | os.PathLike) -> None:
    """Delete a checkpoint and its record (the record first, so a half-deleted one is never good)."""
    path = Path(path)
    meta_path(path).unlink(missing_ok=True)
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def prune(directory: str | os.PathLike, pattern: str, keep: int) -> list[Path]:
    """Keep the ``keep`` newest good checkpoints matching ``pattern``; delete older ones and debris.

    Debris is a checkpoint of the pattern without a record that is older than the newest good one
    (an interrupted save). Returns what was deleted.
    """
    directory = Path(directory)
    good = [p for p in candidates(directory, pattern) if read_record(p, verify_hash=False) is not None]
    removed = []
    for path in good[keep:]:
        remove(path)
        removed.append(path)
    if not good:
        return removed
    try:
        newest_time = meta_path(good[0]).stat().st_mtime
    except FileNotFoundError:  # pruned concurrently by another process
        return removed
    debris = [p for p in directory.glob(pattern) if not p.name.endswith(META_SUFFIX)]
    debris += list(directory.glob(".*.tmp-*"))  # files of writers killed mid-save
    for path in debris:
        try:
            stale = not meta_path(path).exists() and path.stat().st_mtime < newest_time
        except FileNotFoundError:  # published or removed meanwhile
            continue
        if stale:
            remove(path)
            removed.append(path)
    return removed
