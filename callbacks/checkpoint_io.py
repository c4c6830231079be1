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

A :class:`PublishGate` holds each checkpoint's publication (its record) until what training logged through
its step is durable: a relaunch resumes from the newest published checkpoint and never logs the steps
before it again.

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
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from .storage import ckpt_store
from .storage.remote_store import RemoteCheckpoints
from .utils.compat import async_error, async_executor, set_async_error

log = logging.getLogger(__name__)

#: Key of the checkpoint's block of run metadata, copied into the integrity record.
RUN_METADATA_KEY = "atscale"


#: Key, in a checkpoint's record, of the metric points logged before it that the tracking store had not
#: confirmed when it was published: a relaunch from it logs those the store lacks.
METRICS_PENDING_KEY = "metrics_pending"


class MetricsNotDurable(RuntimeError):
    """The tracking store refused metrics the run logged. The checkpoints published since carry the points (a
    relaunch logs them); the run stops at its next save. Its ``__cause__`` is the store's error."""


#: What a logger says of the points logged so far: those the store has not confirmed, and its first refusal.
Unconfirmed = Callable[[], "tuple[list[Any], BaseException | None]"]


class PublishGate:
    """Publishes a checkpoint once training has logged its step, with the points the store has not confirmed.

    A relaunch resumes after the newest published checkpoint and never logs the steps before it again, but
    metrics reach the tracking store through a buffered queue (seconds behind), and training logs step N's
    metrics after the hook that saved step N. So a save written by a writer thread is published (its record
    written) on a publisher thread of its own once the training loop has passed step N (:meth:`passed`, from
    the next step's start), and its record carries the points logged so far that the store has not confirmed
    (``unconfirmed``, under :data:`METRICS_PENDING_KEY`): a kill at any moment leaves every point of the steps
    before a published checkpoint either in the store or in its record. Neither the step nor the writer waits;
    the publication trails the save by one step. When the training thread waits for the publications
    (:meth:`drain`: a notice save, the end) they go at once; a save written on the training thread (a sharded
    checkpoint, no writer) is published at once, before its step's own metrics are logged.

    A refusal of the store (a full disk) is raised as :class:`MetricsNotDurable` at the training thread's
    next save: the run stops there, and its relaunch restores the refused points from the record.

    No library offers this ordering (Lightning's checkpoint IO and loggers know nothing of each other).

    Args:
        unconfirmed: the logger's points not yet confirmed by the store, and the store's first refusal.
        timeout_s: the longest a publication waits for the training loop; then it goes with a warning.
    """

    def __init__(self, unconfirmed: Unconfirmed, timeout_s: float = 300.0) -> None:
        self.unconfirmed, self.timeout_s = unconfirmed, timeout_s
        self._cond = threading.Condition()
        self._logged_through: float = -1
        self._waiting_for: float | None = None  # the step a publication waits for the training loop to pass
        self._submitted = 0  # saves handed to the writer so far
        self._release_upto = 0  # saves submitted before the training thread last waited for publications
        self._publisher: ThreadPoolExecutor | None = None
        self._last: Future | None = None  # the last task handed to the publisher
        self._error: BaseException | None = None
        self._local = threading.local()  # the save the calling thread is writing (a writer's submission number)

    @property
    def current(self) -> int | None:
        """The submission number of the save this thread is writing (``None``: not a writer's save)."""
        return getattr(self._local, "seq", None)

    @current.setter
    def current(self, seq: int | None) -> None:
        self._local.seq = seq

    def passed(self, step: float) -> None:
        """The training loop has logged every step before ``step`` (called at a step's start, training thread).

        Without a lock unless a publication waits for this step: taking the condition's lock at every step put the
        training thread behind the publisher whenever it held it. One thread writes ``_logged_through`` (a single
        reference store); a publication announces the step it waits for before it reads it (:meth:`_when_logged`),
        so one of the two always sees the other.
        """
        if step <= self._logged_through:
            return
        self._logged_through = step
        waiting = self._waiting_for
        if waiting is not None and step >= waiting:
            with self._cond:
                self._cond.notify_all()

    def finish(self) -> None:
        """Training is over: every step is logged."""
        self.passed(math.inf)

    def submit(self) -> int:
        """A save is handed to the writer (training thread); returns its submission number."""
        with self._cond:
            self._submitted += 1
            return self._submitted - 1

    def publish(self, step: int, publish: Callable[[list[Any]], None]) -> None:
        """Run ``publish(points)`` (record, upload) once step ``step`` is logged (see the class docstring)."""
        seq = self.current
        if seq is None:
            self._publish(step, publish)
        else:
            self.then(functools.partial(self._when_logged, seq, step, publish))

    def then(self, task: Callable[[], Any]) -> None:
        """Run ``task`` on the publisher thread after the publications handed over before it."""
        if self._publisher is None:
            self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atscale-publish")

        def run() -> None:
            try:
                task()
            except BaseException as err:
                self._fail(err)

        self._last = self._publisher.submit(run)

    def _fail(self, err: BaseException) -> None:
        with self._cond:
            self._error = self._error or err

    def _when_logged(self, seq: int, step: int, publish: Callable[[list[Any]], None]) -> None:
        with self._cond:
            self._waiting_for = step  # before the predicate reads _logged_through: see passed()
            try:
                logged = self._cond.wait_for(lambda: seq < self._release_upto or self._logged_through >= step,
                                             self.timeout_s)
            finally:
                self._waiting_for = None
            if not logged:
                log.warning("Checkpoint of step %d published %.0f s after it was written, before training logged "
                            "that step: its metrics may be missing from it.", step, self.timeout_s)
        self._publish(step, publish)

    def _publish(self, step: int, publish: Callable[[list[Any]], None]) -> None:
        points, refused = self.unconfirmed()
        if refused is not None:  # said before the record exists: whoever sees the record can see the refusal
            error = MetricsNotDurable(f"the tracking store refused metrics logged through step {step} "
                                      f"({refused.__cause__ or refused}); the checkpoint of step {step} carries "
                                      "them: the relaunch logs them")
            error.__cause__ = refused
            self._fail(error)
        publish(points)

    def check(self) -> None:
        """Raise (once) what a publication raised, without waiting (training thread, at its next save)."""
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _release_all(self) -> None:
        """The training thread waits for the publications: those handed over so far go without waiting."""
        with self._cond:
            self._release_upto = self._submitted
            self._cond.notify_all()

    def settled(self) -> bool:
        """Whether every publication handed over so far is done."""
        return self._last is None or self._last.done()

    def settle(self) -> None:
        """Wait for the publications handed over so far (training thread, before its next save when saves are
        uploaded: one save in flight at most, its upload included, as the writer bounds the writes). They go at
        once: the training thread is past their steps' logging."""
        self._release_all()
        if self._last is not None:
            self._last.result()

    def drain(self) -> None:
        """Wait for every publication handed over so far (training thread); raise the first one that failed."""
        self._release_all()
        if self._publisher is not None:  # its thread ends too: a later save starts another
            self._publisher.shutdown(wait=True)
            self._publisher, self._last = None, None
        self.check()


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temporary file, fsync, rename, write the integrity record; then upload, if mirrored.

    Args:
        mirror: the run's checkpoint directory in object storage, or ``None`` for a local run.
        gate: holds each publication until the metrics of its steps are durable (``None``: publish at once).
    """

    def __init__(self, mirror: RemoteCheckpoints | None = None, gate: PublishGate | None = None) -> None:
        super().__init__()
        self.mirror = mirror
        self.gate = gate
        #: Uploads that failed (each logged as an error); the run goes on with its local checkpoints.
        self.upload_failures = 0

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got {storage_options!r}).")
        # atomic_write raises the OSError that torch.save's zip writer wraps in a RuntimeError
        try:
            size, sha256 = ckpt_store.atomic_write(path, lambda handle: torch.save(checkpoint, handle))
        except OSError as err:  # ENOSPC, EDQUOT, EIO...: say what was kept, keep the errno
            raise OSError(err.errno, f"could not write checkpoint {path} ({err.strerror or err}); "
                                     "nothing was replaced: the previous checkpoints are intact") from err
        publish = functools.partial(self._publish, path, checkpoint, size, sha256)
        if self.gate is not None:
            self.gate.publish(int(checkpoint.get("global_step", 0)), publish)
        else:
            publish()

    def _publish(self, path: str | os.PathLike, checkpoint: dict[str, Any], size: int, sha256: str,
                 points: list[Any] | None = None) -> None:
        """The integrity record (which makes the checkpoint good), then the upload."""
        # the run metadata without the per-rank RNG states (they stay in the checkpoint)
        extra = {k: v for k, v in checkpoint.get(RUN_METADATA_KEY, {}).items() if k != "rng"}
        if points:
            extra[METRICS_PENDING_KEY] = points
        try:
            ckpt_store.write_record(
                path,
                global_step=checkpoint.get("global_step", 0),
                epoch=checkpoint.get("epoch", 0),
                size=size,
                sha256=sha256,
                extra=extra,
            )
        except OSError as err:  # the disk filled up between the two: an unrecorded checkpoint is never used
            Path(path).unlink(missing_ok=True)  # so free its space
            raise OSError(err.errno, f"could not write the record of checkpoint {path} ({err.strerror or err}); "
                                     "it was removed: the previous checkpoints are intact") from err
        if self.mirror is not None:
            if not self.mirror.try_publish(path):
                self.upload_failures += 1

    @override
    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        ckpt_store.remove(path)
        if self.mirror is not None:
            self.mirror.try_remove(Path(path).name)


def atomic_io_of(io: CheckpointIO | None) -> AtomicCheckpointIO | None:
    """The ``AtomicCheckpointIO`` behind a trainer's checkpoint IO (seen through ``AsyncCheckpointIO``), if any."""
    while io is not None:
        if isinstance(io, AtomicCheckpointIO):
            return io
        io = getattr(io, "checkpoint_io", None)
    return None


