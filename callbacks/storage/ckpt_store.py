"""Crash-safe checkpoint files: atomic publication, integrity records, newest-good lookup, pruning.

A checkpoint ``X`` (a file, or a directory of distributed shards) counts as good only once its
record ``X.meta.json`` exists and the bytes on disk still match it (size and SHA-256 of the file,
or of every file of the directory), and it loads without running code (``safe_load``: a forged
checkpoint whose record was recomputed is skipped too). The record is written atomically *after*
the checkpoint is complete, so a writer killed at any moment leaves either a good checkpoint or one
that lookups skip: nothing ever replaces a good checkpoint in place, because every save gets a fresh name.

No Lightning import, and torch only when a checkpoint is verified: the spot callback and the
checkpoint IO share this module, the CLI uses it to find what to resume from, and the planning
tools read records through it.
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
    #: For a directory: ``{relative path: {"size", "sha256"}}`` of every file (``None`` in records of older code).
    files: dict[str, dict[str, Any]] | None = None


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
    """A write-only file object that hashes and counts what passes through it.

    It keeps the ``OSError`` a write raised (ENOSPC, EDQUOT, EIO): torch's zip writer catches it and
    raises ``RuntimeError: [enforce fail at inline_container.cc] ... unexpected pos`` instead, which
    would lose the errno.
    """

    def __init__(self, handle: IO[bytes]) -> None:
        self._handle = handle
        self.sha = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        try:
            return self._handle.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self._handle.flush()


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None]) -> tuple[int, str]:
    """Write a file through ``write(file_object)`` so that ``path`` appears complete or not at all.

    The bytes go to a temporary sibling, are fsynced, then renamed over ``path``; a failure
    (ENOSPC, a kill) leaves any previous ``path`` untouched and removes the temporary file.

    Returns:
        ``(size, sha256 hex digest)`` of what was written.

    Raises:
        OSError: the write failed; if ``write`` turned the file's ``OSError`` into another exception
            (torch.save raises ``RuntimeError``), the original ``OSError`` is raised, chained to it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            writer = _HashingWriter(handle)
            try:
                write(writer)
            except Exception as err:
                if writer.error is not None and err is not writer.error:
                    raise writer.error from err
                raise
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return writer.size, writer.sha.hexdigest()


