"""QuietProfiler: Lightning's default profiler without a generator per hook call; the CLI's default only."""

from __future__ import annotations

import pytest
from lightning.pytorch.profilers import PassThroughProfiler, SimpleProfiler

from recipes.run.quiet_profiler import QuietProfiler


def test_profile_hands_back_one_reused_context_that_does_nothing() -> None:
    profiler = QuietProfiler()
    first, second = profiler.profile("[Callback]A.on_train_batch_end"), profiler.profile("[Strategy]B.backward")
    assert first is second  # nothing allocated per call
    assert PassThroughProfiler().profile("x") is not PassThroughProfiler().profile("x")  # Lightning's: a generator each
    with first as value:
        assert value is None
    with pytest.raises(KeyError), profiler.profile("x"):  # exceptions pass through untouched
        raise KeyError("x")
    assert profiler.summary() == ""


@pytest.mark.parametrize(("flag", "expected"),
                         [((), QuietProfiler), (("--trainer.profiler", "simple"), SimpleProfiler)])
def test_the_cli_uses_it_only_where_no_profiler_was_asked_for(fit_in_process, monkeypatch: pytest.MonkeyPatch,
                                                              flag: tuple[str, ...], expected: type) -> None:
    from recipes.run.cli import AtscaleCLI
    from tests.conftest import CONFIGS, FAST

    seen: list[type] = []
    original = AtscaleCLI.fit

    def fit(self: AtscaleCLI) -> int:
        seen.append(type(self.trainer.profiler))
        return original(self)

    monkeypatch.setattr(AtscaleCLI, "fit", fit)
    result = fit_in_process("--config", str(CONFIGS / "digits.yaml"), *FAST, "--log_model", "false",
                            "--trainer.max_steps", "2", "--run_name", "p", *flag)
    assert result.returncode == 0, result.stderr[-3000:]
    assert seen == [expected]
