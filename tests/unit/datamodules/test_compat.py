"""The datamodules' couplings to torchdata's loader state (datamodules/compat.py), on a real StatefulDataLoader."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Sampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from datamodules import compat


class Counting(Sampler[int]):
    """A stateful sampler whose state is how many indices it has given out."""

    def __init__(self, n: int) -> None:
        self.n, self.yielded = n, 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        while self.yielded < self.n:
            self.yielded += 1
            yield self.yielded - 1

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.yielded = state["yielded"]


def loader(workers: int) -> StatefulDataLoader:
    data = TensorDataset(torch.arange(32))
    return StatefulDataLoader(data, batch_size=4, sampler=Counting(32), num_workers=workers,
                              prefetch_factor=2 if workers else None)


def test_without_workers_the_sampler_state_is_where_the_loader_stands() -> None:
    load = loader(0)
    batches = iter(load)
    for _ in range(3):
        next(batches)
    state = load.state_dict()
    assert compat.sampler_state(state) == {"yielded": 12}, "compat.sampler_state: torchdata moved _sampler_iter_state"
    assert compat.served_sampler_state(state) is None and not compat.iterator_finished(state)
    moved = compat.with_sampler_state(state, {"yielded": 4})
    assert compat.sampler_state(moved) == {"yielded": 4} and compat.sampler_state(state) == {"yielded": 12}
    list(batches)
    assert compat.iterator_finished(load.state_dict()), "compat.iterator_finished: torchdata moved _iterator_finished"


@pytest.mark.timeout(120)
def test_with_a_worker_the_snapshot_holds_the_sampler_at_the_last_batch_served() -> None:
    load = loader(1)
    batches = iter(load)
    for _ in range(3):
        next(batches)
    state = load.state_dict()
    # the worker has prefetched ahead; the snapshot is the sampler as of the third batch handed out
    assert compat.served_sampler_state(state) == {"yielded": 12}, \
        "compat.served_sampler_state: torchdata moved _snapshot/_main_snapshot/_sampler_iter_state"
