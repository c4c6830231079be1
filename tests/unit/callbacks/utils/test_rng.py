"""callbacks.utils.rng: every RNG a step draws from, captured, reloaded weights-only, and restored on any world size."""

from __future__ import annotations

import io
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from callbacks.utils.rng import restore_rank_rng, rng_state, set_rng_state


@pytest.fixture(autouse=True)
def own_streams() -> Iterator[None]:
    """The process's RNGs as they were before the test: nothing it draws or seeds leaks into the next one."""
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    yield
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])


def draws() -> tuple[float, float, list[float]]:
    """One draw from each stream a training step may use."""
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def seeded_state(seed: int) -> dict[str, Any]:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return rng_state()


def test_the_state_holds_python_numpy_and_torch_as_tensors_and_plain_values() -> None:
    state = seeded_state(0)
    assert set(state) == {"python", "numpy", "torch"}  # no CUDA here
    version, internal, gauss = state["python"]
    assert (version, gauss) == (3, None)
    assert internal.dtype == torch.int64 and internal.shape == (625,)  # 624 Mersenne words and the position
    name, keys, pos, has_gauss, cached = state["numpy"]
    assert (name, keys.dtype, keys.shape, pos, has_gauss, cached) == ("MT19937", torch.int64, (624,), 624, 0, 0.0)
    assert int(keys[0]) == 0  # numpy's seed 0 puts 0 in the first word (init_genrand: mt[0] = seed)
    assert state["torch"].dtype == torch.uint8


def test_restoring_a_state_repeats_every_stream_bitwise() -> None:
    state = seeded_state(7)
    first = draws()
    draws()  # move on
    set_rng_state(state)
    assert draws() == first


def test_the_state_survives_a_weights_only_checkpoint() -> None:
    state = seeded_state(3)
    expected = draws()
    buffer = io.BytesIO()
    torch.save({"rng": [state]}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["rng"][0]
    set_rng_state(loaded)
    assert draws() == expected


def test_an_earlier_all_lists_state_restores_too() -> None:
    state = seeded_state(5)
    expected = draws()
    old = {"python": [state["python"][0], state["python"][1].tolist(), state["python"][2]],
           "numpy": [state["numpy"][0], state["numpy"][1].tolist(), *state["numpy"][2:]],
           "torch": state["torch"].tolist()}
    set_rng_state(old)
    assert draws() == expected


def test_the_same_world_gives_each_rank_its_own_state_back() -> None:
    states = [seeded_state(10), seeded_state(11)]
    for rank, seed in enumerate((10, 11)):
        seeded_state(seed)
        expected = draws()
        seeded_state(99)
        assert restore_rank_rng(states, rank) == rank
        assert draws() == expected


def test_a_smaller_world_continues_the_first_ranks_streams() -> None:
    states = [seeded_state(20), seeded_state(21), seeded_state(22)]
    seeded_state(21)
    expected = draws()
    assert restore_rank_rng(states, 1) == 1
    assert draws() == expected


def test_ranks_beyond_the_saved_ones_reseed_from_their_source_and_their_rank() -> None:
    states = [seeded_state(30), seeded_state(31)]
    # by hand: rank 3 takes state 3 mod 2 = 1, draws one number from its torch stream, and seeds every generator
    # with (drawn + 1_000_003 x 3) mod 2**32
    set_rng_state(states[1])
    drawn = int(torch.randint(0, 2**31 - 1, (1,)).item())
    random.seed((drawn + 3_000_009) % 2**32)
    np.random.seed((drawn + 3_000_009) % 2**32)
    torch.manual_seed((drawn + 3_000_009) % 2**32)
    expected = draws()
    assert restore_rank_rng(states, 3) == 1
    assert draws() == expected
    assert restore_rank_rng(states, 3) == 1 and draws() == expected  # a relaunch repeats itself
    assert restore_rank_rng(states, 2) == 0 and draws() != expected  # rank 2: its own seed
