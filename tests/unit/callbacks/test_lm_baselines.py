"""LMBaselines: kept in the checkpoint, so that a resumed fit logs them without counting them again."""

from __future__ import annotations

from types import SimpleNamespace

from callbacks.lm_baselines import LMBaselines
from tests.conftest import RecordingLogger


class _Counts:
    def __init__(self) -> None:
        self.asked = 0

    def baseline_bits_per_byte(self) -> dict[str, float]:
        self.asked += 1
        return {"unigram": 4.5, "bigram": 3.25}


def test_a_resumed_fit_restores_the_figures_instead_of_counting_again() -> None:
    logger, data = RecordingLogger(), _Counts()
    trainer = SimpleNamespace(is_global_zero=True, datamodule=data, loggers=[logger])
    first = LMBaselines()
    first.on_fit_start(trainer, None)  # type: ignore[arg-type]
    expected = {"baseline/unigram_bpb": 4.5, "baseline/bigram_bpb": 3.25}
    assert logger.calls == [(0, expected)] and first.state_dict() == {"results": expected}
    resumed = LMBaselines()
    resumed.load_state_dict(first.state_dict())
    resumed.on_fit_start(trainer, None)  # type: ignore[arg-type]
    assert data.asked == 1 and logger.calls == [(0, expected)] * 2  # logged from the checkpoint, not counted
    assert resumed.summary_rows({"val/bpb": 2.0}) == [("baseline/unigram_bpb", "4.5000  (model -2.5000)"),
                                                      ("baseline/bigram_bpb", "3.2500  (model -1.2500)")]
    old = LMBaselines()
    old.load_state_dict({})  # a checkpoint written before the figures were kept: counted again
    old.on_fit_start(trainer, None)  # type: ignore[arg-type]
    assert data.asked == 2 and old.results == expected and len(logger.calls) == 3
