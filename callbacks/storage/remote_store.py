"""Checkpoints in object storage (S3, GCS, Azure Blob, any fsspec URL) that a new machine can resume from.

A spot relaunch usually lands on another machine whose disk never saw the old checkpoints, so a
run mirrors its local checkpoints (written by ``ckpt_store``'s atomic scheme) to a remote
directory. Object stores have no rename; publication is made safe by *order* instead:

1. the checkpoint's objects (one file, or every shard of a distributed checkpoint);
2. its record ``X.meta.json`` (step, epoch, run metadata, size and SHA-256 of every object);
3. the directory's ``latest.json`` pointer naming ``X``, with the same sizes and checksums.

A writer killed at any moment leaves the previous pointer and records intact. A reader starts
from the pointer, downloads the checkpoint it names, verifies every object and that it loads
without running code (``safe_load``: a forged object with a forged record has matching checksums),
and falls back to the newest older record that verifies: a half-uploaded or forged checkpoint is
skipped with a warning, and never published locally.

fsspec and its backends (s3fs, gcsfs, adlfs) do the transfers; what is written here is the
publication order and the verification, which none of them provides. No Lightning import: the
checkpoint IO, the spot callback and the CLI share this module.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import fsspec
import fsspec.callbacks
from filelock import FileLock
from fsspec.utils import get_protocol

from . import ckpt_store

log = logging.getLogger(__name__)

POINTER_NAME = "latest.json"
_LOCAL_PROTOCOLS = ("file", "local")
#: Which optional extra provides each protocol's fsspec backend.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}


class StoreError(Exception):
    """A remote location that cannot be used, said in one line that names the URL."""


def is_remote(location: str | os.PathLike) -> bool:
    """Whether ``location`` is an fsspec URL of a non-local filesystem (``s3://``, ``gs://``, ``az://``...)."""
    return get_protocol(os.fspath(location)) not in _LOCAL_PROTOCOLS


def local_path(location: str | os.PathLike) -> Path:
    """A local location as a path (``file://`` URLs included)."""
    text = os.fspath(location)
    return Path(text[len("file://"):] if text.startswith("file://") else text)


def join(url: str, *parts: str) -> str:
    """``url/part/part`` without doubled slashes."""
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts)])


