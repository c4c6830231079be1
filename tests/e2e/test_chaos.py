"""The chaos soak (``python -m recipes.bench chaos``): its plan and bookkeeping, and one short real soak.

The soak drives real ``recipes.fit`` subprocesses; here with three quick, deterministic kinds (SIGTERM,
SIGKILL, a truncated checkpoint) on a one-epoch digits run, checking the report's exact structure and
that every invariant held.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from callbacks.spot import REQUEUE_EXIT_CODE
from recipes.bench import subcommands as bench
from recipes.soak.faults import INVARIANTS, KINDS, corrupt, plan_faults
from recipes.soak.launch import hung_where, parse_resume
from recipes.soak.observe import pruned_by_policy

#: Seed 24 plans sigterm and sigkill in training, then a truncated checkpoint (no --ckpt_path launch).
SEED = 24
REPORT_KEYS = {"settings", "skipped_kinds", "reference", "plan", "faults", "runs", "by_kind", "stores", "launches",
               "invariants", "ok", "elapsed_s"}
FAULT_KEYS = {"index", "kind", "run_name", "phase", "moment_s", "struck", "exit_codes", "detail", "launches",
              "furthest_step", "resumable_after", "next_resumed_from", "lost_steps", "unlogged_max", "time_to_resume_s",
              "next_launch_wall_s", "problems", "held"}
KIND_KEYS = {"count", "struck", "held", "failed", "lost_steps_mean", "lost_steps_max", "time_to_resume_mean_s",
             "time_to_resume_max_s", "exit_codes"}


def test_plan_is_seeded_and_covers_every_kind() -> None:
    plan = plan_faults(len(KINDS) + 1, KINDS, seed=5)
    assert plan == plan_faults(len(KINDS) + 1, KINDS, seed=5)
    assert plan[0].kind == "new_store_kill" and {p.kind for p in plan} == set(KINDS)
    assert [p.kind for p in plan[1:]].count("new_store_kill") == 0
    assert all(p.phase == "training" for p in plan
               if p.kind in ("corrupt", "double_launch", "skewed_rank", "frozen_rank"))
    quick = plan_faults(3, ("sigterm", "sigkill", "corrupt"), SEED)
    assert [(p.kind, p.phase) for p in quick] == [("sigterm", "training"), ("sigkill", "training"),
                                                  ("corrupt", "training")]
    assert (quick[2].corrupt_mode, quick[2].explicit) == ("truncate", False)


def test_pruning_policy_and_resume_line(tmp_path: Path) -> None:
    now = {"step=00000030.ckpt": 30, "step=00000040.ckpt": 40, "best-000-00000045.ckpt": 45}
    assert pruned_by_policy("step=00000020.ckpt", 20, now)  # two newer step checkpoints: keep=2
    assert not pruned_by_policy("step=00000035.ckpt", 35, now)  # only one newer
    assert pruned_by_policy("best-000-00000020.ckpt", 20, now) and not pruned_by_policy("best-1-50.ckpt", 50, now)
    assert parse_resume("x\nResuming from runs/d/r/checkpoints/step=00000045.ckpt (step 45).\n") == (
        "runs/d/r/checkpoints/step=00000045.ckpt", 45)
    assert parse_resume("no checkpoint") is None
    path = tmp_path / "c.ckpt"
    path.write_bytes(bytes(range(256)) * 4)
    assert corrupt(path, "truncate", 0.5) == {"mode": "truncate", "size": 1024, "new_size": 460}
    assert path.stat().st_size == 460
    assert corrupt(path, "flip", 0.1)["flipped"] == 64 and path.read_bytes() != (bytes(range(256)) * 4)[:460]


def test_a_hung_launch_is_reported_with_where_its_threads_were(tmp_path: Path) -> None:
    """A launch that does not exit is asked for its stacks (SIGABRT, faulthandler) before SIGKILL: the report says
    where each thread was, innermost frame first, so a hang seen once in CI can be read from CI's output."""
    import signal
    import subprocess
    import sys
    import time

    script = ("import threading, time\n"
              "def stuck():\n    threading.Event().wait()\n"
              "threading.Thread(target=stuck, name='writer', daemon=True).start()\n"
              "print('ready', flush=True)\n"
              "def main_loop():\n    while True:\n        time.sleep(0.05)\n"
              "main_loop()\n")
    err = tmp_path / "err"
    with open(err, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=stderr,
                                env={"PYTHONFAULTHANDLER": "1"}, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    time.sleep(0.2)
    proc.send_signal(signal.SIGABRT)
    assert proc.wait(30) == -signal.SIGABRT
    where = hung_where(err.read_text())
    lines = where.splitlines()
    assert lines[0].startswith("current thread: ") and "in main_loop" in lines[0] and "<string>" in lines[0]
    assert any(line.startswith("thread: ") and "in stuck" in line for line in lines[1:]), where
    assert hung_where("no dump here\n") == ""


@pytest.mark.e2e
@pytest.mark.slow(covered_by="tests/e2e/test_chaos.py::test_soak_of_the_faults_users_launch_into")  # CI's time
def test_soak_of_three_faults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "chaos.json"
    code = bench.main(["chaos", "--faults", "3", "--kinds", "sigterm,sigkill,corrupt", "--seed", str(SEED),
                       "--epochs", "1", "--workdir", str(tmp_path / "soak"), "--out", str(out)])
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    print(printed)  # the soak's own lines and tables, shown if an assertion fails
    assert set(report) == REPORT_KEYS
    assert [f["kind"] for f in report["faults"]] == ["sigterm", "sigkill", "corrupt"]
    for fault in report["faults"]:
        assert set(fault) == FAULT_KEYS
        assert fault["struck"], json.dumps(fault, indent=1)
        assert fault["lost_steps"] is not None and fault["lost_steps"] >= 0
    truncated = report["faults"][2]["detail"]
    assert truncated["mode"] == "truncate" and truncated["new_size"] < truncated["size"]
    assert truncated["explicit"] is False
    assert set(report["by_kind"]) == {"sigterm", "sigkill", "corrupt"}
    assert all(set(row) == KIND_KEYS and row["count"] == 1 for row in report["by_kind"].values())
    assert set(report["invariants"]) == set(INVARIANTS)
    assert "Chaos soak" in printed and "Invariants" in printed
    # the final invariants: one run, finished, bitwise equal to the reference, one FINISHED MLflow run, ...
    (run,) = report["runs"]
    assert run["checks"]["tensors_different"] == [] and run["checks"]["tensors"] > 0
    assert [r["status"] for r in run["checks"]["mlflow_runs"]] == ["FINISHED"]
    # the goodput ledger against the faults (recipes/soak/ledger.py states the tolerances)
    ledger = run["checks"]["ledger"]
    assert sum(ledger["ledger"]["seconds"].values()) == pytest.approx(ledger["ledger"]["billed_s"], rel=1e-3)
    # the ledger counts every step run (the steps file); the soak's own count reads the loss history, which a
    # SIGKILL can cut short (seen: ledger 10, history 5): the history's count is a lower bound
    assert ledger["lost_steps"]["ledger"] >= ledger["lost_steps"]["faults"]
    assert ledger["ledger"]["usd"]["startup"] == pytest.approx(ledger["ledger"]["seconds"]["startup"] / 1000)
    words = " ".join(printed.split())  # the console wraps long lines
    assert f"{run['name']}: goodput " in words and "launch(es) on the books" in words
    failed = {name: v["problems"] for name, v in report["invariants"].items() if not v["ok"]}
    assert failed == {}
    assert report["ok"] is True and code == 0


@pytest.mark.e2e
def test_soak_of_the_faults_users_launch_into(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture) -> None:
    """A signal to the whole process group with loader workers, and the run's command relaunched without --run_name:
    every invariant holds (bitwise, one FINISHED MLflow run, no traceback, no other run opened)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "chaos.json"
    code = bench.main(["chaos", "--faults", "2", "--kinds", "group_signal,default_name", "--seed", str(SEED),
                       "--epochs", "1", "--workers", "2", "--workdir", str(tmp_path / "soak"), "--out", str(out)])
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    print(printed)
    assert sorted(f["kind"] for f in report["faults"]) == ["default_name", "group_signal"]
    assert all(f["struck"] for f in report["faults"]), json.dumps(report["faults"], indent=1)
    # the report's shape and the goodput ledger, as test_soak_of_three_faults (the slow tier) checks them too
    assert set(report) == REPORT_KEYS and all(set(fault) == FAULT_KEYS for fault in report["faults"])
    assert set(report["invariants"]) == set(INVARIANTS) and "Chaos soak" in printed and "Invariants" in printed
    (run,) = report["runs"]
    ledger = run["checks"]["ledger"]
    assert sum(ledger["ledger"]["seconds"].values()) == pytest.approx(ledger["ledger"]["billed_s"], rel=1e-3)
    assert ledger["lost_steps"]["ledger"] >= ledger["lost_steps"]["faults"]
    assert re.fullmatch(r"digits-[0-9a-f]{8}", run["name"])  # named by its command, as the default-name launch is
    assert run["checks"]["tensors_different"] == [] and [r["status"] for r in run["checks"]["mlflow_runs"]] == [
        "FINISHED"]
    failed = {name: v["problems"] for name, v in report["invariants"].items() if not v["ok"]}
    assert failed == {}
    assert report["ok"] is True and code == 0


def test_the_launch_kinds_need_workers(capsys: pytest.CaptureFixture) -> None:
    assert bench.main(["chaos", "--faults", "1", "--kinds", "group_signal", "--workers", "0"]) == 2
    assert "group_signal needs --workers 1 or more" in capsys.readouterr().err


# --------------------------------------------------------------------------- what the bucket outage found
class _Unreachable:
    """An fsspec filesystem whose every call fails as s3fs does when the endpoint is down (botocore's own error)."""

    def __getattr__(self, name: str):
        from botocore.exceptions import EndpointConnectionError

        def call(*args, **kwargs):
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9/atscale-chaos/x")

        return call


def test_an_unreachable_bucket_is_a_store_error_naming_the_url(tmp_path: Path) -> None:
    """The CLI turns OSError/StoreError into one line; botocore's connection errors were neither (a traceback)."""
    from callbacks.storage import ckpt_store
    from callbacks.storage.remote_store import RemoteCheckpoints, StoreError

    url = "s3://atscale-chaos/runs/digits/r/checkpoints"
    remote = RemoteCheckpoints(url, tmp_path / "staged")
    remote.fs = _Unreachable()
    expected = (f"^{url}: the object store did not answer \\(EndpointConnectionError: Could not connect to the "
                f"endpoint URL: \"http://127.0.0.1:9/atscale-chaos/x\"\\)$")
    for call in (remote.records, remote.fetch_newest_good, lambda: remote.fetch_named("step=00000005.ckpt")):
        with pytest.raises(StoreError, match=expected):
            call()
    staged = tmp_path / "staged" / "step=00000005.ckpt"
    staged.parent.mkdir(parents=True)
    size, sha = ckpt_store.atomic_write(staged, lambda handle: handle.write(b"weights"))
    ckpt_store.write_record(staged, global_step=5, epoch=0, size=size, sha256=sha)
    with pytest.raises(StoreError, match=expected):
        remote.publish(staged)
    assert remote.try_publish(staged) is False  # during training: logged, not raised


def test_connection_errors_of_abandoned_transfers_are_not_printed(caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp leaves a reset upload's write task unretrieved: asyncio printed its traceback on stderr mid-run."""
    import asyncio
    import gc

    import fsspec.asyn

    from callbacks.storage.remote_store import filesystem

    filesystem("s3://atscale-chaos/runs")  # as every remote run does first

    async def leak(error: BaseException) -> None:
        async def fail() -> None:
            raise error

        task = asyncio.ensure_future(fail())
        await asyncio.sleep(0)
        del task

    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        fsspec.asyn.sync(fsspec.asyn.get_loop(), leak, ConnectionResetError("Cannot write to closing transport"))
        gc.collect()
        unretrieved = [r for r in caplog.records if r.getMessage().startswith("Task exception was never retrieved")]
        assert unretrieved == []
        fsspec.asyn.sync(fsspec.asyn.get_loop(), leak, ValueError("a real bug"))  # anything else is still reported
        gc.collect()
    (reported,) = [r for r in caplog.records if r.getMessage().startswith("Task exception was never retrieved")]
    assert reported.levelno == logging.ERROR and "a real bug" in repr(reported.exc_info[1])


def test_bucket_outage_needs_an_object_store(capsys: pytest.CaptureFixture) -> None:
    assert bench.main(["chaos", "--faults", "1", "--kinds", "bucket_outage"]) == 2
    assert capsys.readouterr().err == "error: --kinds bucket_outage: bucket_outage needs --store s3\n"
    (outage,) = plan_faults(1, ("bucket_outage",), 10)  # the e2e soak's: cut connections 8.51 s, SIGTERM inside
    assert (outage.phase, outage.corrupt_mode, round(2 + 8 * outage.cut, 2), outage.explicit) == (
        "training", "truncate", 8.51, True)


@pytest.mark.parametrize("kind", ["skewed_rank", "frozen_rank"])
def test_rank_faults_need_several_ranks(kind: str, capsys: pytest.CaptureFixture) -> None:
    assert bench.main(["chaos", "--faults", "1", "--kinds", kind]) == 2
    assert capsys.readouterr().err == f"error: --kinds {kind}: {kind} needs --ddp\n"


@pytest.mark.e2e
@pytest.mark.slow(covered_by="tests/e2e/test_chaos.py::test_soak_of_the_faults_users_launch_into")
def test_soak_of_a_bucket_outage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture) -> None:
    """The bucket drops every connection for 8.5 s from early in training, with a SIGTERM 4.3 s in: the notice save
    waits out the outage; the relaunch resumes from the newest complete checkpoint and ends bitwise equal, in the
    bucket too."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "chaos.json"
    code = bench.main(["chaos", "--store", "s3", "--faults", "1", "--kinds", "bucket_outage", "--seed", "10",
                       "--epochs", "1", "--workdir", str(tmp_path / "soak"), "--out", str(out)])
    report = json.loads(out.read_text())
    print(capsys.readouterr().out)
    assert report["settings"]["store"] == "s3" and set(report["invariants"]) == set(INVARIANTS)
    (fault,) = report["faults"]
    assert fault["kind"] == "bucket_outage" and fault["struck"], json.dumps(fault, indent=1)
    assert {k: fault["detail"][k] for k in ("mode", "planned_s", "sigterm_during")} == {
        "mode": "reset", "planned_s": 8.51, "sigterm_during": True}
    assert fault["detail"]["outage_s"] >= 8.51
    (launch,) = fault["launches"]
    # signalled in training, during the outage: the notice save waits the outage out, then the run stops to resume
    assert launch["signals"][0][0] == "SIGTERM" and launch["exit_code"] == REQUEUE_EXIT_CODE, json.dumps(launch)
    assert "still_running_after_s" not in fault["detail"]
    assert not launch["traceback"]
    (run,) = report["runs"]
    assert run["checks"]["bucket_checkpoint"][1] == report["reference"]["final"][1]
    assert run["checks"]["bucket_tensors_different"] == [] and run["checks"]["tensors_different"] == []
    assert [r["status"] for r in run["checks"]["mlflow_runs"]] == ["FINISHED"]
    failed = {name: v["problems"] for name, v in report["invariants"].items() if not v["ok"]}
    assert failed == {}
    assert report["ok"] is True and code == 0


@pytest.mark.e2e
@pytest.mark.slow(covered_by="tests/unit/recipes/test_soak_dataset.py::test_a_damaged_launch_is_judged_by_its_exit_line_and_steps")
def test_soak_of_damaged_and_replaced_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture) -> None:
    """The streamed run as users stream it: after a notice at step 4 (exit 75) its folder holds the set split with
    another seed (the relaunch refused, exit 2, both digests, the MLflow run left KILLED); then chunk 18 damaged in a
    launch's start-up (exit 65 after 38 steps: batch 38 is the first with one of its items). Each put back, the same
    command resumes and the run ends bitwise equal to the uninterrupted reference, which read only the prepared
    data."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "chaos.json"
    code = bench.main(["chaos", "--faults", "2", "--kinds", "chunk_damaged,dataset_replaced", "--seed", "2",
                       "--epochs", "1", "--workdir", str(tmp_path / "soak"), "--out", str(out)])
    report = json.loads(out.read_text())
    print(capsys.readouterr().out)
    assert set(report["invariants"]) == set(INVARIANTS) and "--data.url" in report["settings"]["command"]
    replaced, damaged = report["faults"]
    assert replaced["kind"] == "dataset_replaced" and replaced["exit_codes"] == [REQUEUE_EXIT_CODE, 2], json.dumps(
        replaced, indent=1)
    assert replaced["detail"]["drill_step"] == 4 and replaced["detail"]["mlflow_status"] == ["KILLED"]
    assert replaced["detail"]["line"].startswith(
        f"atscale: the data at {tmp_path}/soak/data/digits has index digest {replaced['detail']['index_digest'][:12]}, "
        f"not the {replaced['detail']['began_with'][:12]} this run began with: ")
    assert replaced["launches"][1]["furthest_step"] is None  # not a step on the other data
    assert damaged["kind"] == "chunk_damaged" and damaged["exit_codes"] == [65], json.dumps(damaged, indent=1)
    detail = damaged["detail"]
    assert {k: detail[k] for k in ("target", "when", "flipped", "repaired", "first_damaged_step")} == {
        "target": "chunk-0-18.bin", "when": "in its start-up", "flipped": 64, "repaired": True,
        "first_damaged_step": 38}
    assert detail["line"].startswith(f"atscale: the streamed data at {tmp_path}/soak/data/digits/train is damaged: "
                                     "chunk-0-18.bin: SHA-256 ")
    assert damaged["launches"][0]["furthest_step"] <= 38
    (run,) = report["runs"]
    assert run["checks"]["tensors_different"] == [] and [r["status"] for r in run["checks"]["mlflow_runs"]] == [
        "FINISHED"]
    failed = {name: v["problems"] for name, v in report["invariants"].items() if not v["ok"]}
    assert failed == {}
    assert report["ok"] is True and code == 0
