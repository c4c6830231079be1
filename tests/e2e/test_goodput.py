"""The goodput ledger on the real CLI: a digits run SIGTERMed twice, losing work once, relaunched to its end.

Launch 1 saves every 20 steps and takes a fire-drill SIGTERM at step 39 (notice save at 39, exit 75). Its
notice checkpoint is then deleted, as if the save had not made it before the kill, so launch 2 resumes from
step 20 and reruns steps 21-39 (19 steps lost, counted from the steps sidecar), takes the same drill's SIGTERM
at step 39 again and saves; launch 3 resumes there and finishes. One device, then DDP on 2 processes.

Asserted from the MLflow run, every launch's logged points:
- at every logged point, ``goodput/*_s`` sums to ``cost/billed_s`` within 0.1 % (by construction it is exact
  to rounding: the ledger files every second of the bill's clock);
- ``goodput/redone_s`` equals ``cost/lost_steps`` x the mean step time (``cost/lost_work_usd`` over the price:
  the same count, one figure) within 5 % (exact by construction, to rounding);
- the lost steps are the ones the resume point implies, in ``cost/lost_steps``, ``spot/lost_steps`` (summed over
  the resumes) and the summary table;
- the summary table gains the goodput share, the largest badputs and the measured reruns; ``goodput.png``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from callbacks.spot import REQUEUE_EXIT_CODE
from tests.conftest import CONFIGS, FAST, client_for, run_fit, runs_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

EVERY, DRILL = 20, 39
BASE = ("--config", str(CONFIGS / "digits.yaml"), *FAST, "--log_model", "false",
        "--trainer.log_every_n_steps", "5", "--cost.log_every_n_steps", "5",
        "--spot.every_n_steps", str(EVERY), "--spot.save_on_train_epoch_end", "false",
        "--spot.drill_steps", f"[{DRILL}]", "--cost.instance", "a3-highgpu-1g", "--cost.market", "spot")
DDP = ("--config", str(CONFIGS / "strategy/ddp.yaml"))
SUM_TOLERANCE = 1e-3  # the 0.1 %
REDONE_TOLERANCE = 0.05  # the 5 %
CATEGORIES = ("productive", "startup", "redone", "checkpoint", "validation", "data_wait", "comm_exposed", "tail",
              "restart")


def interrupted_twice(workdir: Path, *extra: str) -> tuple[list, str, int]:
    """Run the three launches; returns the run's logged points, the last launch's output and the steps lost."""
    args = (*BASE, *extra, "--run_name", "gp", "--trainer.max_steps", "46")
    first = run_fit(workdir, *args)
    assert first.returncode == REQUEUE_EXIT_CODE, first.stderr[-3000:]
    ckpt_dir = workdir / "runs" / "digits" / "gp" / "checkpoints"
    notice = sorted(ckpt_dir.glob(f"step={DRILL:08d}*"))
    assert notice, sorted(p.name for p in ckpt_dir.iterdir())
    for path in notice:  # the notice save "did not make it": the relaunch falls back to an older one
        path.unlink()
    second = run_fit(workdir, *args)
    assert second.returncode == REQUEUE_EXIT_CODE, second.stderr[-3000:]
    resumed = re.search(r"\(step (\d+)\)\.", second.stderr)  # the checkpoint it resumed from
    assert resumed, second.stderr[-3000:]
    third = run_fit(workdir, *args)
    assert third.returncode == 0, third.stderr[-3000:]
    (run,) = runs_of(workdir, "digits")
    client = client_for(workdir)
    keys = ["cost/billed_s", "cost/lost_steps", "spot/lost_steps", "cost/lost_work_usd", "cost/instances",
            "goodput/share", *(f"goodput/{c}_s" for c in CATEGORIES)]
    points: dict[tuple[int, int], dict[str, float]] = {}
    for key in keys:
        for m in client.get_metric_history(run.info.run_id, key):
            points.setdefault((m.timestamp, m.step), {})[key] = m.value
    return [points[k] for k in sorted(points)], third.stdout + third.stderr, DRILL - int(resumed.group(1))


def check(points: list[dict[str, float]], output: str, lost: int) -> None:
    complete = [p for p in points if "cost/billed_s" in p and all(f"goodput/{c}_s" in p for c in CATEGORIES)]
    assert len(complete) >= 6, points
    for point in complete:
        total = sum(point[f"goodput/{c}_s"] for c in CATEGORIES)
        assert total == pytest.approx(point["cost/billed_s"], rel=SUM_TOLERANCE), point
    final = complete[-1]
    assert final["cost/lost_steps"] == lost
    # SpotCheckpoint's count at each resume is the same count (the loss history alone, logged every 5 steps, says 15)
    assert sum(p["spot/lost_steps"] for p in points if "spot/lost_steps" in p) == lost
    # the same count: lost x mean step x instances x $4.42/h (a3-highgpu-1g spot; DDP bills 2 instances)
    mean_step_s = final["cost/lost_work_usd"] / lost / final["cost/instances"] / (4.42 / 3600)
    assert final["goodput/redone_s"] == pytest.approx(lost * mean_step_s, rel=REDONE_TOLERANCE), final
    assert final["goodput/restart_s"] > 0 and final["goodput/startup_s"] > 0
    assert 0 < final["goodput/share"] < 1
    assert f"({lost} steps redone x " in output
    assert "goodput " in output and "badput: " in output and "goodput.png" in output
    # the reruns as measured (a save that precedes a step's end in the callbacks' order leaves that step out)
    assert re.search(r"reruns measured\s*│\s*[0-9]+ steps in [0-9.]+ s", output), output[-3000:]


def test_sigtermed_twice_single_device(tmp_path: Path) -> None:
    points, output, lost = interrupted_twice(tmp_path)
    assert lost == DRILL - EVERY  # from step 20's periodic save
    check(points, output, lost)
    assert (tmp_path / "runs" / "digits" / "gp" / "goodput.png").is_file()


@pytest.mark.slow(covered_by="tests/e2e/test_goodput.py::test_sigtermed_twice_single_device")
def test_sigtermed_twice_ddp(tmp_path: Path) -> None:
    points, output, lost = interrupted_twice(tmp_path, *DDP)
    assert lost in (DRILL - EVERY, DRILL - 23)  # 23 batches a rank: the epoch-end save may be the newest
    check(points, output, lost)
