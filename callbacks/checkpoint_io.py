"""A checkpoint IO that publishes every file atomically with an integrity record.

Lightning's ``TorchCheckpointIO`` already writes through a temporary file, but leaves nothing
that tells a complete checkpoint from one cut short after the rename of a copied file, nor a
way to find the newest good one. This IO writes with fsync + rename and then the checkpoint's
``.meta.json`` record (size, SHA-256, step, and the ``atscale`` block a callback puts in the
checkpoint, e.g. the MLflow run id), so a resume can verify before it trusts.

Given a ``RemoteCheckpoints`` mirror, every published checkpoint is then uploaded to object
storage (objects, record, ``latest.json`` pointer, in that order); ``remove_checkpoint`` deletes
both copies. Wrap it in ``BoundedAsyncCheckpointIO`` to write and upload in a background thread
(tensors are copied on the caller's thread first, into a staging buffer allocated once);
``teardown()`` joins it, which is how a save on an interruption notice waits for its upload.

Example::

    trainer = Trainer(plugins=[AtomicCheckpointIO()])
    trainer = Trainer(plugins=[BoundedAsyncCheckpointIO(AtomicCheckpointIO(
        mirror=RemoteCheckpoints("s3://bucket/runs/exp/run/checkpoints", Path("runs/exp/run/checkpoints"))))])

Copy with it (paths under ``callbacks/``, each folder with an ``__init__.py``):
``storage/{ckpt_store,safe_load,remote_store}.py`` (remote_store needs fsspec), ``utils/compat.py``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from .storage import ckpt_store
from .storage.remote_store import RemoteCheckpoints
from .utils.compat import async_error, async_executor, set_async_error

log = logging.getLogger(__name__)

#: Key of the checkpoint's block of run metadata, copied into the integrity record.
RUN_METADATA_KEY = "atscale"


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temporary file, fsync, rename, write the integrity record; then upload, if mirrored.

    Args:
        mirror: the run's checkpoint directory in object storage, or ``None`` for a local run.
    """

    def __init__(self, mirror: RemoteCheckpoints | None = None) -> None:
        super().__init__()
        self.mirror = mirror
        #: Uploads that failed (each logged as an error); the run goes on with its local checkpoints.
        self.upload_failures = 0

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got {storage_options!r}).")
        # atomic_write raises the OSError that torch.save's zip writer wraps in a RuntimeError
        try:
            size, sha256 = ckpt_store.atomic_write(path, lambda handle: torch.save(checkpoint, handle))
        except OSError as err:  # ENOSPC, EDQUOT, EIO...: say what was kept, keep the errno
            raise OSError(err.errno, f"could not write checkpoint {path} ({err.strerror or err}); "
                                     "nothing was replaced: the previous checkpoints are intact") from err
        try:
            ckpt_store.write_record(
                path,
                global_step=checkpoint.get("global_step", 0),
                epoch=checkpoint.get("epoch", 0),
                size=size,
                sha256=sha256,
                # the run metadata without the per-rank RNG states (they stay in the checkpoint)
                extra={k: v for k, v in checkpoint.get(RUN_METADATA_KEY, {}).items() if k != "rng"},
            )
        except OSError as err:  # the disk filled up between the two: an unrecorded checkpoint is never used
            Path(path).unlink(missing_ok=True)  # so free its space
            raise OSError(err.errno, f"could not write the record of checkpoint {path} ({err.strerror or err}); "
                                     "it was removed: the previous checkpoints are intact") from err
        if self.mirror is not None:
            if not self.mirror.try_publish(path):
                self.upload_failures += 1

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        ckpt_store.remove(path)
        if self.mirror is not None:
            self.mirror.try_remove(Path(path).name)


def mirror_of(io: CheckpointIO | None) -> RemoteCheckpoints | None:
    """The object-storage mirror behind a trainer's checkpoint IO (seen through ``AsyncCheckpointIO``), if any."""
    while io is not None:
        if isinstance(io, AtomicCheckpointIO):
            return io.mirror
        io = getattr(io, "checkpoint_io", None)
    return None


#: Leaf types a checkpoint holds that staging leaves as they are (immutable).
_ATOMS = frozenset({int, float, bool, str, bytes, type(None)})


