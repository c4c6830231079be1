"""ElasticResume: the global batch on a resume with another world size, as the run asks."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from callbacks.elastic import ElasticResume, kept_accumulation


def _trainer(world: int, accumulate: int = 1) -> SimpleNamespace:
    return SimpleNamespace(world_size=world, accumulate_grad_batches=accumulate, is_global_zero=True, loggers=[])


def _checkpoint_of(world: int, accumulate: int, keep: bool = False) -> dict:
    saver = ElasticResume(keep_global_batch=keep)
    saver.setup(_trainer(world, accumulate), None, "fit")  # type: ignore[arg-type]
    return {"callbacks": {saver.state_key: saver.state_dict()}}


def test_kept_accumulation() -> None:
    assert [kept_accumulation(2, w) for w in (1, 2, 3, 4)] == [2, 1, None, None]
    assert kept_accumulation(6, 3) == 2


@pytest.mark.parametrize(("saved", "world", "expected"), [((2, 1), 1, 2), ((1, 2), 2, 1), ((2, 2), 1, 4),
                                                          ((2, 1), 2, 1)])
def test_keep_global_batch_sets_the_accumulation(saved: tuple[int, int], world: int, expected: int) -> None:
    callback, trainer = ElasticResume(keep_global_batch=True), _trainer(world)
    callback.setup(trainer, None, "fit")  # type: ignore[arg-type]
    callback.on_load_checkpoint(trainer, None, _checkpoint_of(*saved))  # type: ignore[arg-type]
    assert trainer.accumulate_grad_batches == expected
    assert callback.state_dict() == {"world_size": world, "accumulate": expected, "global_units": saved[0] * saved[1]}


def test_without_keep_the_global_batch_follows_the_world() -> None:
    callback, trainer = ElasticResume(), _trainer(1)
    callback.setup(trainer, None, "fit")  # type: ignore[arg-type]
    callback.on_load_checkpoint(trainer, None, _checkpoint_of(2, 1))  # type: ignore[arg-type]
    assert trainer.accumulate_grad_batches == 1 and callback.state_dict()["global_units"] == 1


def test_a_world_that_cannot_make_the_global_batch_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    callback, trainer = ElasticResume(keep_global_batch=True), _trainer(3)
    callback.setup(trainer, None, "fit")  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        callback.on_load_checkpoint(trainer, None, _checkpoint_of(2, 1))  # type: ignore[arg-type]
    assert trainer.accumulate_grad_batches == 1
    assert [r.getMessage() for r in caplog.records] == [
        "ElasticResume(keep_global_batch=True): 3 ranks cannot make the run's global batch of 2 per-device "
        "batches; it follows the world size instead."]
