"""scikit-learn's handwritten digits as a LightningDataModule: the embedded default data set.

The 1,797 8x8 images ship inside scikit-learn, so the default recipe trains on any machine
with no download. The train/val split is stratified and seeded, so it is the same on every
rank and every relaunch.

The training loader is a ``StatefulDataLoader`` over a :class:`PassSampler`: Lightning saves its
position in every checkpoint, and a resumed run sees exactly the batches an uninterrupted run
would have seen, on one device and under DDP alike, wherever the interruption fell (torch's
plain ``DistributedSampler`` keeps no epoch in the loader state, and torchdata's stateful one
takes its epoch from Lightning's counter, which is one ahead after some resumes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import lightning.pytorch as pl
import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from typing_extensions import override


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
    rules and ``set_epoch`` is ignored; without one, ``set_epoch`` starts the pass it names. Both
    resume paths are tested bitwise against uninterrupted runs.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.yielded = 0
        self._restored = False

    @override
    def set_epoch(self, epoch: int) -> None:
        """Start pass ``epoch``, unless a restored state says where we are (see the class docstring)."""
        if not self._restored:
            self.epoch, self.yielded = epoch, 0

    @override
    def __iter__(self) -> Iterator[int]:
        if self.yielded >= self.num_samples:  # the previous pass is complete
            self.epoch += 1
            self.yielded = 0
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
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=PassSampler(dataset, world_size, rank, seed),
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        # its own generator: creating an iterator then draws no number from the global torch RNG, so
        # the model's RNG stream does not depend on when a resumed run re-creates its iterators
        generator=torch.Generator().manual_seed(seed + rank),
    )


class DigitsDataModule(pl.LightningDataModule):
    """The bundled digits data set (10 classes, 1x8x8 images scaled to [0, 1]).

    Args:
        batch_size: samples per batch on each rank.
        val_fraction: share of the data held out for validation (stratified by class).
        split_seed: seed of the train/val split.
        shuffle_seed: seed of the training-order shuffle.
        num_workers: loader worker processes (0 is fastest for this tiny set).

    Raises:
        ValueError: when ``val_fraction`` is not in (0, 1) or ``batch_size`` < 1.

    Example::

        dm = DigitsDataModule(batch_size=64)
        dm.setup("fit")
        x, y = next(iter(dm.val_dataloader()))   # x: (64, 1, 8, 8), y: (64,)
    """

    num_classes = 10
    in_channels = 1
    image_size = 8

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.2,
        split_seed: int = 0,
        shuffle_seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"DigitsDataModule(val_fraction={val_fraction!r}) must lie in (0, 1).")
        if batch_size < 1:
            raise ValueError(f"DigitsDataModule(batch_size={batch_size!r}) must be >= 1.")
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.shuffle_seed = shuffle_seed
        self.num_workers = num_workers
        self._split: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if self._split is None:
            digits = load_digits()
            x = (digits.images / 16.0).astype(np.float32)
            y = digits.target.astype(np.int64)
            x_tr, x_va, y_tr, y_va = train_test_split(
                x, y, test_size=self.val_fraction, stratify=y, random_state=self.split_seed
            )
            self._split = (x_tr, y_tr, x_va, y_va)
        return self._split

    def setup(self, stage: str | None = None) -> None:
        x_tr, y_tr, x_va, y_va = self._arrays()
        self.train_set = TensorDataset(torch.from_numpy(x_tr).unsqueeze(1), torch.from_numpy(y_tr))
        self.val_set = TensorDataset(torch.from_numpy(x_va).unsqueeze(1), torch.from_numpy(y_va))

    def train_dataloader(self) -> StatefulDataLoader:
        return stateful_train_loader(
            self.train_set, self.batch_size, self.shuffle_seed, self.trainer, self.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        # Every rank evaluates the whole (small) validation set: exact metrics, no padding.
        return DataLoader(self.val_set, batch_size=256, shuffle=False, num_workers=0)

    def baseline_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Flat ``(x_train, y_train, x_val, y_val)`` views for the scikit-learn baselines."""
        x_tr, y_tr, x_va, y_va = self._arrays()
        return x_tr.reshape(len(x_tr), -1), y_tr, x_va.reshape(len(x_va), -1), y_va

    def fingerprint(self) -> str:
        """SHA-256 of the training and validation arrays: changes whenever the data does."""
        digest = hashlib.sha256()
        for array in self._arrays():
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()

    def example_input(self) -> torch.Tensor:
        """One batch-of-one input, as the logged model's input example."""
        return torch.from_numpy(self._arrays()[2][:1]).unsqueeze(1)
