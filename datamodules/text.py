"""A byte-level text corpus as a LightningDataModule: the files under a folder, no tokenizer.

The embedded default corpus is the running Python's standard-library sources
(``sysconfig.get_paths()["stdlib"]``, its ``*.py`` files without ``site-packages``: about 30 MB
of real text on every machine that runs Python, no download). Any folder of text files works
(``root``, ``pattern``).

How the data is made, once:

- **Split by file.** A file's relative path and ``split_seed`` hash (SHA-256) to a number ``u``
  in [0, 1); files with ``u < val_fraction`` are validation files. The split is a function of
  the path alone: the same on every rank, machine and relaunch, and a file never straddles it.
- **Caps.** ``max_files`` and ``max_bytes`` shrink the corpus for CI-sized runs. Each split gets
  its share (``val_fraction`` of the cap, at least one file), taking files in order of ``u``
  (a seeded shuffle); the last file of a split is cut so the byte cap holds exactly.
- **Cache.** Each split's bytes are concatenated into a ``uint8`` file under
  ``<cache_dir>/<key>/`` (``train.bin``, ``val.bin``, ``meta.json``). The key is a SHA-256 of the
  file list with sizes and modification times plus the split settings: a second run memory-maps
  the cached files instead of reading the corpus again; editing a file makes a new key.

Windows of ``block_size + 1`` bytes become ``(x, y)`` pairs (``y`` is ``x`` shifted by one).
Training windows start at ``num_samples`` positions drawn once from a generator seeded with
``shuffle_seed``; the dataset is indexed by sample number and read through a ``StatefulDataLoader``
over a :class:`datamodules.loaders.PassSampler` (pass ``p`` is the permutation of ``shuffle_seed + p``, sharded over
the ranks, and the sampler saves which pass it is in), so a resumed run sees exactly the windows
an uninterrupted one would have seen, mid-epoch and across epoch boundaries. Validation windows
sit at fixed, evenly spaced positions, and every rank evaluates all of them (exact metrics, no
padding).

``baseline_bits_per_byte()`` gives the add-one-smoothed unigram and bigram models' bits per byte,
counted on the train split and scored on exactly the bytes the model's ``val/bpb`` scores.

Copy with it (paths under ``datamodules/``): ``loaders.py``, ``compat.py``, ``worker_signals.py``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import os
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from .loaders import stateful_train_loader

#: Folders never part of a corpus (installed packages are not the standard library).
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", ".git"})
#: Bumped when the cache layout or the encoding changes.
CACHE_VERSION = 1
VOCAB_SIZE = 256


def default_root() -> Path:
    """The running Python's standard-library folder: the embedded default corpus."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path, pattern: str) -> list[tuple[str, int, int]]:
    """``(relative posix path, size, mtime_ns)`` of the files under ``root`` matching ``pattern``, sorted.

    Symbolic links to folders are not followed; folders in :data:`EXCLUDED_DIRS` are skipped.
    """
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
        for name in names:
            if not fnmatch.fnmatch(name, pattern):
                continue
            path = Path(folder) / name
            if not path.is_file():
                continue
            stat = path.stat()
            found.append((path.relative_to(root).as_posix(), stat.st_size, stat.st_mtime_ns))
    return sorted(found)


def split_key(relpath: str, split_seed: int) -> float:
    """A file's position in [0, 1): SHA-256 of ``"<split_seed>:<relpath>"``, first 8 bytes as a fraction."""
    digest = hashlib.sha256(f"{split_seed}:{relpath}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _share(cap: int | None, val_fraction: float) -> tuple[int | None, int | None]:
    """A cap split into (train, val) shares; the validation share is at least 1."""
    if cap is None:
        return None, None
    val = max(1, math.ceil(cap * val_fraction))
    return cap - val, val


@dataclass(frozen=True)
class Split:
    """The files of one split, in the order they are concatenated, and the bytes taken from each."""

    files: tuple[str, ...]
    nbytes: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.nbytes)


