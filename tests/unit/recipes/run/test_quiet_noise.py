"""``recipes.run.process.quiet_known_noise``: the harmless lines a user cannot act on go, real warnings stay."""

from __future__ import annotations

import warnings

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from recipes.run.process import quiet_known_noise


def test_a_resume_does_not_warn_that_its_own_checkpoint_directory_is_not_empty() -> None:
    # Lightning's ModelCheckpoint says this on every resume: the directory holds the run's own checkpoints
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_noise()
        rank_zero_warn("Checkpoint directory /r/runs/digits/a/checkpoints exists and is not empty.")
        rank_zero_warn("The dataloader does not have many workers which may be a bottleneck.")
    assert [str(w.message) for w in caught] == [
        "The dataloader does not have many workers which may be a bottleneck."]
