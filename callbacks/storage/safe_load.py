"""Load checkpoints that may come from elsewhere (a shared bucket, another user's folder) without running their code.

A checkpoint is a pickle, and unpickling runs whatever callables it names. torch loads ``.ckpt``
files with ``weights_only=True`` (an allow-list), but a distributed checkpoint (the directory of
``.distcp`` shards our FSDP run saves) is read by ``torch.distributed.checkpoint`` with two
unrestricted loads:

- ``FileSystemReader.read_metadata`` reads ``.metadata`` with plain ``pickle.load``;
- the default load planner reads each non-tensor item of a shard (an optimizer's ``lr``, ``betas``...)
  with ``torch.load(weights_only=False)``.

Here both go through allow-lists:

- ``.metadata`` is read by a ``pickle.Unpickler`` whose ``find_class`` only returns torch's own
  weights-only globals (dtypes, ``torch.Size``, layouts...), the globals a user allowed with
  ``torch.serialization.add_safe_globals``, and the checkpoint-metadata classes of
  ``torch.distributed.checkpoint`` (listed in ``_dcp_globals``). torch's weights-only unpickler itself
  cannot read the file: it only parses pickle protocol 2, and ``.metadata`` is written with protocol 4
  (FRAME, STACK_GLOBAL, MEMOIZE; checked with torch 2.14). Restricting ``find_class`` is the standard
  library's documented way to unpickle untrusted data: every global, hence every callable, comes from it.
- each non-tensor item is loaded with ``torch.load(weights_only=True)`` and re-encoded from the safe
  objects before torch's planner sees it.

Every relative path in ``.metadata`` must also stay inside the checkpoint directory.

``recipes.sample`` loads through ``load_distributed``. The training resume cannot: Lightning's
``ModelParallelStrategy`` reads the directory with torch's own reader, through private helpers that
take no reader. Rather than copy or patch those, ``ckpt_store.read_record`` (behind ``newest_good``
and the object-storage fetch) runs ``check`` on every candidate just before the CLI hands it to
Lightning, and the record's per-file SHA-256 ties the checked bytes to the ones that were written.

Example::

    safe_load.check(path)                               # raises CheckpointRejected, naming path and why
    safe_load.load_distributed(state, path)             # torch.distributed.checkpoint.load, safely
    dcp.load(state, storage_reader=SafeFileSystemReader(path))
"""

from __future__ import annotations

import enum
import io
import os
import pathlib
import pickle
import warnings
from functools import cache
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future
from typing_extensions import override

from ..utils.compat import torch_allowed_globals

METADATA_NAME = ".metadata"
#: The file of a Lightning distributed checkpoint that holds everything but the model and optimizer shards.
LIGHTNING_META_NAME = "meta.pt"


class CheckpointRejected(Exception):
    """A checkpoint that cannot be loaded without running code it holds, or that is not what it claims to be.

    Args:
        path: the file (or directory) at fault.
        reason: what is wrong with it, as a predicate: ``"names builtins.exec, which is not an allowed global"``.
    """

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(os.fspath(path), reason)  # both in args: it pickles (torch gathers ranks' errors)
        self.path = Path(path)
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path} {self.reason}"


def _first_line(err: BaseException) -> str:
    """The informative line of an error: torch's weights-only failures bury it after a long preamble."""
    text = str(err)
    marker = "WeightsUnpickler error: "
    if marker in text:
        text = text.split(marker, 1)[1]
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return (lines[0] if lines else type(err).__name__)[:300]


