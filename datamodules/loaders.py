"""The resumable training loader every datamodule uses: shuffled, sharded over ranks, exact on resume.

:func:`stateful_train_loader` is a :class:`ResumableLoader` (a torchdata ``StatefulDataLoader``) over a
:class:`PassSampler`: Lightning saves its position in every checkpoint, and a resumed run sees exactly the
batches an uninterrupted run would have seen, on one device and under DDP alike, wherever the
interruption fell and whatever ``limit_train_batches`` says.

The position is global: how many samples of the pass's permutation all ranks together have consumed
(the cursor), not one rank's count. A run that comes back on another number of processes continues the
interrupted pass with exactly the samples not yet trained, each once, split over its own ranks, and
later passes are what a run at the new world size would have (torch's ``DistributedSampler`` and
torchdata's stateful one keep a per-rank count, which replays or skips samples when the world changes).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader
from typing_extensions import override

from .compat import iterator_finished, sampler_state, saved_num_workers, served_sampler_state, with_sampler_state
from .worker_signals import notices_blocked, with_notices_ignored

__all__ = ["CURSOR_KEY", "PassSampler", "ResumableLoader", "batches_per_epoch", "stateful_train_loader"]

log = logging.getLogger(__name__)

#: Key of the loader's state that holds the global cursor (beside torchdata's own keys).
CURSOR_KEY = "global_cursor"


def batches_per_epoch(samples: int, batch_size: int, trainer: pl.Trainer) -> int:
    """Batches Lightning takes from a loader of ``samples`` per epoch, as ``limit_train_batches`` says."""
    batches = math.ceil(samples / batch_size)
    limit = getattr(trainer, "limit_train_batches", None)
    if limit is None:
        return batches
    if isinstance(limit, int) or (isinstance(limit, float) and limit > 1.0):
        return min(batches, int(limit))
    return max(1, int(batches * float(limit))) if limit > 0 else 0


class PassSampler(Sampler[int]):
    """A shuffled, rank-sharded sampler that counts its passes over the data and resumes inside one on any world.

    Pass ``p`` walks the permutation seeded with ``seed + p`` (``torch.randperm``, as ``DistributedSampler``
    draws it in epoch ``p``) up to ``samples_per_pass`` positions. A pass that starts at position ``s``
    gives rank ``r`` of ``W`` the positions ``s + r, s + r + W, ...``: after every rank took ``k``
    samples, the ranks together consumed positions ``[s, s + k W)``, and that global cursor is the state
    (``{"epoch": p, "yielded": cursor}``, plus ``"complete": True`` once the pass is done). Restored on
    any world size, the pass continues from the cursor, split over the ranks of the new world.

    No rank repeats a sample to even out the shards (``DistributedSampler`` pads): the ranks' last
    batches may differ by one sample, and every rank still gets the same number of batches, which DDP
    needs. Only when the pass's last round has fewer samples than ranks do the ranks without one take
    the round's first sample again (the one exception to "each sample once a pass").

    Which pass is right after a resume depends on where the checkpoint was written, and two sources
    disagree: Lightning's epoch counter (``set_epoch``) is one ahead when the checkpoint was written in
    ``on_train_epoch_end`` or when ``max_steps`` cut the epoch short, while the loader restores no
    sampler state at all when its iterator had already finished (a checkpoint written at the end of
    the epoch's validation). So: once a state was restored, the sampler's own count rules the pass that
    follows, and later ``set_epoch`` calls keep the difference it found; without one, ``set_epoch``
    starts the pass it names. The resume paths are tested against uninterrupted runs
    (``tests/unit/datamodules/test_loaders.py``, ``tests/e2e/test_elastic.py``).

    Args:
        dataset: the data (only its length is used).
        num_replicas: ranks in the world.
        rank: this rank.
        seed: seed of pass 0's permutation (pass ``p`` uses ``seed + p``).
        samples_per_pass: positions a pass consumes over all ranks (fewer than the data under
            ``limit_train_batches``); default: all.
        batch_size: samples per batch on each rank (decides how the pass's last round is split).
        order: the permutation of a pass, given its seed (``seed + p``); default ``torch.randperm`` of the
            data. It must depend on the seed alone, never on the world, so that every world walks one order
            (``datamodules.streaming`` passes a chunk-aware one).
        on_position: told ``(seed of the pass, position, index)`` before each index is handed out (a streamed
            dataset fetches ahead of it); it must not change the order.
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0, seed: int = 0,
                 samples_per_pass: int | None = None, batch_size: int = 1,
                 order: Callable[[int], Sequence[int]] | None = None,
                 on_position: Callable[[int, int, int], None] | None = None) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"PassSampler(rank={rank!r}) must lie in [0, num_replicas={num_replicas!r}).")
        self.dataset_size = len(dataset)  # type: ignore[arg-type]
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.batch_size = batch_size
        self.order = order
        self.on_position = on_position
        #: Positions of the permutation one pass consumes over all ranks.
        self.samples_per_pass = min(self.dataset_size, samples_per_pass or self.dataset_size)
        self.epoch = 0
        #: Positions of this pass consumed over all ranks (kept up to date while iterating).
        self.cursor = 0
        self.complete = False
        self._start = 0  # where this rank's current iteration began
        self._share = 0  # samples this rank gives in the current iteration
        self._taken = 0  # samples this rank gave so far in it
        self._iterating = False
        self._restored = False  # a state was loaded and its first iteration has not started yet
        self._requested: int | None = None  # the last epoch Lightning asked for
        self._offset = 0  # pass = Lightning's epoch + offset, fixed by the first iteration after a restore

    def __len__(self) -> int:
        """This rank's share of a whole pass over the data (Lightning applies ``limit_train_batches`` itself)."""
        return math.ceil(self.dataset_size / self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """Start pass ``epoch`` (shifted as a restored state says, see the class docstring)."""
        self._requested = epoch
        if self._iterating and self._taken < self._share and self.epoch == epoch + self._offset:
            # the pass is under way already: loader workers start drawing indices as soon as the iterator exists,
            # which can be before Lightning sets the epoch; resetting would lose the count of what was drawn
            return
        if not self._restored:
            self.epoch, self.cursor, self.complete, self._iterating = epoch + self._offset, 0, False, False

    def expect_epoch(self, epoch: int) -> None:
        """Be at the start of the pass Lightning's ``set_epoch(epoch)`` will ask for, unless a pass is under way or a
        restored state rules (see :meth:`ResumableLoader._announce_epoch`). Records no request: a state loaded after
        this call is read as if this call had not been made."""
        if not self._restored and not (self._iterating and self._taken < self._share):
            self.epoch, self.cursor, self.complete, self._iterating = epoch + self._offset, 0, False, False

    def permutation(self, epoch: int) -> Sequence[int]:
        """The order of pass ``epoch``: ``order(seed + epoch)``, else ``torch.randperm`` seeded ``seed + epoch``."""
        if self.order is not None:
            return self.order(self.seed + epoch)
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_size, generator=generator).tolist()

    def positions(self, start: int) -> list[int]:
        """The permutation positions this rank takes in a pass continued from ``start``."""
        end = self.samples_per_pass
        mine = list(range(start + self.rank, end, self.num_replicas))
        remaining = end - start
        if remaining > 0:
            rounds = math.ceil(remaining / (self.num_replicas * self.batch_size))
            if len(mine) <= (rounds - 1) * self.batch_size:  # the last round has no sample for this rank
                mine.append(start + (rounds - 1) * self.num_replicas * self.batch_size)
        return mine

    def batches_left(self, start: int) -> int:
        """Batches every rank takes in a pass continued from ``start`` (the same on all ranks)."""
        remaining = max(0, self.samples_per_pass - start)
        return math.ceil(remaining / (self.num_replicas * self.batch_size))

    def _sync_cursor(self) -> None:
        if self._iterating:
            if self._taken >= self._share:
                self.cursor, self.complete = self.samples_per_pass, True
            else:
                self.cursor = min(self.samples_per_pass, self._start + self._taken * self.num_replicas)

    @override
    def __iter__(self) -> Iterator[int]:
        self._sync_cursor()
        if self.complete or self.cursor >= self.samples_per_pass:  # the previous pass is complete
            self.epoch, self.cursor, self.complete = self.epoch + 1, 0, False
        if self._restored:  # the restored state rules this pass; later epochs keep Lightning's spacing
            self._restored = False
            if self._requested is not None:
                self._offset = self.epoch - self._requested
        order = self.permutation(self.epoch)
        mine = self.positions(self.cursor)
        self._start, self._share, self._taken, self._iterating = self.cursor, len(mine), 0, True
        told, seed = self.on_position, self.seed + self.epoch
        for position in mine:
            self._taken += 1
            if told is not None:
                told(seed, position, order[position])
            yield order[position]

    def state_dict(self) -> dict[str, Any]:
        self._sync_cursor()
        state: dict[str, Any] = {"epoch": self.epoch, "yielded": self.cursor}
        if self.complete:
            state["complete"] = True
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.cursor = int(state_dict["yielded"])
        self.complete = bool(state_dict.get("complete", False))
        self._iterating = False
        self._restored = True


