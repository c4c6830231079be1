"""A prepared dataset's files as the run reads them: checked against ``atscale.json`` before any byte is decoded.

Whoever can write to the bucket must not be able to run code on the training nodes or train a run on changed
bytes. Two checks stand between the bucket and the decoder:

- **Only the formats ``recipes.prepare`` writes are decoded** (:data:`SAFE_FORMATS`): litdata decodes each item
  by the index's ``data_format``, and ``pickle`` (or an item loader or compression of its choosing) runs whatever
  the chunk holds. An index that asks for anything else is refused before any item is read (:class:`UnsafeData`).
- **Every file is verified when it is first fetched**: its SHA-256 against the one ``atscale.json`` lists, hashed
  before it is written to the local copy (:class:`VerifiedFiles`). A mismatch, a truncated file or an index that
  is not the one prepared stops the run (:class:`DataDamaged`), naming the file; a relaunch cannot fix that, so it
  is no requeue.

The files of a bucket land in a local copy (``<cache_dir>/<url digest>/<split>/``) only once verified (written
beside, renamed into place); a folder dataset is read where it is. Either way the bytes are hashed again at every
read, the very bytes then decoded (:mod:`datamodules.streamed_items`): the data at the URL may have been prepared
again since, someone may rewrite a folder during the run, a disk may rot, and the hash (1.8 GB/s) costs a
fraction of the decoding. The copy is held to ``max_cache_bytes`` (oldest chunks deleted first, never one the
reader is about to read).
Written by hand: litdata fetches chunks on several paths (sync, async, byte ranges) with no hook to check them,
and fsspec reads the bucket (an instance of its own per reader, from the environment of the process that reads).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "DAMAGED_EXIT_CODE",
    "LOCAL_FAULT_EXIT_CODE",
    "SAFE_FORMATS",
    "CacheUnwritable",
    "DataDamaged",
    "StreamFault",
    "UnsafeData",
    "VerifiedFiles",
    "cache_bytes",
    "check_index",
    "fresh_fs",
    "fsspec_path",
]

#: Exit code of a run whose streamed data is damaged (``EX_DATAERR``): a relaunch meets the same bytes.
DAMAGED_EXIT_CODE = 65
#: Exit code of a run whose local chunk cache cannot be written (``EX_IOERR``): fix the disk, then relaunch.
LOCAL_FAULT_EXIT_CODE = 74
#: litdata's serializers that decode a prepared item without running code: what ``recipes.prepare`` writes
#: (images: ``numpy`` pixels and an ``int`` label; tokens: ``no_header_numpy:<dtype>``).
SAFE_FORMATS = ("numpy", "int", "no_header_numpy")
#: The item loader and the absent compression/encryption ``recipes.prepare`` writes with.
SAFE_LOADER = "PyTreeLoader"
_TEMP = ".part"  # a fetch's file before it is renamed into place: ``.<name>.<pid>.<random>.part``
_LOCAL_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}


class StreamFault(RuntimeError):
    """Why the streamed data stopped the run; the message is the run's one line, ``exit_code`` its exit code."""

    exit_code = 1


class DataDamaged(StreamFault):
    """A file is not the one prepared: another SHA-256, cut short, or an index that does not parse."""

    exit_code = DAMAGED_EXIT_CODE


class CacheUnwritable(StreamFault):
    """The local chunk cache cannot take a file (read-only, no permission, full)."""

    exit_code = LOCAL_FAULT_EXIT_CODE


class UnsafeData(RuntimeError):
    """An index that asks for a decoder that can run code (bad input: exit 2 before any item is read)."""


def fsspec_path(url: str) -> str:
    """``url`` as fsspec's filesystems name it (a bucket's key without the scheme; a folder's absolute path)."""
    import fsspec.core

    protocol, path = fsspec.core.split_protocol(url)
    return path if protocol not in (None, "file", "local") else str(Path(path).absolute())


def fresh_fs(url: str) -> tuple[Any, str]:
    """A filesystem object for ``url`` made now, from this process's environment (never fsspec's cached one).

    fsspec caches instances by their constructor's arguments, not the environment: a second launch in one
    process (``train()`` twice in a notebook) with other ``AWS_*`` settings would read the first store.
    """
    import fsspec.core

    return fsspec.core.url_to_fs(url, skip_instance_cache=True)


