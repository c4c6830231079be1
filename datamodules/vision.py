"""MNIST and CIFAR-10 as LightningDataModules: torchvision's loaders, held in memory as tensors.

The step up from the bundled digits: real benchmark sets, read by torchvision's own
``torchvision.datasets.MNIST`` / ``CIFAR10`` classes (so the on-disk layout and integrity checks
are torchvision's), then decoded once into in-memory tensors. Both sets are small (47 MB and
150 MB as uint8), so the training loop indexes tensors instead of building a PIL image and
running a transform per sample, which would make the data loader the bottleneck of a small model.

The official training set is split into train and validation, stratified by class and seeded by
``split_seed``, so the split is the same on every rank and every relaunch. The official test set
is never loaded: it stays untouched for a final, once-only evaluation. The training loader is
:func:`datamodules.loaders.stateful_train_loader`, so a resumed run sees exactly the batches an
uninterrupted one would have.

Files: ``prepare_data`` downloads them (Lightning calls it on one process per node before
``setup``) into ``root/MNIST/raw/`` or ``root/cifar-10-batches-py/``. On a machine without
network access, put them there yourself (the four uncompressed MNIST IDX files; the extracted
``cifar-10-python.tar.gz``) and pass ``download: false``: missing files then raise
``FileNotFoundError`` at construction, before any training starts.

Config example (the ``data`` section of a recipe config)::

    data:
      class_path: datamodules.vision.CIFAR10DataModule
      init_args:
        root: data/            # holds cifar-10-batches-py/
        download: true
        batch_size: 256
        val_fraction: 0.1      # 45,000 train / 5,000 val images

Copy with it (paths under ``datamodules/``): ``loaders.py``, ``compat.py``, ``worker_signals.py``.
"""

from __future__ import annotations

import hashlib
import os
from typing import ClassVar

import lightning.pytorch as pl
import numpy as np
import torch
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchvision.datasets import CIFAR10, MNIST

from .loaders import stateful_train_loader