def _dir_files(path: Path) -> list[Path]:
    return sorted(f for f in path.rglob("*") if f.is_file())


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in _dir_files(path))


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_digests(directory: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size", "sha256"}}`` of every file under ``directory`` (a distributed checkpoint)."""
    return {f.relative_to(directory).as_posix(): {"size": f.stat().st_size, "sha256": file_sha256(f)}
            for f in _dir_files(directory)}


def rejection(path: str | os.PathLike) -> str | None:
    """Why checkpoint ``path`` cannot be loaded without running code it may hold (``safe_load``), or ``None``.

    Imports torch: only callers that verify a checkpoint pay for it.
    """
    from . import safe_load

    return safe_load.rejection(path)


def write_record(
    path: str | os.PathLike,
    global_step: int,
    epoch: int,
    size: int | None = None,
    sha256: str | None = None,
    extra: dict[str, Any] | None = None,
    files: dict[str, dict[str, Any]] | None = None,
) -> CheckpointRecord:
    """Publish checkpoint ``path`` as good by writing its record (atomically, last).

    For a file, pass the ``size``/``sha256`` measured while writing (or they are computed). For a
    directory of shards, the record holds the size and SHA-256 of every file: pass ``files`` when
    they were just verified (a download), or they are computed.
    """
    path = Path(path)
    if path.is_dir():
        files = file_digests(path) if files is None else files
        size, sha256 = sum(int(f["size"]) for f in files.values()), None
    else:
        files = None
        if size is None or sha256 is None:
            size, sha256 = path.stat().st_size, file_sha256(path)
    record = {
        "global_step": int(global_step),
        "epoch": int(epoch),
        "size": int(size),
        "sha256": sha256,
        "saved_at": time.time(),
        "extra": extra or {},
    }
    if files is not None:
        record["files"] = files
    payload = json.dumps(record, indent=1).encode()
    atomic_write(meta_path(path), lambda f: f.write(payload))
    return CheckpointRecord(path=path, **{k: record[k] for k in ("global_step", "epoch", "size", "sha256")},
                            saved_at=record["saved_at"], extra=record["extra"], files=files)


def _files_match(path: Path, files: Any, verify_hash: bool) -> bool:
    """Whether a directory holds exactly the files its record lists, with their sizes (and SHA-256s)."""
    if not isinstance(files, dict) or not all(
            isinstance(f, dict) and isinstance(f.get("size"), int) and isinstance(f.get("sha256"), str)
            for f in files.values()):
        log.warning("Checkpoint record %s lists its files wrongly; skipping %s.", meta_path(path), path)
        return False
    on_disk = {f.relative_to(path).as_posix(): f for f in _dir_files(path)}
    if on_disk.keys() != files.keys():
        missing, unexpected = sorted(files.keys() - on_disk.keys()), sorted(on_disk.keys() - files.keys())
        log.warning("Checkpoint %s does not hold the files its record lists (missing: %s; unexpected: %s); "
                    "skipping it.", path, ", ".join(missing) or "none", ", ".join(unexpected) or "none")
        return False
    for rel, want in files.items():
        size = on_disk[rel].stat().st_size
        if size != want["size"]:
            log.warning("Checkpoint %s is truncated or changed (%s: %d bytes, record says %d); skipping it.",
                        path, rel, size, want["size"])
            return False
    if verify_hash:
        for rel, want in files.items():
            if file_sha256(on_disk[rel]) != want["sha256"]:
                log.warning("Checkpoint %s fails its SHA-256 check on %s (corrupt or changed); skipping it.",
                            path, rel)
                return False
    return True


def read_record(path: str | os.PathLike, verify_hash: bool = True) -> CheckpointRecord | None:
    """The record of ``path`` if the checkpoint on disk matches it and loads safely, else ``None`` (with a warning).

    Args:
        verify_hash: verify fully before a load: the SHA-256 of every byte, and that the checkpoint
            loads without running code (``safe_load``: a ``.ckpt``'s pickle parsed weights-only with its
            tensors memory-mapped; a directory's ``.metadata`` through the allow-list unpickler, and
            every non-tensor item of its shards). ``False``: sizes only, for bookkeeping that loads
            nothing (pruning, uploading, planning), and no torch import.
    """
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
    files = data.get("files")
    if path.is_dir() and files is not None:  # records of older code hold the total size only
        if not _files_match(path, files, verify_hash):
            return None
    elif verify_hash and data.get("sha256") and file_sha256(path) != data["sha256"]:
        log.warning("Checkpoint %s fails its SHA-256 check (corrupt); skipping it.", path)
        return None
    if verify_hash and (why := rejection(path)) is not None:
        # A record proves only that nothing changed since it was written: a forged checkpoint with a
        # recomputed record, or an older size-only record of an edited directory, is caught here.
        # This is also how the training resume reads a distributed checkpoint's .metadata safely:
        # Lightning's ModelParallelStrategy loads it with torch's plain-pickle reader through private
        # helpers that take no reader, so rather than copy or patch them, every candidate is unpickled
        # here through safe_load's allow-lists right before the CLI hands it to Lightning (checked
        # bytes = recorded bytes, by the per-file SHA-256 just above).
        log.warning("Checkpoint %s cannot be loaded safely (%s); skipping it.", path, why)
        return None
    return CheckpointRecord(
        path=path,
        global_step=int(data["global_step"]),
        epoch=int(data["epoch"]),
        size=int(data["size"]),
        sha256=data.get("sha256"),
        saved_at=float(data["saved_at"]),
        extra=dict(data.get("extra") or {}),
        files=files if path.is_dir() and isinstance(files, dict) else None,
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
    """The newest checkpoint in ``directory`` (by global step, then save time) that verifies and loads safely.

    A checkpoint that fails (changed, corrupt, or holding code) is skipped with a warning naming it
    and why, and the next older one is tried.
    """
    for path in candidates(directory, pattern):
        record = read_record(path)
        if record is not None:
            return record
    return None


def remove(path: str | os.PathLike) -> None:
    """Delete a checkpoint and its record (the record first, so a half-deleted one is never good)."""
    path = Path(path)
    _verified.pop(path, None)
    meta_path(path).unlink(missing_ok=True)
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


#: ``{path: (stat of the checkpoint's files and record)}`` of checkpoints this process verified fully: a
#: prune re-verifies only what changed since (a write, or ``touch``, changes ``st_ctime_ns``).
_verified: dict[Path, tuple[Any, ...]] = {}


def _stat_key(path: Path) -> tuple[Any, ...]:
    files = _dir_files(path) if path.is_dir() else [path]
    return tuple((f.as_posix(), s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)
                 for f in [*files, meta_path(path)] for s in [f.stat()])


def verified_record(path: str | os.PathLike) -> CheckpointRecord | None:
    """:func:`read_record` with full verification, remembered while the files stay as they were."""
    path = Path(path)
    try:
        key = _stat_key(path)
    except OSError:
        return read_record(path)  # missing or unreadable: read_record says which
    record = read_record(path, verify_hash=_verified.get(path) != key)
    if record is None:
        _verified.pop(path, None)
    else:
        _verified[path] = key
    return record


def prune(directory: str | os.PathLike, pattern: str, keep: int) -> list[Path]:
    """Keep the ``keep`` newest checkpoints matching ``pattern`` that verify; delete older ones and debris.

    A checkpoint counts as one of the ``keep`` only if it verifies fully (SHA-256 and a safe load, see
    :func:`read_record`): a forged or same-size-corrupt newest one is not counted, so the good ones
    behind it stay. Such a checkpoint is left in place (lookups skip it with a warning) for a person
    to inspect. Debris is a checkpoint of the pattern without a record that was written before the newest
    kept one (an interrupted save). Returns what was deleted.
    """
    directory = Path(directory)
    good: list[Path] = []
    removed = []
    for path in candidates(directory, pattern):
        if len(good) >= keep:  # beyond the kept ones: deleted, verified or not (nothing will load them)
            if read_record(path, verify_hash=False) is not None:
                remove(path)
                removed.append(path)
            continue
        if verified_record(path) is not None:
            good.append(path)
    if not good:
        return removed
    try:
        # the newest kept checkpoint's own time, not its record's: a save written after it may still await its
        # record (a publish gate holds it until its metrics are durable), and must not be taken for debris
        newest_time = good[0].stat().st_mtime
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