def cache_bytes(size: str | int) -> int:
    """A cache budget in bytes: an int, or litdata's spelling (``"25GB"``, ``"200KB"``; decimal units)."""
    if isinstance(size, int):
        return size
    text = str(size).strip().upper()
    for unit, factor in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if text.endswith(unit):
            try:
                return int(float(text[: -len(unit)]) * factor)
            except ValueError:
                break
    raise ValueError(f"max_cache_size={size!r}: expected bytes or a size such as '25GB' or '200KB'.")


def check_index(index: dict[str, Any], where: str) -> None:
    """Refuse (:class:`UnsafeData`) an index whose items a safe decoder cannot read; ``where`` names the file."""
    config = index.get("config") or {}
    formats = config.get("data_format") or []
    unsafe = [f for f in formats if not isinstance(f, str) or f.split(":", 1)[0] not in SAFE_FORMATS]
    if unsafe:
        raise UnsafeData(f"{where}: items in the {', '.join(map(str, unsafe))} data format, which could run code "
                         f"when read; only {', '.join(SAFE_FORMATS)} (what recipes.prepare writes) are read.")
    others = {k: config.get(k) for k in ("compression", "encryption") if config.get(k)}
    if config.get("item_loader", SAFE_LOADER) != SAFE_LOADER:
        others["item_loader"] = config.get("item_loader")
    if others:
        found = ", ".join(f"{k} {v!r}" for k, v in others.items())
        raise UnsafeData(f"{where}: {found}, which recipes.prepare never writes; refused unread.")