def require_atomic_io(trainer: Any, owner: str) -> None:
    """Give ``trainer`` an :class:`AtomicCheckpointIO`, or refuse at setup with one line naming what is missing.

    The callbacks that save (``SpotCheckpoint``, ``PublishedModelCheckpoint``) find, verify and prune their
    checkpoints by the integrity records this IO writes; a plain ``Trainer`` has Lightning's
    ``TorchCheckpointIO``, which writes none: pruning then keeps every save and a resume finds no good
    checkpoint, with no warning. So Lightning's own IO (alone, or inside ``AsyncCheckpointIO``) is replaced
    by this one; any other IO is the user's and cannot be wrapped safely: refused with a ``ValueError``.
    """
    strategy = trainer.strategy
    io = strategy.checkpoint_io
    if atomic_io_of(io) is not None:
        return
    if type(io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()
        return
    if isinstance(io, AsyncCheckpointIO) and type(io.checkpoint_io) in (TorchCheckpointIO, type(None)):
        strategy.checkpoint_io = type(io)(AtomicCheckpointIO())  # the wrapper's own setter keeps its first IO
        return
    raise ValueError(f"{owner} needs the trainer's checkpoint IO to be AtomicCheckpointIO (it writes the integrity "
                     f"records that pruning and resume read), but the trainer has {type(io).__name__}: pass "
                     "plugins=[AtomicCheckpointIO()] (or BoundedAsyncCheckpointIO(AtomicCheckpointIO())) to the "
                     "Trainer.")


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
        #: The wrapped IO's publish gate: released whenever the training thread waits for this writer.
        self.gate: PublishGate | None = getattr(checkpoint_io, "gate", None)
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
        if self.gate is not None:
            self.gate.check()  # a publication failed (its metrics did not reach the store): stop here
        self._wait_for_previous()
        executor = async_executor(self)
        if "checkpoint" in kwargs:
            kwargs = {**kwargs, "checkpoint": self._stage(kwargs["checkpoint"])}
        elif args:
            args = (self._stage(args[0]), *args[1:])
        inner, gate = self.checkpoint_io, self.gate
        seq = gate.submit() if gate is not None else None

        def save(*a: Any, **kw: Any) -> None:
            try:
                assert inner is not None
                if gate is not None:
                    gate.current = seq
                inner.save_checkpoint(*a, **kw)
            except BaseException as ex:
                set_async_error(self, ex)
            finally:
                if gate is not None:
                    gate.current = None

        executor.submit(save, *args, **kwargs)
        self._drained = executor.submit(lambda: None)  # done once every earlier save is
        error = async_error(self)
        if error:  # a save submitted earlier failed
            raise error

    @override
    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self._staging = []  # the buffer is a full copy of the state: give it back with the executor
        if self.gate is not None:  # the saves are written: wait for their publication (a notice save's too)
            self.gate.drain()  # the buffer is a full copy of the state: give it back with the executor

    def drain(self) -> None:
        """Block until every save submitted so far is written and published (the staging buffer stays)."""
        if self._drained is not None:
            self._drained.result()
        error = async_error(self)
        if error:
            raise error
        if self.gate is not None:
            self.gate.drain()

    @property
    def waits(self) -> int:
        """Saves that had to wait for the previous one."""
        return sum(1 for waited in self.save_waits_s if waited > 0)

    @property
    def waited_s(self) -> float:
        """Seconds training spent waiting for earlier saves, in all."""
        return sum(self.save_waits_s)

    def _wait_for_previous(self) -> None:
        """Block until the save submitted before has been written (only then may its staging buffer be reused)
        and, when it is uploaded, published (its upload included: one save in flight at most).

        A local run's publication (the integrity record, the pruning) holds no memory and is not waited for: at an
        epoch's end the best checkpoint's save came right after the spot save and waited 16 ms for its record
        (the digits recipe: 0.16 s of a 7 s ``trainer.fit``). The publisher keeps them in order either way.
        """
        gate = self.gate if mirror_of(self.checkpoint_io) is not None else None
        published = gate is None or gate.settled()
        if (self._drained is None or self._drained.done()) and published:
            self.save_waits_s.append(0.0)
        else:
            started = time.monotonic()
            if self._drained is not None:
                self._drained.result()
            if gate is not None:
                gate.settle()
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

        # what a save replaces goes only once the save is published, which a gate may hold past the write
        gate = self.gate
        executor.submit(run if gate is None else functools.partial(gate.then, run))

    @override
    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Remove in the writer thread, after the saves submitted before: the replaced best checkpoint goes
        only once its successor is written (and uploaded)."""
        inner = self.checkpoint_io
        assert inner is not None
        self.after_saves(functools.partial(inner.remove_checkpoint, path), f"remove checkpoint {path}")
