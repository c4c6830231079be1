"""The byte-level text datamodule on small corpora written here (and the real stdlib default, capped).

The split, the caps, the cache, the windows, the n-gram baselines (against values worked out by
hand) and exact resume of the training loader, mid-epoch and across an epoch boundary, on two
simulated ranks.
"""

from __future__ import annotations

import itertools
import math
import random
import string
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from callbacks.spot import SpotCheckpoint
from datamodules import text
from datamodules.text import TextDataModule, ngram_bits_per_byte, plan_splits, split_key
from tests.conftest import CORPUS_FILES, write_corpus

FILES = CORPUS_FILES
# distinct bytes everywhere, so that a window's content tells where it starts
VARIED = {f"v{i:02d}.py": "".join(random.Random(i).choices(string.ascii_letters, k=40 + i)) for i in range(20)}


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus", FILES)


@pytest.fixture
def varied(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "varied", VARIED)


def dm_for(root: Path, tmp_path: Path, **kwargs) -> TextDataModule:
    kwargs.setdefault("block_size", 8)
    kwargs.setdefault("batch_size", 2)
    return TextDataModule(root=str(root), cache_dir=str(tmp_path / "cache"), **kwargs)


def test_split_by_file_is_deterministic_and_seeded(corpus: Path, tmp_path: Path) -> None:
    meta = dm_for(corpus, tmp_path, val_fraction=0.25).meta
    # sha256("0:pkg/modNN.py") decides; these are the files whose key is below 0.25, in key order
    assert meta["val"]["files"] == ["pkg/mod10.py", "pkg/mod18.py", "pkg/mod16.py", "pkg/mod15.py",
                                    "pkg/mod01.py", "pkg/mod11.py", "pkg/mod06.py"]
    assert sorted(meta["train"]["files"] + meta["val"]["files"]) == sorted(FILES)
    assert dm_for(corpus, tmp_path, val_fraction=0.25).meta["val"]["files"] == meta["val"]["files"]
    reseeded = dm_for(corpus, tmp_path, val_fraction=0.25, split_seed=1).meta
    assert reseeded["val"]["files"] == ["pkg/mod17.py", "pkg/mod19.py", "pkg/mod10.py", "pkg/mod05.py"]
    assert split_key("pkg/mod10.py", 0) == pytest.approx(0.0174, abs=1e-4)
    # the split bytes are the files' bytes, concatenated in that order
    val = (Path(dm_for(corpus, tmp_path, val_fraction=0.25).cache_path()) / "val.bin").read_bytes()
    assert val == b"".join(FILES[f].encode() for f in meta["val"]["files"])


def test_caps_are_shared_between_the_splits(corpus: Path, tmp_path: Path) -> None:
    files = text.list_files(corpus, "*.py")
    train, val = plan_splits(files, val_fraction=0.25, split_seed=0, max_bytes=100)
    assert (train.total, val.total) == (75, 25)  # the last file of each split is cut to fit
    train, val = plan_splits(files, val_fraction=0.25, split_seed=0, max_files=4)
    assert (len(train.files), len(val.files)) == (3, 1)
    assert val.files == ("pkg/mod10.py",)
    small = dm_for(corpus, tmp_path, val_fraction=0.25, max_bytes=100)
    assert (small.meta["train"]["bytes"], small.meta["val"]["bytes"]) == (75, 25)