def _quiet_abandoned_transfers(loop: Any, context: dict[str, Any]) -> None:
    """fsspec's event loop exception handler: drop the connection errors of transfers already reported failed.

    When a connection is reset mid-request, aiohttp leaves its body-writing task's error unretrieved, and
    asyncio prints "Task exception was never retrieved" with a traceback on stderr, in the middle of a run
    whose failed upload is already logged in one line. Anything else goes to asyncio's default handler.
    """
    if isinstance(context.get("exception"), ConnectionError) and "never retrieved" in context.get("message", ""):
        log.debug("%s: %r", context["message"], context["exception"])
        return
    loop.default_exception_handler(context)


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem serving ``url`` and the path within it; a missing backend is a ``StoreError``."""
    try:
        fs, path = fsspec.core.url_to_fs(url)
        if getattr(fs, "asynchronous", None) is False and getattr(fs, "loop", None) is not None:
            fs.loop.set_exception_handler(_quiet_abandoned_transfers)
        return fs, path
    except ImportError as err:
        protocol = get_protocol(url)
        extra = _EXTRAS.get(protocol)
        hint = f"pip install 'atscale[{extra}]'" if extra else "install its fsspec backend"
        raise StoreError(f"{url}: no filesystem for {protocol}:// is installed ({hint})") from err
    except ValueError as err:  # unknown protocol
        raise StoreError(f"{url}: {err}") from err


def _describe(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0][:300]


@contextlib.contextmanager
def _answered(url: str) -> Iterator[None]:
    """Turn a backend's own error for an unreachable store (botocore's EndpointConnectionError, aiohttp's...)
    into a one-line ``StoreError`` naming ``url``; OSErrors (s3fs's translation of S3 errors) pass unchanged."""
    try:
        yield
    except (OSError, StoreError):
        raise
    except Exception as err:
        raise StoreError(f"{url}: the object store did not answer ({type(err).__name__}: {_describe(err)})") from err


def check_writable(url: str) -> None:
    """Fail early, naming ``url``, when it cannot take a run's files (no bucket, bad credentials, no network).

    Writes and deletes a small probe object: listing alone would pass with read-only credentials.
    """
    fs, root = filesystem(url)
    probe = f"{root.rstrip('/')}/.atscale-probe-{secrets.token_hex(4)}"
    try:
        fs.pipe_file(probe, b"probe")
        fs.rm_file(probe)
    except FileNotFoundError as err:
        raise StoreError(f"{url}: the bucket or container does not exist ({_describe(err)})") from err
    except PermissionError as err:
        raise StoreError(f"{url}: access denied; check the credentials ({_describe(err)})") from err
    except Exception as err:  # backends raise their own types (botocore, aiohttp, azure)
        if "NoCredentials" in type(err).__name__ or "DefaultCredentialsError" in type(err).__name__:
            raise StoreError(f"{url}: no credentials found (environment variables, a profile or an instance "
                             f"role: see the backend's documentation)") from err
        raise StoreError(f"{url}: cannot write there ({type(err).__name__}: {_describe(err)})") from err


def put_file(local: str | os.PathLike, url: str) -> None:
    """Upload one small run file (config, manifest) over whatever ``url`` held."""
    fs, path = filesystem(url)
    fs.put_file(os.fspath(local), path)


def get_if_missing(url: str, local: str | os.PathLike) -> bool:
    """Download a small run file unless ``local`` exists; returns whether it was downloaded."""
    local = Path(local)
    if local.exists():
        return False
    fs, path = filesystem(url)
    try:
        with _answered(url):
            data = fs.cat_file(path)
    except FileNotFoundError:
        return False
    local.parent.mkdir(parents=True, exist_ok=True)
    ckpt_store.atomic_write(local, lambda handle: handle.write(data))
    return True


def _valid_record(data: Any) -> bool:
    """Whether a remote record has every field a resume relies on, with the right types."""
    try:
        files = data["files"]
        return (isinstance(data["name"], str) and "/" not in data["name"] and isinstance(files, dict) and bool(files)
                and all(isinstance(f["size"], int) and isinstance(f["sha256"], str) for f in files.values())
                and isinstance(data["global_step"], int) and isinstance(data["epoch"], int)
                and isinstance(data["saved_at"], (int, float)) and isinstance(data.get("extra", {}), dict))
    except (KeyError, TypeError):
        return False


#: Downloads at least this large show a progress bar (smaller ones finish before it would help).
PROGRESS_MIN_BYTES = 64 << 20


class _RichBytes(fsspec.callbacks.Callback):
    """An fsspec transfer callback that advances a rich progress bar across several files."""

    def __init__(self, progress: Any, task: Any) -> None:
        super().__init__()
        self._progress, self._task, self._base, self._file_value = progress, task, 0, 0

    def set_size(self, size: int) -> None:  # a new file starts
        self._base += self._file_value
        self._file_value = 0

    def relative_update(self, inc: int = 1) -> None:
        self._file_value += inc
        self._progress.update(self._task, completed=self._base + self._file_value)

    def absolute_update(self, value: int) -> None:
        self._file_value = value
        self._progress.update(self._task, completed=self._base + value)


@contextlib.contextmanager
def _progress(description: str, total: int) -> Iterator[fsspec.callbacks.Callback]:
    """A byte progress bar on stderr for a large transfer; a no-op callback for a small one."""
    if total < PROGRESS_MIN_BYTES:
        yield fsspec.callbacks.NoOpCallback()
        return
    from rich.console import Console
    from rich.progress import DownloadColumn, Progress, TransferSpeedColumn

    with Progress(*Progress.get_default_columns(), DownloadColumn(), TransferSpeedColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        yield _RichBytes(progress, progress.add_task(description, total=total))


def _local_files(path: Path, record: ckpt_store.CheckpointRecord) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of each file of a checkpoint: ``{"": ...}`` for one file, relative paths for a directory.

    The local record already holds what was measured when it was written: no second pass over the
    bytes, except for a directory recorded by older code (total size only).
    """
    if path.is_dir():
        return record.files if record.files is not None else ckpt_store.file_digests(path)
    return {"": {"size": record.size, "sha256": record.sha256}}


@dataclass
class RemoteCheckpoints:
    """A run's checkpoint directory in object storage, mirrored from and restored to a local one.

    Args:
        url: the remote directory, e.g. ``s3://bucket/runs/exp/run/checkpoints``.
        local_dir: where checkpoints are written before upload and downloaded before resume.
    """

    url: str
    local_dir: Path

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.local_dir = Path(self.local_dir)
        self.fs, self.root = filesystem(self.url)
        #: Seconds the last ``publish`` took (the upload a notice save waits for).
        self.last_publish_s: float | None = None
        #: ``(bytes, seconds)`` of the last download; ``None`` when the staged copy was reused.
        self.last_fetch: tuple[int, float] | None = None

    # ---------------------------------------------------------------- paths
    def _path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *(p for p in parts if p)])

    def object_url(self, name: str) -> str:
        return join(self.url, name)

    # -------------------------------------------------------------- writing
    def publish(self, local: str | os.PathLike) -> float:
        """Upload a locally published checkpoint: objects, then its record, then the pointer. Returns seconds."""
        with _answered(self.url):
            return self._publish(local)

    def _publish(self, local: str | os.PathLike) -> float:
        started = time.monotonic()
        self.last_publish_s = None
        local = Path(local)
        record = ckpt_store.read_record(local, verify_hash=False)
        if record is None and not local.exists():
            log.info("%s was removed before its upload (a replaced best checkpoint); not uploading it.", local)
            return 0.0
        if record is None:
            raise StoreError(f"{local}: not a published checkpoint (no valid record); not uploading it")
        try:
            files = _local_files(local, record)
            for rel in files:
                self.fs.put_file(os.fspath(local / rel if rel else local), self._path(local.name, rel))
        except FileNotFoundError:
            if local.exists():
                raise
            log.info("%s was removed during its upload (a replaced best checkpoint); not publishing it.", local)
            return 0.0
        remote_record = {
            "name": local.name,
            "global_step": record.global_step,
            "epoch": record.epoch,
            "saved_at": record.saved_at,
            "extra": record.extra,
            "files": files,
        }
        payload = json.dumps(remote_record, indent=1).encode()
        self.fs.pipe_file(self._path(local.name + ckpt_store.META_SUFFIX), payload)
        pointer = self.read_pointer()
        if pointer is None or int(pointer.get("global_step", -1)) <= record.global_step:
            self.fs.pipe_file(self._path(POINTER_NAME), payload)
        self.last_publish_s = time.monotonic() - started
        log.info("Uploaded %s to %s in %.2f s.", local.name, self.url, self.last_publish_s)
        return self.last_publish_s

    def try_publish(self, local: str | os.PathLike) -> bool:
        """``publish``, but a failure is logged as an error instead of raised; returns whether it worked.

        For saves during training: a store outage must not end a run whose checkpoints are safe on
        local disk, and the next checkpoint is uploaded as usual.
        """
        try:
            self.publish(local)
        except Exception as err:
            log.error("Could not upload checkpoint %s to %s (%s: %s); training goes on, the local copy is intact, "
                      "and the next checkpoint is uploaded as usual.", local, self.url, type(err).__name__, err)
            return False
        return True

    def try_remove(self, name: str) -> None:
        """``remove``, logging a failure instead of raising (an outage must not end training)."""
        try:
            self.remove(name)
        except Exception as err:
            log.error("Could not delete %s (%s: %s); it stays in the bucket.", self.object_url(name),
                      type(err).__name__, err)

    def try_prune(self, pattern: str, keep: int) -> list[str]:
        """``prune``, logging a failure instead of raising; returns what was deleted."""
        try:
            return self.prune(pattern, keep)
        except Exception as err:
            log.error("Could not prune %s (%s: %s); older checkpoints stay in the bucket until the next save.",
                      self.url, type(err).__name__, err)
            return []

    def remove(self, name: str) -> None:
        """Delete a checkpoint's record, then its objects (a half-deleted checkpoint is never good)."""
        meta = self._path(name + ckpt_store.META_SUFFIX)
        if self.fs.exists(meta):
            self.fs.rm_file(meta)
        target = self._path(name)
        if self.fs.exists(target):
            self.fs.rm(target, recursive=True)

    def prune(self, pattern: str, keep: int) -> list[str]:
        """Keep the ``keep`` newest recorded checkpoints matching ``pattern``; delete older ones and old debris.

        Debris is an object of the pattern without a record whose name sorts before the newest
        recorded one (an upload killed half-way); a newer unrecorded one may be an upload in flight.
        """
        recorded = [r["name"] for r in self.records() if fnmatch(r["name"], pattern)]
        removed = []
        for name in recorded[keep:]:
            self.remove(name)
            removed.append(name)
        if recorded:
            newest = recorded[0]
            for name in self._names():
                if (fnmatch(name, pattern) and not name.endswith(ckpt_store.META_SUFFIX)
                        and name not in recorded and name < newest):
                    self.remove(name)
                    removed.append(name)
        return removed

    def move_aside(self, suffix: str) -> str | None:
        """Move the whole remote directory to ``<url>.<suffix>`` (for ``--fresh``); returns where, or None."""
        self.fs.invalidate_cache(self.root)
        objects = self.fs.find(self.root)
        if not objects:
            return None
        target = f"{self.root}.{suffix}"
        for path in objects:  # copy everything, then delete: an object store has no directory rename
            self.fs.copy(path, target + path[len(self.root):])
        self.fs.rm(objects)
        return f"{self.url}.{suffix}"

    # -------------------------------------------------------------- reading
    def _names(self) -> list[str]:
        try:
            entries = self.fs.ls(self.root, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def _read_json(self, name: str) -> dict[str, Any] | None:
        try:
            data = json.loads(self.fs.cat_file(self._path(name)))
        except FileNotFoundError:
            return None
        except ValueError as err:
            log.warning("%s is unreadable (%s); ignoring it.", self.object_url(name), err)
            return None
        if not _valid_record(data):
            log.warning("%s is not a checkpoint record (fields missing or of the wrong type); ignoring it.",
                        self.object_url(name))
            return None
        return data

    def read_pointer(self) -> dict[str, Any] | None:
        """The ``latest.json`` pointer, if there is a readable one."""
        return self._read_json(POINTER_NAME)

    def records(self) -> list[dict[str, Any]]:
        """Every checkpoint record in the directory, newest (step, then save time) first; unverified."""
        with _answered(self.url):
            return self._records()

    def _records(self) -> list[dict[str, Any]]:
        self.fs.invalidate_cache(self.root)
        found = [self._read_json(n) for n in self._names() if n.endswith(ckpt_store.META_SUFFIX)]
        records = [r for r in found if r is not None]
        return sorted(records, key=lambda r: (int(r["global_step"]), float(r["saved_at"])), reverse=True)

    def _remote_complete(self, record: dict[str, Any]) -> bool:
        """Cheap check before a download: every object exists with the recorded size."""
        name = record["name"]
        for rel, want in record["files"].items():
            try:
                size = self.fs.info(self._path(name, rel))["size"]
            except FileNotFoundError:
                log.warning("Checkpoint %s is incomplete: %s is missing (an upload killed half-way?); skipping it.",
                            self.object_url(name), rel or name)
                return False
            if size != want["size"]:
                log.warning("Checkpoint %s is incomplete: %s has %d bytes, its record says %d; skipping it.",
                            self.object_url(name), rel or name, size, want["size"])
                return False
        return True

    def _staged(self, record: dict[str, Any]) -> ckpt_store.CheckpointRecord | None:
        """A local copy of the recorded checkpoint that already verifies (a relaunch on the same machine)."""
        path = self.local_dir / record["name"]
        if not ckpt_store.meta_path(path).exists():
            return None
        local = ckpt_store.read_record(path)
        if local is None or local.global_step != int(record["global_step"]):
            return None
        files = record["files"]
        if path.is_file() and files.get("", {}).get("sha256") != local.sha256:
            return None
        if path.is_dir() and local.files is not None:  # verified against its record: the same files?
            return local if local.files == files else None
        if path.is_dir():  # a record of older code holds the total size only: compare every shard's size
            for rel, want in files.items():
                shard = path / rel
                if not shard.is_file() or shard.stat().st_size != want["size"]:
                    return None
        return local

    def fetch(self, record: dict[str, Any]) -> ckpt_store.CheckpointRecord | None:
        """Download the checkpoint of ``record`` into the local directory and verify every object.

        Returns the local record, or ``None`` (with a warning) if any object is missing, short or corrupt.
        """
        self.last_fetch = None
        self.local_dir.mkdir(parents=True, exist_ok=True)
        lock = self.local_dir / ".locks" / record["name"]
        lock.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(lock):  # another rank of this machine may be fetching it now: download it once
            staged = self._staged(record)
            if staged is not None:
                return staged
            return self._download(record)

    def _download(self, record: dict[str, Any]) -> ckpt_store.CheckpointRecord | None:
        name = record["name"]
        if not self._remote_complete(record):
            return None
        self.local_dir.mkdir(parents=True, exist_ok=True)
        target = self.local_dir / name
        tmp = self.local_dir / f".{name}.download-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        total = sum(int(f["size"]) for f in record["files"].values())
        started = time.monotonic()
        try:
            with _progress(f"downloading {name}", total) as progress:
                for rel, want in record["files"].items():
                    dest = tmp / rel if rel else tmp
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    self.fs.get_file(self._path(name, rel), os.fspath(dest), callback=progress)
                    if dest.stat().st_size != want["size"] or ckpt_store.file_sha256(dest) != want["sha256"]:
                        log.warning("Checkpoint %s is corrupt: %s fails its size/SHA-256 check; skipping it.",
                                    self.object_url(name), rel or name)
                        return None
            # checksums prove the objects are what the record says, not that the record is honest
            if (why := ckpt_store.rejection(tmp)) is not None:
                log.warning("Checkpoint %s cannot be loaded safely (%s); skipping it.", self.object_url(name), why)
                return None
            ckpt_store.remove(target)
            os.replace(tmp, target)
            self.last_fetch = (total, time.monotonic() - started)
        finally:
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
        files = record["files"]
        single = files.get("") if "" in files else None
        return ckpt_store.write_record(target, int(record["global_step"]), int(record["epoch"]),
                                       size=single["size"] if single else None,
                                       sha256=single["sha256"] if single else None,
                                       extra=dict(record.get("extra") or {}),
                                       files=None if single else files)  # each one just verified

    def fetch_newest_good(self) -> ckpt_store.CheckpointRecord | None:
        """Resume point: the checkpoint the pointer names, else the newest older record that verifies."""
        with _answered(self.url):
            return self._fetch_newest_good()

    def _fetch_newest_good(self) -> ckpt_store.CheckpointRecord | None:
        pointer = self.read_pointer()
        records = self.records()
        ordered = ([pointer] if pointer else []) + [r for r in records if not pointer or r["name"] != pointer["name"]]
        if pointer and not any(r["name"] == pointer["name"] for r in records):
            log.warning("%s names %s, which has no record; ignoring the pointer.",
                        self.object_url(POINTER_NAME), pointer["name"])
            ordered = ordered[1:]
        for record in ordered:
            local = self.fetch(record)
            if local is not None:
                return local
        return None

    def fetch_named(self, name: str) -> ckpt_store.CheckpointRecord | None:
        """Download and verify one recorded checkpoint by name (an explicit ``--ckpt_path`` URL)."""
        with _answered(self.url):
            record = self._read_json(name + ckpt_store.META_SUFFIX)
            if record is None:
                raise StoreError(f"{self.object_url(name)} has no checkpoint record; cannot verify it")
            return self.fetch(record)
