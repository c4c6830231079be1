"""MNIST and CIFAR-10 datamodules on tiny files written in the real on-disk formats (no network).

torchvision's own ``MNIST`` / ``CIFAR10`` classes read the files. Each fake training image
encodes its id in its pixels (channel 0 is filled with the id, so 0..99; test images use
200..219), and its label is ``id % 10``: after the split, ids show where every image went.

CIFAR-10: torchvision verifies each file's md5 against the real release's on every load (not
only on download). Fake files cannot match those, so ``_pin_cifar_md5s`` sets torchvision's
expected md5s to those of the files written here; its ``check_integrity`` still runs unchanged.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision.datasets import CIFAR10, MNIST

from datamodules.vision import CIFAR10DataModule, MNISTDataModule
from tests.conftest import write_mnist

N_TRAIN, N_TEST = 100, 20
SPECIAL_ID, SPECIAL_PIXEL = 7, (3, 5)  # image 7's last channel holds 255 at row 3, column 5


def _pickle(path: Path, obj: dict) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def _write_cifar(root: Path, train: np.ndarray, test: np.ndarray) -> None:
    """Batches as in the release: ``data`` uint8 (N, 3072) = R plane, G plane, B plane, row-major."""
    folder = root / CIFAR10.base_folder
    folder.mkdir(parents=True, exist_ok=True)
    batches = [("test_batch", test, np.arange(len(test)))]
    for k, rows in enumerate(np.array_split(np.arange(len(train)), 5), start=1):
        batches.append((f"data_batch_{k}", train[rows], rows))
    for name, images, ids in batches:
        _pickle(
            folder / name,
            {
                "batch_label": name,
                "labels": [int(i) % 10 for i in ids],
                "data": images.reshape(len(images), 3 * 32 * 32),
                "filenames": [f"{name}_{i}.png" for i in ids],
            },
        )
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    _pickle(folder / "batches.meta", {"num_cases_per_batch": 10000, "label_names": names, "num_vis": 3072})


def _pin_cifar_md5s(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    folder = root / CIFAR10.base_folder

    def md5(name: str) -> str:
        return hashlib.md5((folder / name).read_bytes()).hexdigest()

    monkeypatch.setattr(CIFAR10, "train_list", [[n, md5(n)] for n, _ in CIFAR10.train_list])
    monkeypatch.setattr(CIFAR10, "test_list", [[n, md5(n)] for n, _ in CIFAR10.test_list])
    monkeypatch.setattr(CIFAR10, "meta", {**CIFAR10.meta, "md5": md5(CIFAR10.meta["filename"])})


@dataclass
class Spec:
    cls: type[MNISTDataModule] | type[CIFAR10DataModule]
    name: str
    shape: tuple[int, int, int]
    mean: tuple[float, ...]  # the data sets' published statistics, restated by hand
    std: tuple[float, ...]
    folder: str
    write: Callable[[Path, np.ndarray, np.ndarray], None]

    def images(self, ids: np.ndarray) -> np.ndarray:
        """uint8 (N, C, H, W): channel 0 = id, channel 1 = id + 100, channel 2 = 255 - id."""
        c, h, w = self.shape
        fills = [ids, ids + 100, 255 - ids][:c]
        return np.stack([np.broadcast_to(f[:, None, None], (len(ids), h, w)) for f in fills], 1).astype(
            np.uint8
        )

    def train_images(self) -> np.ndarray:
        images = self.images(np.arange(N_TRAIN))
        images[SPECIAL_ID, -1, SPECIAL_PIXEL[0], SPECIAL_PIXEL[1]] = 255
        return images

    def ids(self, x: torch.Tensor) -> np.ndarray:
        """Undo the normalization of channel 0 at pixel (0, 0): the image ids of a batch."""
        raw = (x[:, 0, 0, 0].double() * self.std[0] + self.mean[0]) * 255
        return np.rint(raw.numpy()).astype(int)


SPECS = {
    "mnist": Spec(MNISTDataModule, "MNIST", (1, 28, 28), (0.1307,), (0.3081,), "MNIST/raw", write_mnist),
    "cifar": Spec(
        CIFAR10DataModule,
        "CIFAR-10",
        (3, 32, 32),
        (0.4914, 0.4822, 0.4465),
        (0.2470, 0.2435, 0.2616),
        "cifar-10-batches-py",
        _write_cifar,
    ),
}


@pytest.fixture(params=sorted(SPECS))
def spec(request: pytest.FixtureRequest) -> Spec:
    return SPECS[request.param]


@pytest.fixture
def write(spec: Spec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[np.ndarray], Path]:
    """Write the data set under tmp_path with the given training images; returns the root."""

    def _write(train: np.ndarray) -> Path:
        spec.write(tmp_path, train, spec.images(np.arange(200, 200 + N_TEST)))
        if spec.cls is CIFAR10DataModule:
            _pin_cifar_md5s(monkeypatch, tmp_path)
        return tmp_path

    return _write


@pytest.fixture
def root(spec: Spec, write: Callable[[np.ndarray], Path]) -> Path:
    return write(spec.train_images())


def test_shapes_dtypes_and_stratified_label_counts(spec: Spec, root: Path) -> None:
    dm = spec.cls(root=str(root), download=False, val_fraction=0.2)
    dm.setup("fit")
    x_tr, y_tr = dm.train_set.tensors
    x_va, y_va = dm.val_set.tensors
    assert (dm.num_classes, dm.in_channels, dm.image_size) == (10, spec.shape[0], spec.shape[1])
    assert x_tr.shape == (80, *spec.shape) and x_va.shape == (20, *spec.shape)
    assert x_tr.dtype == x_va.dtype == torch.float32
    assert y_tr.dtype == y_va.dtype == torch.int64
    assert torch.bincount(y_tr).tolist() == [8] * 10
    assert torch.bincount(y_va).tolist() == [2] * 10
    assert dm.example_input().shape == (1, *spec.shape)
    assert torch.equal(dm.example_input(), x_va[:1])


def test_val_split_is_disjoint_and_stable_for_a_seed(spec: Spec, root: Path) -> None:
    def split(seed: int) -> tuple[np.ndarray, np.ndarray]:
        dm = spec.cls(root=str(root), download=False, val_fraction=0.2, split_seed=seed)
        dm.setup("fit")
        (x_tr, y_tr), (x_va, y_va) = dm.train_set.tensors, dm.val_set.tensors
        ids_tr, ids_va = spec.ids(x_tr), spec.ids(x_va)
        assert (ids_tr % 10).tolist() == y_tr.tolist()  # labels travel with their images
        assert (ids_va % 10).tolist() == y_va.tolist()
        return ids_tr, ids_va

    ids_tr, ids_va = split(0)
    assert set(ids_tr).isdisjoint(ids_va)
    assert sorted([*ids_tr, *ids_va]) == list(range(N_TRAIN))  # the test images (200+) never appear
    again_tr, again_va = split(0)
    assert again_va.tolist() == ids_va.tolist() and again_tr.tolist() == ids_tr.tolist()
    assert split(1)[1].tolist() != ids_va.tolist()


def test_pixels_round_trip_through_the_file_format(spec: Spec, root: Path) -> None:
    dm = spec.cls(root=str(root), download=False, val_fraction=0.2)
    dm.setup("fit")
    x = torch.cat([dm.train_set.tensors[0], dm.val_set.tensors[0]])
    image = x[spec.ids(x).tolist().index(SPECIAL_ID)]
    last = spec.shape[0] - 1
    row, col = SPECIAL_PIXEL
    assert image[last, row, col].item() == pytest.approx((1.0 - spec.mean[last]) / spec.std[last], rel=1e-6)
    assert image[0, 0, 0].item() == pytest.approx((7 / 255 - spec.mean[0]) / spec.std[0], rel=1e-6)
    if spec.shape[0] == 3:  # the planes stay in R, G, B order
        assert image[1, 9, 30].item() == pytest.approx((107 / 255 - 0.4822) / 0.2435, rel=1e-6)
        assert image[2, 0, 0].item() == pytest.approx((248 / 255 - 0.4465) / 0.2616, rel=1e-6)

    raw = spec.cls(root=str(root), download=False, val_fraction=0.2, normalize=False)
    raw.setup("fit")
    x = torch.cat([raw.train_set.tensors[0], raw.val_set.tensors[0]])
    values = sorted({round(v * 255) for v in x[:, 0, 0, 0].tolist()})
    assert values == list(range(N_TRAIN))
    assert x.min().item() == 0.0 and x.max().item() == 1.0


def test_baseline_arrays_are_flat_and_capped(spec: Spec, root: Path) -> None:
    features = int(np.prod(spec.shape))
    x_tr, y_tr, x_va, y_va = spec.cls(root=str(root), download=False, val_fraction=0.2).baseline_arrays()
    assert (x_tr.shape, y_tr.shape, x_va.shape, y_va.shape) == ((80, features), (80,), (20, features), (20,))
    assert x_tr.dtype == np.float32 and y_tr.dtype == np.int64

    capped = spec.cls(root=str(root), download=False, val_fraction=0.2, baseline_subsample=10)
    x_tr, y_tr, x_va, y_va = capped.baseline_arrays()
    assert (x_tr.shape, y_tr.shape, x_va.shape, y_va.shape) == ((10, features), (10,), (10, features), (10,))
    dm = spec.cls(root=str(root), download=False, val_fraction=0.2)
    dm.setup("fit")
    ids_tr = spec.ids(torch.from_numpy(x_tr.reshape(-1, *spec.shape)))
    assert set(ids_tr) <= set(spec.ids(dm.train_set.tensors[0]))  # a subsample of the train split
    assert (ids_tr % 10).tolist() == y_tr.tolist()
    assert np.array_equal(capped.baseline_arrays()[0], x_tr)  # seeded: the same rows every call


def test_fingerprint_changes_when_one_pixel_changes(
    spec: Spec, root: Path, write: Callable[[np.ndarray], Path]
) -> None:
    before = spec.cls(root=str(root), download=False).fingerprint()
    assert len(before) == 64 and int(before, 16) >= 0
    assert spec.cls(root=str(root), download=False).fingerprint() == before
    assert spec.cls(root=str(root), download=False, normalize=False).fingerprint() != before

    images = spec.train_images()
    images[42, 0, 10, 10] += 1
    write(images)
    assert spec.cls(root=str(root), download=False).fingerprint() != before


def test_missing_files_raise_at_construction(spec: Spec, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        spec.cls(root=str(tmp_path), download=False)
    message = str(info.value)
    assert str(tmp_path / spec.folder) in message
    assert "`download: true`" in message


def test_failed_download_names_folder_and_data_set(
    spec: Spec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nowhere = (tmp_path / "no-such-mirror").as_uri()  # a file:// URL that fails: no network used
    monkeypatch.setattr(MNIST, "mirrors", [nowhere + "/"])
    monkeypatch.setattr(CIFAR10, "url", nowhere + "/cifar-10-python.tar.gz")
    dm = spec.cls(root=str(tmp_path), download=True)  # does not touch the network yet
    with pytest.raises(RuntimeError) as info:
        dm.prepare_data()
    message = str(info.value)
    assert str(tmp_path / spec.folder) in message
    assert f"downloading {spec.name} into" in message
    assert "place the files there" in message


def test_cifar_md5_check_stays_live(tmp_path: Path) -> None:
    spec = SPECS["cifar"]
    _write_cifar(tmp_path, spec.train_images(), spec.images(np.arange(200, 200 + N_TEST)))
    dm = CIFAR10DataModule(root=str(tmp_path), download=False)  # the files exist ...
    with pytest.raises(RuntimeError, match="torchvision could not read CIFAR-10") as info:
        dm.setup("fit")  # ... but do not match the real release's md5s
    assert str(tmp_path / "cifar-10-batches-py") in str(info.value)


def test_train_dataloader_batch(spec: Spec, root: Path) -> None:
    dm = spec.cls(root=str(root), download=False, val_fraction=0.2, batch_size=16, shuffle_seed=3)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, *spec.shape) and x.dtype == torch.float32
    assert y.shape == (16,) and y.dtype == torch.int64
    ids = spec.ids(x)
    assert set(ids) <= set(spec.ids(dm.train_set.tensors[0]))
    assert (ids % 10).tolist() == y.tolist()
    assert spec.ids(next(iter(dm.train_dataloader()))[0]).tolist() == ids.tolist()  # seeded order
    x_va, _ = next(iter(dm.val_dataloader()))
    assert x_va.shape == (20, *spec.shape)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"val_fraction": 1.0}, "MNISTDataModule(val_fraction=1.0) must lie in (0, 1)."),
        ({"batch_size": 0}, "MNISTDataModule(batch_size=0) must be >= 1."),
        ({"baseline_subsample": 0}, "MNISTDataModule(baseline_subsample=0) must be >= 1."),
    ],
)
def test_bad_arguments_name_the_value(kwargs: dict, message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        MNISTDataModule(root=str(tmp_path), **kwargs)
    assert str(info.value) == message
