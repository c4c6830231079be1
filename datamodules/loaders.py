"""The resumable training loader every datamodule uses: shuffled, sharded over ranks, exact on resume.

:func:`stateful_train_loader` is a ``StatefulDataLoader`` over a :class:`PassSampler`: Lightning saves
its position in every checkpoint, and a resumed run sees exactly the batches an uninterrupted run
would have seen, on one device and under DDP alike, wherever the interruption fell and whatever
``limit_train_batches`` says (torch's plain ``DistributedSampler`` keeps no epoch in the loader state,
and torchdata's stateful one takes its epoch from Lightning's counter, which is one ahead after some
resumes).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import lightning.pytorch as pl
import torch
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from typing_extensions import override

__all__ = ["PassSampler", "batches_per_epoch", "stateful_train_loader"]


def batches_per_epoch(samples: int, batch_size: int, trainer: pl.Trainer) -> int:
    """Batches Lightning takes from a loader of ``samples`` per epoch, as ``limit_train_batches`` says."""
    batches = math.ceil(samples / batch_size)
    limit = getattr(trainer, "limit_train_batches", None)
    if limit is None:
        return batches
    if isinstance(limit, int) or (isinstance(limit, float) and limit > 1.0):
        return min(batches, int(limit))
    return max(1, int(batches * float(limit))) if limit > 0 else 0


class PassSampler(DistributedSampler):
    """A shuffled, rank-sharded sampler that counts its own passes over the data and resumes inside one.

    Pass ``p`` visits this rank's share of the permutation seeded with ``seed + p`` (exactly what
    ``DistributedSampler`` yields in epoch ``p``). The state is ``{"epoch": p, "yielded": k}``; the
    ``StatefulDataLoader`` saves and restores it, and a new iteration continues the current pass or,
    once it is complete, starts the next one.

    Which epoch is right after a resume depends on where the checkpoint was written, and two
    sources disagree: Lightning's epoch counter (``set_epoch``) is one ahead when the checkpoint was
    written in ``on_train_epoch_end`` or when ``max_steps`` cut the epoch short, while the loader
    restores no sampler state at all when its iterator had already finished (a checkpoint written
    at the end of the epoch's validation). So: once a state was restored, the sampler's own count
    rules the pass that follows, and later ``set_epoch`` calls keep the difference it found;
    without one, ``set_epoch`` starts the pass it names. A pass is complete once it gave
    ``samples_per_pass`` samples, which ``limit_train_batches`` makes fewer than the rank's share.
    The resume paths are tested against uninterrupted runs (``tests/test_loaders.py``).
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int,
                 samples_per_pass: int | None = None) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        #: Samples an epoch takes from this rank (fewer than its share under ``limit_train_batches``).
        self.samples_per_pass = min(self.num_samples, samples_per_pass or self.num_samples)
        self.yielded = 0
        self._restored = False  # a state was loaded and its first iteration has not started yet
        self._requested: int | None = None  # the last epoch Lightning asked for
        self._offset = 0  # pass = Lightning's epoch + offset, fixed by the first iteration after a restore

    @override
    def set_epoch(self, epoch: int) -> None:
        """Start pass ``epoch`` (shifted as a restored state says, see the class docstring)."""
        self._requested = epoch
        if not self._restored:
            self.epoch, self.yielded = epoch + self._offset, 0

    @override
    def __iter__(self) -> Iterator[int]:
        if self.yielded >= self.samples_per_pass:  # the previous pass is complete
            self.epoch += 1
            self.yielded = 0
        if self._restored:  # the restored state rules this pass; later epochs keep Lightning's spacing
            self._restored = False
            if self._requested is not None:
                self._offset = self.epoch - self._requested
        indices = list(super().__iter__())
        for index in indices[self.yielded:]:
            self.yielded += 1
            yield index

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.yielded = int(state_dict["yielded"])
        self._restored = True


def stateful_train_loader(
    dataset: Dataset,
    batch_size: int,
    seed: int,
    trainer: pl.Trainer | None,
    num_workers: int = 0,
) -> StatefulDataLoader:
    """A resumable, shuffled training loader sharded over the trainer's ranks (one process without a trainer).

    Args:
        dataset: the training set.
        batch_size: samples per batch on each rank.
        seed: seed of the shuffle; pass ``p`` over the data uses the permutation seeded ``seed + p``.
        trainer: the attached trainer (gives world size and rank); ``None`` means one process.
        num_workers: loader worker processes.
    """
    world_size = trainer.world_size if trainer is not None else 1
    rank = trainer.global_rank if trainer is not None else 0
    sampler = PassSampler(dataset, world_size, rank, seed)
    if trainer is not None:
        sampler.samples_per_pass = min(sampler.num_samples,
                                       batches_per_epoch(sampler.num_samples, batch_size, trainer) * batch_size)
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        # its own generator: creating an iterator then draws no number from the global torch RNG, so
        # the model's RNG stream does not depend on when a resumed run re-creates its iterators
        generator=torch.Generator().manual_seed(seed + rank),
    )