class ResumableLoader(StatefulDataLoader):
    """A ``StatefulDataLoader`` whose saved state also holds the global cursor, read back on any world size.

    Lightning counts the batches of the epoch a checkpoint interrupted in its own loop state, in batches
    of the world that saved it. On a resume with another world size, this loader sets that count to
    what the new world would have run to reach the same cursor, so that Lightning's epoch end,
    validation and gradient accumulation fall where the data does (a private Lightning counter:
    ``trainer.fit_loop.epoch_loop.batch_progress``). On a resume with another number of workers (torchdata's own
    state fits only as many as saved it), the sampler continues from the cursor in a fresh iterator.
    """

    def __init__(self, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> None:
        # workers leave the notice signals to the main process (a signal to the whole group must not kill them)
        kwargs["worker_init_fn"] = with_notices_ignored(kwargs.get("worker_init_fn"))
        super().__init__(*args, **kwargs)
        self.trainer_ref = trainer
        #: ``(old world size, new world size)`` after a resume on another world size, else None.
        self.resharded: tuple[int, int] | None = None

    @override
    def __iter__(self) -> Iterator[Any]:
        self._announce_epoch()
        with notices_blocked():  # the workers fork here: a notice meanwhile must reach the main process only
            return super().__iter__()

    def _announce_epoch(self) -> None:
        """Tell the sampler the epoch Lightning is about to set, before workers start drawing from it.

        Lightning creates the training iterator before it calls ``set_epoch`` (``FitLoop.setup_data``, then
        ``on_advance_start``). Without workers the sampler runs only at the first batch, after ``set_epoch``; with
        workers the iterator prefetches at once, so the sampler ran with the epoch it last knew. A fresh run starts
        at epoch 0 and did not notice; a run resumed from an epoch-end checkpoint starts at epoch 1 or later and
        replayed pass 0 (found by a per-step trace of labels: the resume was not bitwise with ``num_workers > 0``).
        The epoch is the one Lightning passes next (its fit loop's processed epochs, a private counter as in
        :meth:`_align_lightning_count`). A state restored into the iterator still rules (torchdata applies it after
        this, inside ``__iter__``), and Lightning's own ``set_epoch`` then finds the pass it asks for under way.
        """
        progress = getattr(getattr(self.trainer_ref, "fit_loop", None), "epoch_progress", None)
        if self.num_workers > 0 and progress is not None and isinstance(self.sampler, PassSampler):
            self.sampler.expect_epoch(progress.current.processed)

    @override
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        sampler = self.sampler
        if isinstance(sampler, PassSampler):
            cursor = sampler.state_dict()
            # with workers, the sampler in this process has run ahead by the batches the workers prefetch; the
            # position at the last batch handed out is the one in torchdata's snapshot
            snapshot = served_sampler_state(state)
            if isinstance(snapshot, dict) and "yielded" in snapshot:
                cursor = dict(snapshot)
            state[CURSOR_KEY] = {**cursor, "complete": bool(cursor.get("complete") or iterator_finished(state)),
                                 "world_size": sampler.num_replicas}
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        cursor = state.pop(CURSOR_KEY, None)
        sampler = self.sampler
        # the sampler's own state is the global cursor already; only Lightning's count needs the new world's units
        saved_world = int(cursor["world_size"]) if cursor is not None else None
        nested = sampler_state(state)
        if cursor is None and isinstance(sampler, PassSampler) and isinstance(nested, dict) and "yielded" in nested:
            # a state of the per-rank sampler this one replaced (same world): its count was one rank's
            state = with_sampler_state(state, {
                **nested, "yielded": min(sampler.samples_per_pass, int(nested["yielded"]) * sampler.num_replicas)})
        if saved_world is not None and isinstance(sampler, PassSampler) and saved_world != sampler.num_replicas:
            self.resharded = (saved_world, sampler.num_replicas)
            done = bool(cursor.get("complete")) or int(cursor["yielded"]) >= sampler.samples_per_pass
            self._align_lightning_count(0 if done else sampler.batches_left(int(cursor["yielded"])))
        saved_workers = saved_num_workers(state)
        if cursor is not None and isinstance(sampler, PassSampler) and saved_workers not in (None, self.num_workers):
            # torchdata restores its state only into as many workers as saved it (an assertion otherwise): a fresh
            # iterator continues from the cursor, the whole position (its workers' seeds start anew: bitwise for
            # datamodules whose items draw no random numbers, as this project's)
            sampler.load_state_dict({k: cursor[k] for k in ("epoch", "yielded", "complete")})
            state = {}
        super().load_state_dict(state)

    def _align_lightning_count(self, batches_left: int) -> None:
        """Make Lightning's count of the epoch's batches ``its epoch length - batches_left``."""
        trainer = self.trainer_ref
        if trainer is None:
            return
        sampler = self.sampler
        assert isinstance(sampler, PassSampler)
        total = batches_per_epoch(len(sampler), self.batch_size or 1, trainer)
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        delta = (total - batches_left) - progress.ready
        for field in ("ready", "started", "processed", "completed"):
            setattr(progress, field, getattr(progress, field) + delta)


def stateful_train_loader(
    dataset: Dataset,
    batch_size: int,
    seed: int,
    trainer: pl.Trainer | None,
    num_workers: int = 0,
    order: Callable[[int], Sequence[int]] | None = None,
    loader_cls: type[ResumableLoader] | None = None,
    on_position: Callable[[int, int, int], None] | None = None,
) -> ResumableLoader:
    """A resumable, shuffled training loader sharded over the trainer's ranks (one process without a trainer).

    Args:
        dataset: the training set.
        batch_size: samples per batch on each rank.
        seed: seed of the shuffle; pass ``p`` over the data uses the permutation seeded ``seed + p``.
        trainer: the attached trainer (gives world size and rank); ``None`` means one process.
        num_workers: loader worker processes.
        order: the permutation of a pass given its seed (see :class:`PassSampler`); default ``torch.randperm``.
        loader_cls: the loader class (a :class:`ResumableLoader`); default :class:`ResumableLoader`.
        on_position: told each position the sampler hands out (see :class:`PassSampler`).
    """
    world_size = trainer.world_size if trainer is not None else 1
    rank = trainer.global_rank if trainer is not None else 0
    sampler = PassSampler(dataset, world_size, rank, seed, batch_size=batch_size, order=order,
                          on_position=on_position)
    if trainer is not None:
        sampler.samples_per_pass = min(sampler.dataset_size,
                                       batches_per_epoch(len(sampler), batch_size, trainer) * batch_size * world_size)
    return (loader_cls or ResumableLoader)(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        # its own generator: creating an iterator then draws no number from the global torch RNG, so
        # the model's RNG stream does not depend on when a resumed run re-creates its iterators
        generator=torch.Generator().manual_seed(seed + rank),
        trainer=trainer,
    )
