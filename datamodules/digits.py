"""scikit-learn's handwritten digits as a LightningDataModule: the embedded default data set.

The 1,797 8x8 images ship inside scikit-learn, so the default recipe trains on any machine
with no download. The train/val split is stratified and seeded, so it is the same on every
rank and every relaunch.

The training loader is :func:`datamodules.loaders.stateful_train_loader`: a resumed run sees exactly
the batches an uninterrupted run would have seen.

Copy with it (paths under ``datamodules/``): ``loaders.py``, ``compat.py``, ``worker_signals.py``.
"""

from __future__ import annotations

import hashlib

import lightning.pytorch as pl
import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from .loaders import stateful_train_loader


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