Split = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class _InMemoryVisionDataModule(pl.LightningDataModule):
    """Loading, splitting, scaling and loaders shared by the torchvision image sets below.

    A subclass names its torchvision class, folder, files and per-channel statistics, and reads
    the official training set as ``uint8`` images ``(N, C, H, W)`` with ``int64`` labels.
    """

    dataset_cls: ClassVar[type[MNIST] | type[CIFAR10]]
    dataset_name: ClassVar[str]
    source_hint: ClassVar[str]
    num_classes = 10
    in_channels: ClassVar[int]
    image_size: ClassVar[int]
    mean: ClassVar[tuple[float, ...]]
    std: ClassVar[tuple[float, ...]]

    def __init__(
        self,
        root: str = "data/",
        download: bool = True,
        batch_size: int = 128,
        val_fraction: float = 0.1,
        split_seed: int = 0,
        shuffle_seed: int = 0,
        num_workers: int = 0,
        normalize: bool = True,
        baseline_subsample: int = 10000,
    ) -> None:
        """Configure the data set; nothing is read until ``setup`` (or a baseline/fingerprint call).

        Args:
            root: folder holding the data set's folder (``MNIST/`` or ``cifar-10-batches-py/``).
            download: fetch the files when they are missing; with ``False`` they must be there.
            batch_size: samples per batch on each rank.
            val_fraction: share of the official training set held out for validation
                (stratified by class); the official test set is never used.
            split_seed: seed of the train/val split and of the baselines' subsample.
            shuffle_seed: seed of the training-order shuffle.
            num_workers: loader worker processes (0 is fastest: the data are in-memory tensors).
            normalize: subtract the data set's per-channel mean and divide by its std, after
                scaling pixels to [0, 1].
            baseline_subsample: the scikit-learn baselines fit on at most this many training
                rows and score on at most this many validation rows, each a uniform sample
                without replacement seeded by ``split_seed`` (all rows when a split is smaller),
                which keeps kernel and tree baselines affordable on the 50,000-image sets.

        Raises:
            ValueError: when ``val_fraction`` is not in (0, 1), or ``batch_size`` or
                ``baseline_subsample`` is < 1.
            FileNotFoundError: when ``download`` is ``False`` and the data files are missing.
        """
        super().__init__()
        name = type(self).__name__
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"{name}(val_fraction={val_fraction!r}) must lie in (0, 1).")
        if batch_size < 1:
            raise ValueError(f"{name}(batch_size={batch_size!r}) must be >= 1.")
        if baseline_subsample < 1:
            raise ValueError(f"{name}(baseline_subsample={baseline_subsample!r}) must be >= 1.")
        self.root = os.path.expanduser(str(root))
        self.download = download
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.shuffle_seed = shuffle_seed
        self.num_workers = num_workers
        self.normalize = normalize
        self.baseline_subsample = baseline_subsample
        self._split: Split | None = None
        self._sets: tuple[TensorDataset, TensorDataset] | None = None
        if not download:
            self._ensure_files()

    # --- what a subclass provides -------------------------------------------------------------

    def _folder(self) -> str:
        """The folder torchvision reads the files from."""
        raise NotImplementedError

    def _required_files(self) -> list[str]:
        """The file names torchvision requires in :meth:`_folder` (train and test alike)."""
        raise NotImplementedError

    def _read_train(self) -> tuple[np.ndarray, np.ndarray]:
        """The official training set: ``uint8`` images ``(N, C, H, W)`` and ``int64`` labels."""
        raise NotImplementedError

    # --- files -------------------------------------------------------------------------------

    def _ensure_files(self) -> None:
        folder = os.path.abspath(self._folder())
        missing = [f for f in self._required_files() if not os.path.isfile(os.path.join(folder, f))]
        if not missing:
            return
        name = type(self).__name__
        if not self.download:
            raise FileNotFoundError(
                f"{name}(root={self.root!r}, download=False): the {self.dataset_name} files are "
                f"missing from '{folder}' ({', '.join(missing)}). Pass `download: true` to fetch "
                f"them, or place them there ({self.source_hint})."
            )
        try:
            self.dataset_cls(self.root, train=True, download=True)
        except Exception as err:  # URLError, RuntimeError, ssl/socket errors: all mean "no files"
            raise RuntimeError(
                f"{name}: downloading {self.dataset_name} into '{folder}' failed ({err}). Without "
                f"network access, place the files there yourself ({self.source_hint}), then pass "
                f"`download: false`."
            ) from err

    def prepare_data(self) -> None:
        """Download the files when missing; Lightning calls this on one process per node."""
        self._ensure_files()

    # --- arrays ------------------------------------------------------------------------------

    def _arrays(self) -> Split:
        """The ``uint8`` train/val split of the official training set, read once."""
        if self._split is None:
            self._ensure_files()
            try:
                x, y = self._read_train()
            except RuntimeError as err:  # torchvision: "Dataset not found or corrupted"
                raise RuntimeError(
                    f"{type(self).__name__}: torchvision could not read {self.dataset_name} from "
                    f"'{os.path.abspath(self._folder())}' ({err}). Delete the folder and pass "
                    f"`download: true`, or replace the files ({self.source_hint})."
                ) from err
            idx_tr, idx_va = train_test_split(
                np.arange(len(y)), test_size=self.val_fraction, stratify=y, random_state=self.split_seed
            )
            idx_tr.sort()
            idx_va.sort()
            self._split = (x[idx_tr], y[idx_tr], x[idx_va], y[idx_va])
        return self._split

    def _scaling(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        if self.normalize:
            return self.mean, self.std
        return (0.0,) * self.in_channels, (1.0,) * self.in_channels

    def _scale(self, images: np.ndarray) -> np.ndarray:
        """``uint8`` ``(N, C, H, W)`` to float32 in [0, 1], then ``(x - mean) / std`` per channel."""
        mean, std = (np.asarray(v, dtype=np.float32).reshape(1, -1, 1, 1) for v in self._scaling())
        out = images.astype(np.float32)
        out /= np.float32(255.0)
        out -= mean
        out /= std
        return out

    # --- Lightning ---------------------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        if self._sets is None:
            x_tr, y_tr, x_va, y_va = self._arrays()
            self._sets = (
                TensorDataset(torch.from_numpy(self._scale(x_tr)), torch.from_numpy(y_tr)),
                TensorDataset(torch.from_numpy(self._scale(x_va)), torch.from_numpy(y_va)),
            )
        self.train_set, self.val_set = self._sets

    def train_dataloader(self) -> StatefulDataLoader:
        return stateful_train_loader(
            self.train_set, self.batch_size, self.shuffle_seed, self.trainer, self.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        # Every rank evaluates the whole validation set: exact metrics, no padding.
        return DataLoader(self.val_set, batch_size=256, shuffle=False, num_workers=0)

    # --- recipe hooks ------------------------------------------------------------------------

    def baseline_arrays(self) -> Split:
        """Flat float32 ``(x_train, y_train, x_val, y_val)`` for the scikit-learn baselines.

        Rows are scaled as the model sees them. Each split is capped at ``baseline_subsample``
        rows: a uniform sample without replacement, seeded by ``split_seed`` and kept in data
        order; a split with fewer rows is returned whole.
        """
        x_tr, y_tr, x_va, y_va = self._arrays()
        rng = np.random.default_rng(self.split_seed)
        rows = []
        for n in (len(y_tr), len(y_va)):
            if n <= self.baseline_subsample:
                rows.append(np.arange(n))
            else:
                rows.append(np.sort(rng.choice(n, size=self.baseline_subsample, replace=False)))
        tr, va = rows
        return (
            self._scale(x_tr[tr]).reshape(len(tr), -1),
            y_tr[tr],
            self._scale(x_va[va]).reshape(len(va), -1),
            y_va[va],
        )

    def fingerprint(self) -> str:
        """SHA-256 of the split's pixels and labels and of the scaling: changes whenever the data does."""
        digest = hashlib.sha256(repr((self.dataset_name, self._scaling())).encode())
        for array in self._arrays():
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()

    def example_input(self) -> torch.Tensor:
        """One batch-of-one input, as the logged model's input example."""
        return torch.from_numpy(self._scale(self._arrays()[2][:1]))


class MNISTDataModule(_InMemoryVisionDataModule):
    """MNIST handwritten digits: 10 classes, 1x28x28 images, 60,000 official training images.

    Files: ``root/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`` (uncompressed IDX).
    torchvision checks only that they exist; a torchvision download verifies the ``.gz`` md5s.

    Example::

        dm = MNISTDataModule(root="data/", batch_size=128)
        dm.prepare_data()                            # downloads into data/MNIST/raw/ if missing
        dm.setup("fit")
        x, y = next(iter(dm.train_dataloader()))     # x: (128, 1, 28, 28), y: (128,)
    """

    dataset_cls = MNIST
    dataset_name = "MNIST"
    source_hint = (
        f"the four IDX files gunzipped from {MNIST.mirrors[0]}: "
        f"{', '.join(os.path.splitext(f)[0] for f, _ in MNIST.resources)}"
    )
    in_channels = 1
    image_size = 28
    mean = (0.1307,)
    std = (0.3081,)

    def _folder(self) -> str:
        return os.path.join(self.root, "MNIST", "raw")

    def _required_files(self) -> list[str]:
        return [os.path.splitext(f)[0] for f, _ in MNIST.resources]

    def _read_train(self) -> tuple[np.ndarray, np.ndarray]:
        data = MNIST(self.root, train=True, download=False)
        return data.data.numpy()[:, None], data.targets.numpy().astype(np.int64)


class CIFAR10DataModule(_InMemoryVisionDataModule):
    """CIFAR-10: 10 classes, 3x32x32 colour images, 50,000 official training images.

    Files: ``root/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}`` (Python
    pickles). torchvision verifies every file's md5 on each load, so altered files are rejected.

    Example::

        dm = CIFAR10DataModule(root="data/", batch_size=256)
        dm.prepare_data()                            # downloads into data/cifar-10-batches-py/
        dm.setup("fit")
        x, y = next(iter(dm.train_dataloader()))     # x: (256, 3, 32, 32), y: (256,)
    """

    dataset_cls = CIFAR10
    dataset_name = "CIFAR-10"
    source_hint = f"extract {CIFAR10.url} into root, giving {CIFAR10.base_folder}/"
    in_channels = 3
    image_size = 32
    mean = (0.4914, 0.4822, 0.4465)
    std = (0.2470, 0.2435, 0.2616)

    def _folder(self) -> str:
        return os.path.join(self.root, CIFAR10.base_folder)

    def _required_files(self) -> list[str]:
        names = [f for f, _ in CIFAR10.train_list + CIFAR10.test_list]
        return [*names, CIFAR10.meta["filename"]]

    def _read_train(self) -> tuple[np.ndarray, np.ndarray]:
        data = CIFAR10(self.root, train=True, download=False)
        images = np.ascontiguousarray(data.data.transpose(0, 3, 1, 2))  # torchvision gives NHWC
        return images, np.asarray(data.targets, dtype=np.int64)
