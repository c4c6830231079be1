"""callbacks.utils.resume_record: the steps a resume redoes, from the metric history and from the steps file."""

from __future__ import annotations

from types import SimpleNamespace

from callbacks.analysis.keys import TRAIN_LOSS_KEY
from callbacks.utils.resume_record import lost_steps


class History:
    """An MLflow client whose ``train/loss`` history holds the given (0-based) steps."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = steps

    def get_metric_history(self, run_id: str, key: str) -> list[SimpleNamespace]:
        assert key == TRAIN_LOSS_KEY
        return [SimpleNamespace(step=s) for s in self.steps]


def test_lost_steps_count_every_step_with_the_steps_file() -> None:
    """Issue 47's reproduction: an attempt resumed from step 50 (checkpoint) ran to step 83 and was killed;
    logged every 25 steps, its loss history ends at step 75, so the history counts 25 lost steps where the
    steps file (83 run, none lost before) counts 33, as cost/lost_steps did."""
    logger = SimpleNamespace(experiment=History([24, 49, 74]), run_id="r")
    assert lost_steps([logger], resumed_step=50) == 25
    assert lost_steps([logger], resumed_step=50, steps_run=83) == 33
    # the attempt after it ran to step 90 and was killed too: 123 steps run since the start, none lost in the
    # checkpoint at 50: 73 steps lost since it (33 + 40), as CostTracker counts them
    assert lost_steps([logger], resumed_step=50, steps_run=123) == 73
    # a checkpoint that already counted 10 lost steps (its own earlier interruptions) leaves them out
    assert lost_steps([logger], resumed_step=50, steps_run=93, saved_lost=10) == 33
    assert lost_steps([], resumed_step=50) == 0  # no logger, no steps file: nothing known
