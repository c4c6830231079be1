"""PassSampler's global cursor: a pass stopped on one world size goes on, on another, with each sample once."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils.data import TensorDataset

from datamodules.loaders import CURSOR_KEY, PassSampler, ResumableLoader


def _samplers(n: int, world: int, batch: int, seed: int = 5, per_pass: int | None = None) -> list[PassSampler]:
    data = TensorDataset(torch.arange(n))
    return [PassSampler(data, world, rank, seed, samples_per_pass=per_pass, batch_size=batch) for rank in range(world)]


def _take(samplers: list[PassSampler], batches: int | None) -> tuple[list[list[int]], list]:
    """Each rank's next ``batches`` batches (all of the pass when None), in lockstep, as DDP takes them."""
    iters = [iter(s) for s in samplers]
    out: list[list[int]] = [[] for _ in samplers]
    for _ in range(batches if batches is not None else 10**9):
        step = []
        for it, sampler in zip(iters, samplers, strict=True):
            chunk = [i for _, i in zip(range(sampler.batch_size), it, strict=False)]
            step.append(chunk)
        if not any(step):
            break
        assert all(step), f"a rank ran out of batches before another: {[len(c) for c in step]}"
        for rank, chunk in enumerate(step):
            out[rank].append(chunk)
    return out, iters


@pytest.mark.parametrize(("n", "old", "new", "batch", "stop"), [
    (1437, 2, 1, 32, 11), (1437, 1, 2, 32, 5), (1437, 1, 2, 32, 40), (1437, 2, 3, 32, 7), (100, 3, 2, 8, 2),
    (129, 1, 2, 32, 2),  # 1 sample left for 2 ranks: the one case where a rank repeats a sample
])
def test_a_pass_continues_on_another_world_with_each_sample_once(n: int, old: int, new: int, batch: int,
                                                                 stop: int) -> None:
    first, _ = _take(_samplers(n, old, batch), stop)
    before = _samplers(n, old, batch)
    _take(before, stop)
    state = before[0].state_dict()
    assert state == {"epoch": 0, "yielded": stop * batch * old}  # the global cursor, rank 0's state holds it
    resumed = _samplers(n, new, batch)
    for sampler in resumed:
        sampler.load_state_dict(state)
    rest, _ = _take(resumed, None)
    trained = collections.Counter(i for rank in first + rest for chunk in rank for i in chunk)
    left = n - stop * batch * old
    repeats = 0 if left % (new * batch) == 0 or left % (new * batch) >= new else new - left % (new * batch)
    assert set(trained) == set(range(n))  # nothing skipped
    assert sum(trained.values()) == n + repeats  # nothing twice, except the padding of a last round too small
    lengths = {len(rank) for rank in rest}
    assert lengths == {resumed[0].batches_left(state["yielded"])}  # every new rank: the same number of batches


def test_the_same_world_continues_exactly_as_uninterrupted() -> None:
    whole, _ = _take(_samplers(1437, 2, 32), None)
    before = _samplers(1437, 2, 32)
    head, _ = _take(before, 9)
    resumed = _samplers(1437, 2, 32)
    for sampler in resumed:
        sampler.load_state_dict(before[0].state_dict())
    tail, _ = _take(resumed, None)
    assert [h + t for h, t in zip(head, tail, strict=True)] == whole
    # no padding: 1,437 samples over 2 ranks are 719 + 718, each once, in 23 batches a rank
    assert [sum(map(len, rank)) for rank in whole] == [719, 718] and [len(r) for r in whole] == [23, 23]


def test_the_next_pass_is_what_the_new_world_would_draw() -> None:
    before = _samplers(200, 2, 10)
    _take(before, 3)
    resumed = _samplers(200, 1, 10)
    resumed[0].load_state_dict(before[0].state_dict())
    _take(resumed, None)
    nxt, _ = _take(resumed, None)  # pass 1
    fresh = _samplers(200, 1, 10)
    fresh[0].set_epoch(1)
    expected, _ = _take(fresh, None)
    assert nxt == expected and resumed[0].epoch == 1


def test_a_limited_pass_on_the_new_world_ends_where_that_world_limits_it() -> None:
    # 4 batches a rank: 2 ranks consume 80 of 200 positions a pass, 1 rank 40
    before = _samplers(200, 2, 10, per_pass=80)
    _take(before, 1)
    resumed = _samplers(200, 1, 10, per_pass=40)
    resumed[0].load_state_dict(before[0].state_dict())  # cursor 20 of 40: two batches left
    rest, _ = _take(resumed, None)
    assert len(rest[0]) == 2 == resumed[0].batches_left(20)


def test_a_state_of_the_per_rank_sampler_resumes_where_it_stopped() -> None:
    """A checkpoint written before the cursor was global (no cursor key; a count of one rank's samples)."""
    data = TensorDataset(torch.arange(100))
    whole = list(_samplers(100, 2, 5)[1])
    loader = ResumableLoader(data, batch_size=5, sampler=_samplers(100, 2, 5)[1])
    legacy = loader.state_dict()
    del legacy[CURSOR_KEY]
    legacy["_sampler_iter_state"] = {"samples_yielded": 15, "sampler_state": {"epoch": 0, "yielded": 15}}
    resumed = ResumableLoader(data, batch_size=5, sampler=_samplers(100, 2, 5)[1])
    resumed.load_state_dict(legacy)
    assert [int(i) for batch in resumed for i in batch[0]] == whole[15:]
