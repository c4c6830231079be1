"""The streamed datamodules' pieces that need no bucket: the chunk-aware order, the loader's cursor with workers."""

from __future__ import annotations

import collections
import types

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from datamodules.loaders import CURSOR_KEY, stateful_train_loader
from datamodules.streaming import ChunkOrder, StreamUnavailable, _reason


def test_chunk_order_is_a_permutation_that_keeps_windows_of_chunks_together() -> None:
    sizes = [4, 4, 4, 4, 3]  # items 0-3 in chunk 0, ..., 16-18 in chunk 4
    order = ChunkOrder(sizes, window=2)(7)
    assert sorted(order) == list(range(19))
    chunk_of = [c for c, size in enumerate(sizes) for _ in range(size)]
    chunks = torch.randperm(5, generator=torch.Generator().manual_seed(7)).tolist()
    windows = [set(chunks[0:2]), set(chunks[2:4]), set(chunks[4:5])]
    spans = [sum(sizes[c] for c in w) for w in windows]
    start = 0
    for window, span in zip(windows, spans, strict=True):  # each window's items come together, in the window's order
        assert {chunk_of[i] for i in order[start:start + span]} == window
        start += span
    assert ChunkOrder(sizes, window=2)(7) == order  # the seed alone decides
    assert ChunkOrder(sizes, window=2)(8) != order


def test_chunk_order_refuses_a_window_below_one() -> None:
    with pytest.raises(ValueError, match=r"ChunkOrder\(window=0\) must be >= 1"):
        ChunkOrder([4], window=0)


def _trainer(world: int, rank: int) -> types.SimpleNamespace:
    progress = types.SimpleNamespace(ready=0, started=0, processed=0, completed=0)
    batches = types.SimpleNamespace(current=progress)
    loop = types.SimpleNamespace(epoch_loop=types.SimpleNamespace(batch_progress=batches))
    return types.SimpleNamespace(world_size=world, global_rank=rank, limit_train_batches=None, fit_loop=loop)


@pytest.mark.parametrize("workers", [0, 2])
def test_cursor_with_workers_is_where_the_batches_handed_out_end(workers: int) -> None:
    """Workers draw indices ahead, and Lightning may set the epoch after the iterator exists: the saved cursor is
    still the position of the last batch handed out, and a 1 -> 2 resume trains each sample once."""
    data = TensorDataset(torch.arange(300))
    loader = stateful_train_loader(data, 32, 0, _trainer(1, 0), workers)
    loader.sampler.set_epoch(0)
    batches = iter(loader)
    loader.sampler.set_epoch(0)  # as Lightning does after the workers started
    seen = collections.Counter()
    for _ in range(5):
        seen.update(next(batches)[0].tolist())
    state = loader.state_dict()
    assert state[CURSOR_KEY] == {"epoch": 0, "yielded": 160, "complete": False, "world_size": 1}
    for rank in range(2):
        resumed = stateful_train_loader(data, 32, 0, _trainer(2, rank), workers)
        resumed.sampler.set_epoch(0)
        resumed.load_state_dict(state)
        for batch in resumed:
            seen.update(batch[0].tolist())
    assert seen == collections.Counter(range(300))


def test_reason_names_an_s3_error_code() -> None:
    class ClientError(Exception):
        response = {"Error": {"Code": "NoSuchBucket", "Message": "The specified bucket does not exist"}}

    assert _reason(ClientError("x")) == "NoSuchBucket: The specified bucket does not exist"
    assert _reason(ConnectionError("refused\n  by peer")) == "ConnectionError: refused by peer"
    assert issubclass(StreamUnavailable, RuntimeError)


@pytest.mark.e2e  # litdata.optimize starts a worker process
def test_items_come_from_chunks_decoded_whole_and_equal_litdatas(tmp_path, monkeypatch) -> None:
    """Each chunk is decoded once while it stays among the last ``decoded_chunks``; every item equals litdata's own
    reader's (the compat check of the hand-read chunk layout: it fails when a litdata upgrade changes it)."""
    from litdata import StreamingDataset

    from datamodules.streaming import StreamedItems
    from recipes import prepare

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "digits"
    assert prepare.main(["digits", "--chunk_items", "16", "--max_items", "80", "--output", str(out)]) == 0
    items = StreamedItems(str(out / "train"), str(tmp_path / "cache"), decoded_chunks=2)
    plain = StreamingDataset(str(out / "train"), cache_dir=str(tmp_path / "plain"))
    decoded = collections.Counter()
    decode = type(items).decode

    def counted(self, chunk):
        decoded[chunk] += 1
        return decode(self, chunk)

    monkeypatch.setattr(type(items), "decode", counted)
    sizes = items.chunk_sizes()
    assert sum(sizes) == len(items) == len(plain) and sizes[0] == 16
    order = [17, 3, 20, 0, 31, 16, 15, 40, 2]  # chunks 1, 0, 1, 0, 1, 1, 0, 2, 0
    for index in order:
        got, expected = items[index], plain[index]
        assert np.array_equal(got["x"], expected["x"]) and got["x"].dtype == expected["x"].dtype
        assert got["y"] == expected["y"]
    # chunks 0 and 1 decoded once each while both fit; chunk 2 evicts chunk 1 (the least recent), and chunk 0 stays
    assert decoded == {0: 1, 1: 1, 2: 1}
    assert all(np.array_equal(items[i]["x"], plain[i]["x"]) for i in range(len(plain)))
    with pytest.raises(IndexError):
        items[len(items)]