def plan_splits(
    files: list[tuple[str, int, int]],
    val_fraction: float,
    split_seed: int,
    max_files: int | None = None,
    max_bytes: int | None = None,
) -> tuple[Split, Split]:
    """Assign files to (train, val) by :func:`split_key`, order them by it, and apply the caps."""
    keyed = sorted((split_key(rel, split_seed), rel, size) for rel, size, _ in files)
    file_caps, byte_caps = _share(max_files, val_fraction), _share(max_bytes, val_fraction)
    plans = []
    for index, chosen in enumerate(([k for k in keyed if k[0] >= val_fraction],
                                    [k for k in keyed if k[0] < val_fraction])):
        file_cap, byte_cap = file_caps[index], byte_caps[index]
        names: list[str] = []
        sizes: list[int] = []
        for _, rel, size in chosen[:file_cap]:
            if byte_cap is not None:
                size = min(size, byte_cap - sum(sizes))
                if size <= 0:
                    break
            names.append(rel)
            sizes.append(size)
        plans.append(Split(tuple(names), tuple(sizes)))
    return plans[0], plans[1]


def _encode_corpus(root: Path, split: Split, path: Path) -> str:
    """Concatenate the split's bytes into ``path``; returns their SHA-256."""
    digest = hashlib.sha256()
    with open(path, "wb") as out:
        for rel, nbytes in zip(split.files, split.nbytes, strict=True):
            with open(root / rel, "rb") as f:
                data = f.read(nbytes)
            if len(data) != nbytes:
                raise RuntimeError(f"{root / rel} changed while the corpus was being encoded; run again.")
            out.write(data)
            digest.update(data)
    return digest.hexdigest()