class VerifiedFiles:
    """One split's files, each fetched once and checked against its SHA-256 before it is decoded.

    Args:
        url: the split's folder or bucket URL (``<dataset url>/train``).
        expected: SHA-256 of each file by its name in the split (``atscale.json``'s ``files``, the split's part);
            ``None``: read from the dataset's ``atscale.json`` (the folder above ``url``) on first use.
        cache_dir: where a bucket's verified files are copied (a folder's are read in place).
        max_cache_bytes: the copy's budget; the oldest chunks are deleted past it.
        shown_url: the URL as messages may print it (credentials redacted).
        fs: the filesystem object this process reads ``url`` with (a loader worker makes its own); default: one
            made on first use (:func:`fresh_fs`).
    """

    def __init__(self, url: str, expected: dict[str, str] | None, cache_dir: str, max_cache_bytes: int,
                 shown_url: str | None = None, fs: Any = None) -> None:
        self.url = url.rstrip("/")
        self._expected = None if expected is None else dict(expected)
        self.remote = "://" in url and not url.startswith("file://")
        self.shown_url = shown_url or self.url
        digest = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        self.local_dir = (Path(cache_dir) / digest / Path(self.url).name) if self.remote else \
            Path(self.url.removeprefix("file://")).absolute()
        self.max_cache_bytes = max_cache_bytes
        self._fs: Any = None if fs is None else (fs, fsspec_path(url))
        self._fs_pid = 0 if fs is None else os.getpid()
        self._index: dict[str, Any] | None = None
        #: ``index.json``'s bytes as read and verified (empty until :meth:`index` read it).
        self.index_bytes = b""
        self._keep: frozenset[str] = frozenset()
        self._trim_lock = threading.Lock()
        self._copy_bytes: int | None = None  # the copy's size as this process counts it; None: list it
        self._fetched_since_listing = 0
        if self.remote:
            _remove_dead_temps(self.local_dir)

    def __getstate__(self) -> dict[str, Any]:  # a loader worker makes its own filesystem object
        return {**self.__dict__, "_fs": None, "_trim_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _trim_lock=threading.Lock())

    @property
    def expected(self) -> dict[str, str]:
        """SHA-256 of each of the split's files by name, as ``atscale.json`` lists them."""
        if self._expected is None:
            fs, root = self._fs_and_root()
            parent, split = root.rstrip("/").rsplit("/", 1)
            with fs.open(f"{parent}/atscale.json", "rb") as handle:
                files = json.loads(handle.read()).get("files") or {}
            self._expected = {name[len(split) + 1:]: sha for name, sha in files.items()
                              if name.startswith(f"{split}/")}
        return self._expected

    def index(self) -> dict[str, Any]:
        """The split's ``index.json``, checked for safe formats first (a hostile index is named as such even when
        ``atscale.json`` was rewritten to match it), then verified (before any chunk is read). Read once: its
        bytes are kept (:attr:`index_bytes`) for the dataset's digest.

        Raises:
            FileNotFoundError: when the split has no index.
        """
        if self._index is None:
            name = "index.json"
            if self.remote:
                fs, root = self._fs_and_root()
                data = fs.cat_file(f"{root}/{name}")
            else:
                data = (self.local_dir / name).read_bytes()
            try:
                index = json.loads(data)
            except ValueError:
                raise DataDamaged(self.damaged(name, "it is not the JSON prepared")) from None
            check_index(index, f"{self.shown_url}/{name}")
            if name not in self.expected:
                raise DataDamaged(self.damaged(name, "atscale.json lists no such file"))
            found, want = hashlib.sha256(data).hexdigest(), self.expected[name]
            if found != want:
                size = f" ({len(data)} bytes)" if self.remote else ""
                raise DataDamaged(self.damaged(name, f"SHA-256 {found[:12]}{size}, not the prepared {want[:12]}"))
            self._index, self.index_bytes = index, data
        return self._index

    def _fs_and_root(self) -> tuple[Any, str]:
        """This process's filesystem object (a forked loader worker makes its own: s3fs's are not fork-safe)."""
        if self._fs is None or self._fs_pid != os.getpid():
            self._fs, self._fs_pid = fresh_fs(self.url), os.getpid()
        return self._fs

    def path(self, name: str) -> Path:
        """The local path of file ``name``, verified first (a bucket's: fetched into the copy when it is not there)."""
        self.read(name)
        return self.local_dir / name

    def read(self, name: str) -> bytes:
        """File ``name``'s bytes, their SHA-256 checked: a folder's read in place, a bucket's from the local copy when
        it holds them, else fetched once into it (one fetch per file at a time across threads, loader workers and
        ranks sharing the cache: a reader that finds a fetch in flight waits for it)."""
        if name not in self.expected:
            raise DataDamaged(self.damaged(name, "atscale.json lists no such file"))
        want = self.expected[name]
        local = self.local_dir / name
        if not self.remote:
            data = local.read_bytes()
            found = hashlib.sha256(data).hexdigest()
            if found != want:
                raise DataDamaged(self.damaged(name, f"SHA-256 {found[:12]}, not the prepared {want[:12]}"))
            return data
        data = _bytes_if(local, want)
        if data is not None:
            return data
        with self._fetch_lock(name):
            data = _bytes_if(local, want)  # fetched meanwhile by whoever held the lock
            return data if data is not None else self._fetch(name, local)

    def reset(self) -> None:
        """Make a fresh filesystem object on the next fetch (after a failed read: a new client and connections)."""
        self._fs = None

    def keep(self, names: set[str]) -> None:
        """The files the reader is about to read: the budget never deletes them (the fetch-ahead's window)."""
        self._keep = frozenset(names)

    @contextlib.contextmanager
    def _fetch_lock(self, name: str) -> Iterator[None]:
        """Hold file ``name``'s fetch lock (``flock`` on ``.<name>.lock`` in the copy; deleted with the file)."""
        lock = self.local_dir / f".{name}.lock"
        try:
            self.local_dir.mkdir(parents=True, exist_ok=True)
            handle = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise self._unwritable(err) from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield
        finally:
            os.close(handle)  # releases the lock

    def _fetch(self, name: str, local: Path) -> bytes:
        """Copy ``name`` from the bucket to ``local``, hashed before it is written; published only when it matches.

        One GET of the whole file (``cat_file``: no size lookup first, which a streamed ``open`` makes and which
        cost more than the hash); the file is held in memory once, a chunk's size.
        """
        fs, root = self._fs_and_root()
        data = fs.cat_file(f"{root}/{name}")
        found = hashlib.sha256(data).hexdigest()
        if found != self.expected[name]:
            raise DataDamaged(self.damaged(name, f"SHA-256 {found[:12]} ({len(data)} bytes), not the prepared "
                                                 f"{self.expected[name][:12]}"))
        try:
            local.parent.mkdir(parents=True, exist_ok=True)
            handle, tmp = tempfile.mkstemp(dir=local.parent, prefix=f".{name}.{os.getpid()}.", suffix=_TEMP)
            os.fchmod(handle, 0o644)  # as a plain copy would be (mkstemp makes it 0600)
        except OSError as err:
            raise self._unwritable(err) from None
        try:
            try:  # unbuffered: a full disk is met at the write that fills it, never again at a close
                self._local(_write_all, handle, data)
            finally:
                os.close(handle)
            self._local(os.replace, tmp, local)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        if name != "index.json":
            self._trim(fetched=len(data))
        return data

    def _trim(self, fetched: int) -> None:
        """Delete the oldest fetched chunks while the copy is over its budget, never one about to be read (a reader
        that loses one fetches it again).

        The copy's size is counted as this process fetches and deletes, and measured again (a listing of its files)
        once per tenth of the budget fetched: a listing of a large cache costs more than a chunk. Other readers'
        fetches meanwhile are what the copy may pass its budget by, with the window about to be read.
        """
        with self._trim_lock:
            if self._copy_bytes is None or self._fetched_since_listing >= self.max_cache_bytes // 10:
                self._copy_bytes, self._fetched_since_listing = None, 0
            else:
                self._copy_bytes += fetched
                self._fetched_since_listing += fetched
                if self._copy_bytes <= self.max_cache_bytes:
                    return
            try:
                chunks = sorted(((p.stat().st_mtime, p) for p in self.local_dir.glob("*.bin")),
                                key=lambda pair: pair[0])
                sizes = {p: p.stat().st_size for _, p in chunks}
            except FileNotFoundError:  # another reader trimmed meanwhile: measured again next time
                return
            total = sum(sizes.values())
            for _, chunk in chunks:
                if total <= self.max_cache_bytes:
                    break
                if chunk.name in self._keep:
                    continue
                total -= sizes[chunk]
                chunk.unlink(missing_ok=True)
                (self.local_dir / f".{chunk.name}.lock").unlink(missing_ok=True)
            self._copy_bytes = total

    def damaged(self, name: str, why: str) -> str:
        """The run's one line for damaged file ``name``."""
        return (f"atscale: the streamed data at {self.shown_url} is damaged: {name}: {why}; the run stopped "
                f"(exit {DAMAGED_EXIT_CODE}, no requeue): prepare the data again (python -m recipes.prepare ...), "
                "then relaunch.")

    def _local(self, write: Any, *args: Any) -> Any:
        """``write(*args)`` on the cache's disk: its faults are :class:`CacheUnwritable`, not a store's outage."""
        try:
            return write(*args)
        except OSError as err:
            raise self._unwritable(err) from None

    def _unwritable(self, err: OSError) -> BaseException:
        if err.errno not in _LOCAL_ERRNOS:
            return err
        return CacheUnwritable(
            f"atscale: the chunk cache {self.local_dir.parent} cannot be written ({os.strerror(err.errno)}); the run "
            f"stopped (exit {LOCAL_FAULT_EXIT_CODE}, no requeue): free it or pick another with --data.cache_dir, "
            "then relaunch the same command: it resumes from the newest checkpoint.")


def _bytes_if(path: Path, sha256: str) -> bytes | None:
    """The bytes of ``path`` if it exists and has SHA-256 ``sha256``, else ``None``."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return data if hashlib.sha256(data).hexdigest() == sha256 else None


def _remove_dead_temps(folder: Path) -> None:
    """Delete the temporary files of fetches whose process is gone (killed mid-write: never renamed into place)."""
    for temp in folder.glob(f".*{_TEMP}") if folder.exists() else ():
        parts = temp.name[:-len(_TEMP)].rsplit(".", 2)  # [".<name>", "<pid>", "<random>"]
        pid = parts[1] if len(parts) == 3 else ""
        if pid.isdigit() and not _alive(int(pid)):
            temp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (its own copy of recipes.run.tracking's: datamodules import no recipes)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