def test_cache_is_reused_and_keyed_on_the_files(corpus: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    encode = text._encode_corpus
    monkeypatch.setattr(text, "_encode_corpus", lambda *a: calls.append(a[2].name) or encode(*a))
    first = dm_for(corpus, tmp_path)
    first.prepare_data()
    first.setup("fit")
    assert calls == ["train.bin", "val.bin"]
    folder = first.cache_path()
    mtime = (folder / "train.bin").stat().st_mtime_ns

    second = dm_for(corpus, tmp_path)
    second.prepare_data()
    second.setup("fit")
    assert calls == ["train.bin", "val.bin"]  # not encoded again
    assert second.cache_path() == folder and (folder / "train.bin").stat().st_mtime_ns == mtime
    assert second.fingerprint() == first.fingerprint()

    (corpus / "pkg/mod03.py").write_text("changed = True\n" * 10)
    third = dm_for(corpus, tmp_path)
    third.setup("fit")
    assert calls == ["train.bin", "val.bin"] * 2
    assert third.cache_path() != folder and third.fingerprint() != first.fingerprint()


def test_windows_are_shifted_pairs_of_corpus_bytes(corpus: Path, tmp_path: Path) -> None:
    dm = dm_for(corpus, tmp_path, block_size=8, num_samples=10, val_windows=3)
    dm.setup("fit")
    train = (dm.cache_path() / "train.bin").read_bytes()
    assert len(dm.train_set) == 10
    x, y = dm.train_set[4]
    start = int(dm.train_set.starts[4])
    assert x.dtype == torch.int64 and x.shape == (8,)
    assert bytes(x.tolist()) == train[start:start + 8] and bytes(y.tolist()) == train[start + 1:start + 9]
    val_size = dm.meta["val"]["bytes"]
    assert dm.val_set.starts.tolist() == [0, round((val_size - 9) / 2), val_size - 9]  # evenly spaced, fixed
    example = dm.example_input()
    assert example.shape == (1, 8) and example.dtype == torch.int64
    assert bytes(example[0].tolist()) == (dm.cache_path() / "val.bin").read_bytes()[:8]


def test_ngram_baselines_by_hand() -> None:
    train = np.frombuffer(b"aab", dtype=np.uint8)
    contexts, targets = np.frombuffer(b"abba", np.uint8), np.frombuffer(b"bbab", np.uint8)
    got = ngram_bits_per_byte(train, contexts, targets)
    # unigram: c(a)=2, c(b)=1, N=3 -> p(b)=2/259, p(a)=3/259
    assert got["unigram"] == pytest.approx((3 * math.log2(259 / 2) + math.log2(259 / 3)) / 4, rel=1e-12)
    # bigram: c(a,a)=1, c(a,b)=1, rows c(a,.)=2, c(b,.)=0 -> p(b|a)=2/258, p(b|b)=p(a|b)=1/256
    assert got["bigram"] == pytest.approx((2 * math.log2(258 / 2) + 2 * 8.0) / 4, rel=1e-12)


def test_datamodule_baselines_score_the_validation_targets(tmp_path: Path) -> None:
    # split seed 0, val_fraction 0.5: sha256 puts "val.txt" (0.215) in validation, "train.txt" (0.772) in training
    root = write_corpus(tmp_path / "c", {"train.txt": "aab", "val.txt": "abbab"})
    dm = TextDataModule(root=str(root), pattern="*.txt", block_size=2, batch_size=1, val_windows=None,
                        val_fraction=0.5, cache_dir=str(tmp_path / "cache"))
    dm.setup("fit")
    assert dm.val_set.starts.tolist() == [0, 2]  # windows "abb", "bab": targets b, b, a, b after a, b, b, a
    assert dm.baseline_bits_per_byte() == ngram_bits_per_byte(
        np.frombuffer(b"aab", np.uint8), np.frombuffer(b"abba", np.uint8), np.frombuffer(b"bbab", np.uint8))


def test_baselines_are_counted_once_per_corpus_and_window_setting(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    root = write_corpus(tmp_path / "c", {"train.txt": "aab" * 20, "val.txt": "abbab" * 8})
    make = lambda **kw: TextDataModule(root=str(root), pattern="*.txt", block_size=2, batch_size=1,  # noqa: E731
                                       val_fraction=0.5, cache_dir=str(tmp_path / "cache"), **kw)
    first = make(val_windows=3).baseline_bits_per_byte()
    counted = []
    monkeypatch.setattr(text, "ngram_bits_per_byte", lambda *a: counted.append(a) or {"unigram": 1.0, "bigram": 2.0})
    assert make(val_windows=3).baseline_bits_per_byte() == first  # a relaunch reads them: nothing counted
    assert counted == []
    assert make(val_windows=4).baseline_bits_per_byte() == {"unigram": 1.0, "bigram": 2.0}  # other windows: counted
    assert len(counted) == 1
    (cached,) = make(val_windows=3).cache_path().glob("baselines-block2-val3.json")
    cached.write_text('{"unigram": 0.5')  # a torn file (by hand: the writer replaces whole files) is counted again
    assert make(val_windows=3).baseline_bits_per_byte() == {"unigram": 1.0, "bigram": 2.0}
    assert len(counted) == 2


def test_too_small_a_split_is_named(tmp_path: Path) -> None:
    root = write_corpus(tmp_path / "c", {"train.txt": "aab" * 10, "val.txt": "ab"})
    dm = TextDataModule(root=str(root), pattern="*.txt", block_size=4, val_fraction=0.5,
                        cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"validation split .* \(1 files, 2 bytes\) is shorter than one window"):
        dm.setup("fit")
    with pytest.raises(ValueError, match=r"TextDataModule\(val_fraction=1.5\)"):
        TextDataModule(root=str(root), val_fraction=1.5)


def test_default_corpus_is_the_standard_library(tmp_path: Path) -> None:
    dm = TextDataModule(max_files=20, block_size=16, cache_dir=str(tmp_path / "cache"))
    assert dm.root == Path(text.sysconfig.get_paths()["stdlib"])
    meta = dm.meta
    assert (len(meta["train"]["files"]), len(meta["val"]["files"])) == (18, 2)
    assert not any("site-packages" in f for f in meta["train"]["files"] + meta["val"]["files"])
    assert meta["train"]["bytes"] == sum((dm.root / f).stat().st_size for f in meta["train"]["files"])


# ------------------------------------------------------------------- exact resume
EPOCHS, WORLD = 2, 2


def loader_for(corpus: Path, tmp_path: Path, rank: int):
    dm = dm_for(corpus, tmp_path, block_size=4, batch_size=2, num_samples=10, shuffle_seed=3)
    dm.trainer = SimpleNamespace(world_size=WORLD, global_rank=rank)  # what the loader reads of a trainer
    dm.setup("fit")
    return dm.train_dataloader()


def batches(loader, epochs: range, stop_after: int | None = None) -> tuple[list[list[bytes]], dict | None, int]:
    """Iterate like Lightning's fit loop (set_epoch, then the epoch's batches); stop after some batches."""
    seen: list[list[bytes]] = []
    for epoch in epochs:
        loader.sampler.set_epoch(epoch)
        for x, _ in loader:
            seen.append([bytes(row.tolist()) for row in x])
            if len(seen) == stop_after:
                return seen, loader.state_dict(), epoch
    return seen, None, epochs.stop


@pytest.mark.parametrize("rank", [0, 1])
def test_resumed_loader_yields_the_uninterrupted_windows(varied: Path, tmp_path: Path, rank: int) -> None:
    corpus = varied
    full, _, _ = batches(loader_for(corpus, tmp_path, rank), range(EPOCHS))
    # 10 samples over 2 ranks: 5 a rank, in batches of 2, 2, 1
    assert [len(b) for b in full] == [2, 2, 1] * EPOCHS
    assert full[:3] != full[3:]  # every epoch has its own order: the epoch must resume too
    for stop in (1, 3, 4):  # mid-epoch 0, after the last batch of epoch 0 (before StopIteration), mid-epoch 1
        before, state, epoch = batches(loader_for(corpus, tmp_path, rank), range(EPOCHS), stop_after=stop)
        assert state is not None
        resumed = loader_for(corpus, tmp_path, rank)
        resumed.load_state_dict(state)
        # Lightning counts an epoch whose batches were all seen as done, and goes on with the next one
        after, _, _ = batches(resumed, range(epoch + (stop % 3 == 0), EPOCHS))
        assert before + after == full, f"rank {rank}, stopped after {stop} batches"
    # a state saved after the epoch's iterator finished (as in on_train_epoch_end) resumes with the next epoch
    loader = loader_for(corpus, tmp_path, rank)
    first, _, _ = batches(loader, range(1))
    resumed = loader_for(corpus, tmp_path, rank)
    resumed.load_state_dict(loader.state_dict())
    after, _, _ = batches(resumed, range(1, EPOCHS))
    assert first + after == full


class _Recorder(pl.LightningModule):
    """Records the first window of every training batch; trains nothing that matters."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[bytes] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(bytes(batch[0][0].tolist()))
        return (self.weight**2).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(corpus: Path, tmp_path: Path, dirpath: Path, max_steps: int, ckpt: Path | None = None,
         drill: list[int] | None = None) -> list[bytes]:
    dm = dm_for(corpus, tmp_path, block_size=4, batch_size=2, num_samples=6, shuffle_seed=3)
    model = _Recorder()
    trainer = pl.Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, limit_val_batches=0, enable_checkpointing=False,
                         callbacks=[SpotCheckpoint(dirpath=str(dirpath), drill_steps=drill)])
    trainer.fit(model, dm, ckpt_path=ckpt)
    return model.seen


@pytest.mark.parametrize(("stop", "drill"), [(4, None), (3, None), (12, [4]), (12, [6])],
                         ids=["max_steps-mid-epoch", "max_steps-at-epoch-end", "notice-mid-epoch",
                              "notice-at-last-batch"])
def test_lightning_resume_sees_the_uninterrupted_windows(varied: Path, tmp_path: Path, stop: int,
                                                         drill: list[int] | None) -> None:
    """The real fit loop with the spot callback's checkpoints: 3 batches an epoch, 4 epochs, stopped once.

    (With torchdata's StatefulDistributedSampler the first, second and fourth cases come out wrong.)
    """
    full = _fit(varied, tmp_path, tmp_path / "full", 12)
    epochs = [full[i:i + 3] for i in range(0, 12, 3)]
    assert len(full) == 12 and all(a != b for a, b in itertools.pairwise(epochs))  # a new order every epoch
    first = _fit(varied, tmp_path, tmp_path / "ck", stop, drill=drill)
    step = len(first)
    assert step == (stop if drill is None else drill[0])
    rest = _fit(varied, tmp_path, tmp_path / "ck", 12, ckpt=tmp_path / "ck" / f"step={step:08d}.ckpt")
    assert first + rest == full