def ngram_bits_per_byte(train: np.ndarray, contexts: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """Bits per byte of add-one-smoothed unigram and bigram models counted on ``train``.

    The unigram model scores each target byte ``b`` as ``(c(b) + 1) / (N + 256)``; the bigram model
    scores it after its context byte ``a`` as ``(c(a, b) + 1) / (c(a, .) + 256)``, where ``c(a, .)``
    counts the train bigrams that start with ``a``. Both are averaged over all targets, in bits.

    Args:
        train: the training bytes (``uint8``).
        contexts: the byte before each target.
        targets: the bytes to score.
    """
    train = np.asarray(train, dtype=np.uint8)
    contexts = np.asarray(contexts, dtype=np.int64).ravel()
    targets = np.asarray(targets, dtype=np.int64).ravel()
    if len(contexts) != len(targets) or len(targets) == 0:
        raise ValueError("ngram_bits_per_byte needs as many contexts as targets, and at least one.")
    unigram = np.bincount(train, minlength=VOCAB_SIZE).astype(np.float64)
    p_uni = (unigram[targets] + 1.0) / (unigram.sum() + VOCAB_SIZE)
    pair_ids = train[:-1].astype(np.int32) * VOCAB_SIZE + train[1:]
    pairs = np.bincount(pair_ids, minlength=VOCAB_SIZE**2).astype(np.float64)
    pairs = pairs.reshape(VOCAB_SIZE, VOCAB_SIZE)
    p_bi = (pairs[contexts, targets] + 1.0) / (pairs.sum(axis=1)[contexts] + VOCAB_SIZE)
    return {"unigram": float(-np.log2(p_uni).mean()), "bigram": float(-np.log2(p_bi).mean())}


class _Bytes:
    """A lazily opened read-only ``uint8`` memory map (pickles as its path, for loader workers)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = path.stat().st_size
        self._array: np.ndarray | None = None

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.memmap(self.path, dtype=np.uint8, mode="r") if self.size else np.zeros(0, np.uint8)
        return self._array

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "_array": None}

    def window(self, start: int, length: int) -> torch.Tensor:
        return torch.from_numpy(self.array[start:start + length].astype(np.int64))


class Windows(Dataset):
    """Windows of ``block_size + 1`` bytes at given start offsets; item ``i`` is ``(x, y)`` of ``starts[i]``."""

    def __init__(self, data: _Bytes, starts: np.ndarray, block_size: int) -> None:
        self.data = data
        self.starts = np.asarray(starts, dtype=np.int64)
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.data.window(int(self.starts[index]), self.block_size + 1)
        return window[:-1], window[1:]


def random_starts(n_bytes: int, block_size: int, num_samples: int, seed: int) -> np.ndarray:
    """``num_samples`` window starts drawn uniformly from ``[0, n_bytes - block_size - 1]``."""
    return np.random.default_rng(seed).integers(0, n_bytes - block_size, size=num_samples, dtype=np.int64)


def even_starts(n_bytes: int, block_size: int, count: int | None) -> np.ndarray:
    """Evenly spaced window starts; ``count=None`` tiles the data (stride ``block_size``: every byte
    after the first is a target once)."""
    last = n_bytes - block_size - 1
    if count is None:
        return np.arange(0, last + 1, block_size, dtype=np.int64)
    return np.unique(np.linspace(0, last, count).round().astype(np.int64))


class TextDataModule(pl.LightningDataModule):
    """Byte-level language modelling on the text files under a folder (default: Python's stdlib).

    Args:
        root: folder of the corpus; ``None`` is the running Python's standard library.
        pattern: file-name pattern of the corpus files.
        block_size: context length; windows are ``block_size + 1`` bytes.
        batch_size: windows per batch on each rank.
        num_samples: training windows per epoch (default: train bytes // block_size, about one
            pass over the split).
        val_windows: validation windows, evenly spaced (``None``: tile the whole validation split).
        val_fraction: expected share of files held out for validation.
        split_seed: seed of the file split (and of the order files are taken in under a cap).
        shuffle_seed: seed of the window positions and of the per-epoch order.
        max_files: cap on the number of files (shared between the splits).
        max_bytes: cap on the bytes encoded (shared between the splits).
        cache_dir: where encoded corpora are kept.
        num_workers: training loader worker processes.

    Raises:
        ValueError: for a bad value (named), or a corpus whose split is empty or shorter than a window.

    Example::

        dm = TextDataModule(block_size=128, max_bytes=1_000_000)
        dm.setup("fit")
        x, y = next(iter(dm.val_dataloader()))   # x, y: (32, 128) int64, y[:, :-1] == x[:, 1:]
    """

    vocab_size = VOCAB_SIZE

    def __init__(
        self,
        root: str | None = None,
        pattern: str = "*.py",
        block_size: int = 256,
        batch_size: int = 32,
        num_samples: int | None = None,
        val_windows: int | None = 128,
        val_fraction: float = 0.1,
        split_seed: int = 0,
        shuffle_seed: int = 0,
        max_files: int | None = None,
        max_bytes: int | None = None,
        cache_dir: str = "data/cache/text",
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"TextDataModule(val_fraction={val_fraction!r}) must lie in (0, 1).")
        for name, value in (("block_size", block_size), ("batch_size", batch_size), ("num_samples", num_samples),
                            ("val_windows", val_windows), ("max_files", max_files)):
            if value is not None and value < 1:
                raise ValueError(f"TextDataModule({name}={value!r}) must be >= 1.")
        if max_files is not None and max_files < 2:
            raise ValueError(f"TextDataModule(max_files={max_files!r}) must be >= 2 (a file for each split).")
        if max_bytes is not None and max_bytes < 2:
            raise ValueError(f"TextDataModule(max_bytes={max_bytes!r}) must be >= 2 (a byte for each split).")
        self.root = Path(root) if root is not None else default_root()
        if not self.root.is_dir():
            raise ValueError(f"TextDataModule(root={root!r}) is not a folder.")
        self.pattern = pattern
        self.block_size = block_size
        self.batch_size = batch_size
        self.num_samples = num_samples
        self.val_windows = val_windows
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.shuffle_seed = shuffle_seed
        self.max_files = max_files
        self.max_bytes = max_bytes
        self.cache_dir = Path(cache_dir)
        self.num_workers = num_workers
        self._meta: dict[str, Any] | None = None
        self._train: _Bytes | None = None
        self._val: _Bytes | None = None
        self._folder: Path | None = None

    # ------------------------------------------------------------------ cache
    def cache_key(self, files: list[tuple[str, int, int]] | None = None) -> str:
        """SHA-256 of the file list (paths, sizes, modification times) and the settings that shape the data."""
        files = list_files(self.root, self.pattern) if files is None else files
        settings = {"version": CACHE_VERSION, "root": str(self.root.resolve()), "pattern": self.pattern,
                    "val_fraction": self.val_fraction, "split_seed": self.split_seed,
                    "max_files": self.max_files, "max_bytes": self.max_bytes}
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
        for rel, size, mtime in files:
            digest.update(f"{rel}\0{size}\0{mtime}\n".encode())
        return digest.hexdigest()

    def cache_path(self) -> Path:
        """The folder of this corpus's encoded splits."""
        return self.cache_dir / self.cache_key()

    def build_cache(self) -> Path:
        """Encode the corpus into the cache unless it is there already; returns its folder.

        Safe to run concurrently: each writer fills a private folder and renames it into place.
        """
        files = list_files(self.root, self.pattern)
        target = self.cache_dir / self.cache_key(files)
        if (target / "meta.json").is_file():
            return target
        if not files:
            raise ValueError(f"TextDataModule: no files match {self.pattern!r} under {self.root}.")
        train, val = plan_splits(files, self.val_fraction, self.split_seed, self.max_files, self.max_bytes)
        for name, split in (("train", train), ("validation", val)):
            if split.total < self.block_size + 1:
                raise ValueError(
                    f"TextDataModule: the {name} split of {self.root} ({len(split.files)} files, {split.total} "
                    f"bytes) is shorter than one window of block_size + 1 = {self.block_size + 1} bytes; "
                    "use more files (max_files, max_bytes), another val_fraction or a smaller block_size.")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        scratch = self.cache_dir / f".{target.name}.{os.getpid()}.tmp"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        digests = {"train": _encode_corpus(self.root, train, scratch / "train.bin"),
                   "val": _encode_corpus(self.root, val, scratch / "val.bin")}
        meta = {"version": CACHE_VERSION, "root": str(self.root), "pattern": self.pattern,
                "fingerprint": hashlib.sha256(f"{digests['train']}:{digests['val']}".encode()).hexdigest(),
                "train": {"files": list(train.files), "bytes": train.total, "sha256": digests["train"]},
                "val": {"files": list(val.files), "bytes": val.total, "sha256": digests["val"]}}
        (scratch / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            scratch.rename(target)
        except OSError:  # another process published the same corpus first
            shutil.rmtree(scratch, ignore_errors=True)
        return target

    def _load(self) -> None:
        if self._meta is not None:
            return
        folder = self.build_cache()
        self._folder = folder
        self._meta = json.loads((folder / "meta.json").read_text())
        self._train = _Bytes(folder / "train.bin")
        self._val = _Bytes(folder / "val.bin")

    @property
    def meta(self) -> dict[str, Any]:
        """The cached corpus's description: files and bytes of each split, checksums."""
        self._load()
        assert self._meta is not None
        return self._meta

    # ---------------------------------------------------------- datamodule API
    def prepare_data(self) -> None:
        self.build_cache()

    def setup(self, stage: str | None = None) -> None:
        self._load()
        assert self._train is not None and self._val is not None
        num_samples = self.num_samples or max(1, self._train.size // self.block_size)
        self.train_set = Windows(self._train, random_starts(self._train.size, self.block_size, num_samples,
                                                            self.shuffle_seed), self.block_size)
        self.val_set = Windows(self._val, even_starts(self._val.size, self.block_size, self.val_windows),
                               self.block_size)

    def train_dataloader(self) -> StatefulDataLoader:
        return stateful_train_loader(self.train_set, self.batch_size, self.shuffle_seed, self.trainer,
                                      self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=0)

    # ------------------------------------------------------------- the extras
    def baseline_bits_per_byte(self) -> dict[str, float]:
        """``{"unigram": bpb, "bigram": bpb}``: add-one-smoothed n-gram models counted on the train split,
        scored on the validation windows' targets (the bytes ``val/bpb`` scores).

        Counted once per corpus and window setting, then read from the corpus's cache folder: the count
        reads every training byte (a second or more at the fit's start), and a relaunch or the next run on
        the same corpus gets the same figures. A cache that cannot be written is not an error.
        """
        if not hasattr(self, "val_set"):
            self.setup("fit")
        assert self._train is not None and self._val is not None and self._folder is not None
        cached = self._folder / f"baselines-block{self.block_size}-val{self.val_windows}.json"
        try:
            result = json.loads(cached.read_text())
            if set(result) == {"unigram", "bigram"} and all(isinstance(v, float) for v in result.values()):
                return result
        except (OSError, ValueError):
            pass  # not counted yet, or unreadable: count again
        offsets = self.val_set.starts[:, None] + np.arange(self.block_size + 1)
        windows = self._val.array[offsets]
        result = ngram_bits_per_byte(self._train.array, windows[:, :-1], windows[:, 1:])
        scratch = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
        try:  # written whole or not at all: a reader never sees half a file
            scratch.write_text(json.dumps(result))
            os.replace(scratch, cached)
        except OSError:
            scratch.unlink(missing_ok=True)
        return result

    def fingerprint(self) -> str:
        """SHA-256 over the encoded train and validation bytes: changes whenever the data does."""
        return str(self.meta["fingerprint"])

    def example_input(self) -> torch.Tensor:
        """The first ``block_size`` validation bytes as a ``(1, block_size)`` int64 batch."""
        self._load()
        assert self._val is not None
        return self._val.window(0, self.block_size).unsqueeze(0)
