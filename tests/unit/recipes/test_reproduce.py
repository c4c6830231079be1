"""recipes.reproduce on a run that was interrupted and resumed: its spot/* metrics record the machine's
interruptions, not the training, so the default comparison must leave them out (found on the team server:
a resumed run was "NOT reproduced" by spot/interruptions and spot/lost_steps alone)."""

from __future__ import annotations

import fnmatch

from recipes.reproduce import DEFAULT_IGNORE, compare_metrics


def test_spot_metrics_are_not_compared_by_default() -> None:
    spot = ["spot/interruptions", "spot/lost_steps", "spot/notice_to_saved_s", "spot/upload_s"]
    assert [k for k in spot if not any(fnmatch.fnmatch(k, p) for p in DEFAULT_IGNORE)] == []
    original = {"val/acc": 0.94444442, "spot/interruptions": 1.0, "spot/lost_steps": 0.0}
    rerun = {"val/acc": 0.94444442}
    kept = {k: v for k, v in original.items() if not any(fnmatch.fnmatch(k, p) for p in DEFAULT_IGNORE)}
    assert [(d.key, d.within(0.0)) for d in compare_metrics(kept, rerun)] == [("val/acc", True)]