# ------------------------------------------------------------------ .metadata
@cache
def _dcp_globals() -> dict[str, Any]:
    """The classes a ``.metadata`` of torch.distributed.checkpoint is made of (beyond torch's weights-only set)."""
    from torch.distributed.checkpoint import filesystem, metadata

    names = {metadata: ["Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
                        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"],
             filesystem: ["_StorageInfo"],
             # StorageMeta.checkpoint_id is the path the writer was given
             pathlib: ["PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"]}
    # a class a later torch renames is simply not allowed (a checkpoint naming it is refused, loudly)
    allowed = [getattr(module, name) for module, listed in names.items() for name in listed if hasattr(module, name)]
    return {f"{obj.__module__}.{obj.__qualname__}": obj for obj in allowed}


class _RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only allow-listed globals and no persistent ids.

    ``builtins.getattr`` resolves to :meth:`_enum_member`: some Python releases (3.11.2, Debian 12's, among
    them) pickle an enum member as ``getattr(TheEnum, "NAME")``, and a ``.metadata`` holds one
    (``_MEM_FORMAT_ENCODING``); a real ``getattr`` would reach any attribute of an allowed class.
    """

    def __init__(self, file: IO[bytes], allowed: dict[str, Any]) -> None:
        super().__init__(file)
        self._allowed = allowed

    @override
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return self._enum_member
        try:
            return self._allowed[f"{module}.{name}"]
        except KeyError:
            raise pickle.UnpicklingError(f"names {module}.{name}, which is not an allowed global") from None

    def _enum_member(self, owner: Any, name: Any) -> enum.Enum:
        """``getattr(owner, name)`` only where it means a member of an allow-listed enum."""
        allowed_enum = (isinstance(owner, type) and issubclass(owner, enum.Enum)
                        and any(owner is obj for obj in self._allowed.values()))
        if not allowed_enum or not isinstance(name, str) or name not in owner.__members__:
            raise pickle.UnpicklingError(f"names builtins.getattr({getattr(owner, '__qualname__', owner)!r}, "
                                         f"{name!r}), which is not a member of an allowed enum")
        return owner.__members__[name]

    @override
    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("holds a persistent id, which checkpoint metadata never does")


def _inside(relative: str) -> bool:
    """Whether a path the metadata names stays inside the checkpoint directory."""
    pure = pathlib.PurePath(relative)
    return bool(pure.parts) and not pure.is_absolute() and ".." not in pure.parts


def read_metadata(handle: IO[bytes], path: str | os.PathLike) -> Metadata:
    """Unpickle a ``.metadata`` stream through the allow-list; ``path`` names it in errors."""
    try:
        metadata = _RestrictedUnpickler(handle, {**torch_allowed_globals(), **_dcp_globals()}).load()
    except pickle.UnpicklingError as err:
        raise CheckpointRejected(path, _first_line(err)) from err
    except Exception as err:  # whatever else a malformed stream raises
        raise CheckpointRejected(path, f"is not a valid pickle ({type(err).__name__}: {_first_line(err)})") from err
    if not isinstance(metadata, Metadata):
        raise CheckpointRejected(path, f"holds a {type(metadata).__name__}, not checkpoint metadata")
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    for info in storage.values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or not _inside(relative):
            raise CheckpointRejected(path, f"names a file outside the checkpoint ({relative!r})")
    return metadata


def load_dcp_metadata(directory: str | os.PathLike, rank: int | None = None) -> Metadata:
    """The ``.metadata`` of a distributed checkpoint directory, unpickled through the allow-list."""
    path = Path(directory) / (METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}")
    try:
        with open(path, "rb") as handle:
            return read_metadata(handle, path)
    except OSError as err:
        raise CheckpointRejected(path, f"cannot be read ({err.strerror or err})") from err


# ---------------------------------------------------------- the shards' items
def safe_torch_load(source: str | os.PathLike | IO[bytes], name: str | os.PathLike, **kwargs: Any) -> Any:
    """``torch.load(weights_only=True)``; a failure is a ``CheckpointRejected`` naming ``name``."""
    try:
        return torch.load(source, weights_only=True, **kwargs)
    except Exception as err:
        raise CheckpointRejected(name, f"fails to load weights-only: {_first_line(err)}") from err


class _SafeBytes:
    """A load planner seen through a filter: each non-tensor item is loaded weights-only, then re-encoded.

    torch's default planner loads these items with ``torch.load(weights_only=False)``; what it gets
    here was pickled again from objects the weights-only unpickler built, so it names no other callable.
    """

    def __init__(self, planner: LoadPlanner, directory: Path) -> None:
        self._planner = planner
        self._directory = directory

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True, map_location="cpu")
        except Exception as err:
            raise CheckpointRejected(self._directory, f"has an item {read_item.dest_index.fqn} that fails to load "
                                                      f"weights-only: {_first_line(err)}") from err
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` that unpickles ``.metadata`` and the shards' non-tensor items safely.

    Raises ``CheckpointRejected`` (inside torch's ``CheckpointException``; ``load_distributed`` unwraps it).
    """

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self.fs.concat_path(self.path, METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}")
        try:
            with self.fs.create_stream(path, "rb") as handle:
                metadata = read_metadata(handle, path)
        except OSError as err:
            raise CheckpointRejected(path, f"cannot be read ({err.strerror or err})") from err
        if getattr(metadata, "storage_meta", None) is None:  # as torch's reader does
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    @override
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        return super().read_data(plan, _SafeBytes(planner, Path(self.path)))  # type: ignore[arg-type]


def load_distributed(state: dict[str, Any], directory: str | os.PathLike, no_dist: bool = True,
                     **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load(state, ...)`` through ``SafeFileSystemReader``, in place.

    Raises:
        CheckpointRejected: the checkpoint holds code, or is not a readable distributed checkpoint.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    # first on its own: a rejected .metadata inside dcp.load is logged with tracebacks, then reported as
    # "metadata is None" after a fallback to per-rank metadata files
    load_dcp_metadata(directory)
    try:
        with warnings.catch_warnings():
            # torch warns that it loads in one process even when asked to (no_dist=True)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(state, storage_reader=SafeFileSystemReader(directory), no_dist=no_dist, **kwargs)
    except CheckpointException as err:  # torch gathers each rank's error into one exception
        failures = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
        rejected = next((f for f in failures if isinstance(f, CheckpointRejected)), None)
        if rejected is not None:
            raise rejected from err
        first = failures[0] if failures else err
        raise CheckpointRejected(directory, f"cannot be loaded ({type(first).__name__}: {_first_line(first)})") from err


# -------------------------------------------------------------------- checks
def check_file(path: str | os.PathLike) -> None:
    """A cheap proof that a ``torch.save`` file loads weights-only: its pickle is parsed, its tensors are
    memory-mapped, not read."""
    obj = safe_torch_load(path, path, map_location="cpu", mmap=True)
    del obj


def check_directory(directory: str | os.PathLike) -> None:
    """A distributed checkpoint loads without running code: ``.metadata``, every non-tensor item of its
    shards, and Lightning's ``meta.pt`` if present. Tensor data is not read."""
    directory = Path(directory)
    if not (directory / METADATA_NAME).is_file():
        raise CheckpointRejected(directory, f"is not a distributed checkpoint (no {METADATA_NAME} in it)")
    metadata = load_dcp_metadata(directory)
    items: dict[str, Any] = {fqn: None for fqn, md in metadata.state_dict_metadata.items()
                             if isinstance(md, BytesStorageMetadata)}
    if items:
        load_distributed(items, directory)
    if (directory / LIGHTNING_META_NAME).exists():
        check_file(directory / LIGHTNING_META_NAME)


def check(path: str | os.PathLike) -> None:
    """Raise ``CheckpointRejected`` unless checkpoint ``path`` (a file or a distributed directory) loads safely."""
    (check_directory if Path(path).is_dir() else check_file)(path)


def rejection(path: str | os.PathLike) -> str | None:
    """Why checkpoint ``path`` cannot be loaded safely (naming the file at fault within it), or ``None`` if it can."""
    try:
        check(path)
    except CheckpointRejected as err:
        return describe(err, path)
    return None


def describe(err: CheckpointRejected, checkpoint: str | os.PathLike) -> str:
    """``err`` as said of ``checkpoint``: the reason alone, or prefixed by the file within it that is at fault."""
    checkpoint = Path(checkpoint)
    if err.path == checkpoint:
        return err.reason
    if err.path.is_relative_to(checkpoint):
        return f"{err.path.relative_to(checkpoint).as_posix()} {err.reason}"
    return str(err)