class BoundedAsyncCheckpointIO(AsyncCheckpointIO):
    """Lightning's ``AsyncCheckpointIO`` with at most one save in flight behind the one being submitted.

    Each queued save holds a full copy of the model and optimizer state, so when writes (or
    uploads to object storage) are slower than the save interval, an unbounded queue grows until
    memory runs out. Here a new save first waits for the earlier ones to finish, and says how long
    training waited: the cue to checkpoint less often or to faster storage.
    """

    #: A wait shorter than this is logged at DEBUG only (still counted in ``waits`` and ``waited_s``).
    warn_after_s = 1.0

    def __init__(self, checkpoint_io: CheckpointIO | None = None) -> None:
        super().__init__(checkpoint_io)
        self._drained: Future | None = None
        #: Seconds each save waited for the previous one (0.0 when storage kept up); the rest of a save's
        #: stall is staging, the copy into the buffer.
        self.save_waits_s: list[float] = []
        #: The staging buffer: one preallocated tensor per tensor of the checkpoint, in traversal order.
        self._staging: list[torch.Tensor | None] = []
        #: Staging tensors (re)allocated so far: as many as the state has tensors, once, when shapes stay put.
        self.allocations = 0

    def _stage(self, checkpoint: Any) -> Any:
        """A copy of ``checkpoint`` whose tensors are ``copy_``-ed into the reused staging buffer.

        ``clone()`` allocates the whole state again at every save (~2 GB/s here); ``copy_`` into
        memory allocated once runs at memory-copy speed (~11 GB/s). Only the caller may write the
        buffer, and only once the writer is done with it: ``save_checkpoint`` waits for the previous
        save to finish before staging the next (the bound of one in flight). A CUDA tensor is staged
        in pinned host memory (one stream synchronize per save); a tensor subclass (e.g. a DTensor)
        or a sparse tensor is cloned as before.
        """
        index = 0
        cuda = False

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal index, cuda
            tensor = tensor.detach()
            if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
                return tensor.clone()
            if index == len(self._staging):
                self._staging.append(None)
            buffer = self._staging[index]
            index += 1
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype or (
                    tensor.device.type != "cuda" and buffer.device != tensor.device):
                pin = tensor.device.type == "cuda"
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin,
                                     device="cpu" if pin else tensor.device)
                self._staging[index - 1] = buffer
                self.allocations += 1
            cuda = cuda or tensor.device.type == "cuda"
            buffer.copy_(tensor, non_blocking=tensor.device.type == "cuda")
            return buffer

        def stage(obj: Any) -> Any:
            # Lightning's apply_to_collection handles every container but pays microseconds per element (a
            # long list of ints, as RNG states once were, cost milliseconds per save). The common containers are
            # walked here; any other type (a dataclass, a namedtuple, a defaultdict) goes to it as before.
            kind = type(obj)
            if kind in _ATOMS:
                return obj
            if kind is torch.Tensor or isinstance(obj, torch.Tensor):
                return copy(obj)
            if kind is dict or kind is OrderedDict:
                return kind((key, stage(value)) for key, value in obj.items())
            if kind is list or kind is tuple:
                if all(type(item) in _ATOMS for item in obj):
                    return kind(obj)  # a fresh container: training may change its own later
                return kind(stage(item) for item in obj)
            return apply_to_collection(obj, torch.Tensor, copy)

        staged = stage(checkpoint)
        del self._staging[index:]  # tensors the state no longer has
        if cuda:
            torch.cuda.current_stream().synchronize()  # the non-blocking copies have landed
        return staged

    @override
    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        self._wait_for_previous()
        executor = async_executor(self)
        if "checkpoint" in kwargs:
            kwargs = {**kwargs, "checkpoint": self._stage(kwargs["checkpoint"])}
        elif args:
            args = (self._stage(args[0]), *args[1:])
        inner = self.checkpoint_io

        def save(*a: Any, **kw: Any) -> None:
            try:
                assert inner is not None
                inner.save_checkpoint(*a, **kw)
            except BaseException as ex:
                set_async_error(self, ex)

        executor.submit(save, *args, **kwargs)
        self._drained = executor.submit(lambda: None)  # done once every earlier save is
        error = async_error(self)
        if error:  # a save submitted earlier failed
            raise error

    @override
    def teardown(self) -> None:
        super().teardown()
        self._staging = []  # the buffer is a full copy of the state: give it back with the executor

    def drain(self) -> None:
        """Block until every save submitted so far is written (the staging buffer stays for the next save)."""
        if self._drained is not None:
            self._drained.result()
        error = async_error(self)
        if error:
            raise error

    @property
    def waits(self) -> int:
        """Saves that had to wait for the previous one."""
        return sum(1 for waited in self.save_waits_s if waited > 0)

    @property
    def waited_s(self) -> float:
        """Seconds training spent waiting for earlier saves, in all."""
        return sum(self.save_waits_s)

    def _wait_for_previous(self) -> None:
        """Block until the save submitted before has been written: only then may its staging buffer be reused."""
        if self._drained is None or self._drained.done():
            self.save_waits_s.append(0.0)
        else:
            started = time.monotonic()
            self._drained.result()
            waited = time.monotonic() - started
            self.save_waits_s.append(waited)
            # a wait of a few steps is the queue doing its job; a long one is worth acting on
            log.log(logging.WARNING if waited >= self.warn_after_s else logging.DEBUG,
                    "The previous checkpoint was still being written/uploaded: training waited %.2f s before "
                    "the next save (%d such waits, %.1f s in all). Save less often or to faster storage.",
                    waited, self.waits, self.waited_s)

    def after_saves(self, task: Callable[[], Any], description: str) -> None:
        """Run ``task`` in the writer thread once the saves submitted before it are written; skip it if one failed.

        For what a save replaces (the old best checkpoint, saves beyond the ones to keep): it goes only once its
        successor is on disk (and uploaded), never when the successor failed, and never on the training thread.
        ``description`` names the task in the log ("remove checkpoint x").
        """
        executor = async_executor(self)

        def run() -> None:
            error = async_error(self)
            if error is not None:  # a save before it failed (a full disk): what it would replace must stay
                log.warning("Did not %s: the save before it failed (%s).", description, error)
                return
            try:
                task()
            except Exception as err:
                log.error("Could not %s: %s", description, err)

        executor.submit(run)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove in the writer thread, after the saves submitted before: the replaced best checkpoint goes
        only once its successor is written (and uploaded)."""
        inner = self.checkpoint_io
        assert inner is not None
        self.after_saves(functools.partial(inner.remove_checkpoint, path), f"remove checkpoint {path}")
