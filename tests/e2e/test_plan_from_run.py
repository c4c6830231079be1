"""recipes.plan --run: the measured step time, steps and scaling law of a finished run, by hand.

Synthetic MLflow runs (exact start/end times and metrics) check each source and error; one real
``recipes.fit`` run of the digits recipe, tracked with a CostTracker, checks the whole path.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import mlflow
import pytest
from mlflow.entities import Metric, Param

from recipes.plan import main
from tests.conftest import CONFIGS, FAST, cli_env, client_for, run_fit, runs_of

ARGS = ["--instance", "a3-highgpu-1g", "--interruption-rate", "0.05", "--json"]
START_MS = 1_700_000_000_000


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> mlflow.MlflowClient:
    cli_env(tmp_path)  # copies the migrated template store to tmp_path/mlflow.db
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return client_for(tmp_path)


def _run(client: mlflow.MlflowClient, tmp_path: Path, metrics: dict[str, list[tuple[int, float]]],
         params: dict[str, str] | None = None, duration_s: float | None = 90.0,
         tags: dict[str, str] | None = None) -> str:
    """A run with these metric histories ({key: [(step, value)]}), lasting ``duration_s`` (None: running)."""
    name = f"exp-{len(client.search_experiments())}"
    exp = client.create_experiment(name, artifact_location=str(tmp_path / "artifacts" / name))
    run_id = client.create_run(exp, start_time=START_MS, tags=tags or {}).info.run_id
    client.log_batch(run_id, metrics=[Metric(k, v, START_MS, step) for k, hist in metrics.items() for step, v in hist],
                     params=[Param(k, v) for k, v in (params or {}).items()])
    if duration_s is not None:
        client.set_terminated(run_id, "FINISHED", end_time=START_MS + int(duration_s * 1000))
    return run_id


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = main(list(argv))
    out = capsys.readouterr().out
    return code, json.loads(out) if code in (0, 1) else {}


def _row(out: dict[str, Any], devices: int, market: str) -> dict[str, Any]:
    return next(r for r in out["rows"] if (r["devices"], r["market"]) == (devices, market))


LOSS = [(s, 1.0) for s in range(100)]  # a training metric after step k carries step k - 1


def test_an_elastic_run_is_planned_from_its_last_world_size_and_that_sizes_serial_fraction(
        tmp_path, store, capsys) -> None:
    """A run trained on 2, then resumed on 1 device: the serial fraction measured at the world size of the record."""
    run_id = _run(store, tmp_path, {"train/loss": LOSS, "val/acc": [(100, 0.9)],
                                    "amdahl/serial_fraction": [(40, 0.3), (100, 0.1)],
                                    "amdahl/serial_fraction/world_2": [(40, 0.3)],
                                    "amdahl/serial_fraction/world_1": [(100, 0.1)]},
                  params={"trainer.devices": "2", "trainer.num_nodes": "1"})
    code, out = _plan(capsys, "--run", run_id, "--devices", "1,2", *ARGS)
    assert code == 0
    src = out["run"]
    assert src["world_size"] == 2  # the params (no manifest here) say 2: the world_2 record is the one to use
    assert src["scaling_law_source"] == "the run's amdahl/serial_fraction/world_2 (measured on 2 devices)"
    assert out["inputs"]["scaling_law"] == "Amdahl s=0.3"


def test_wall_duration_over_steps_scaled_to_one_device(tmp_path, store, capsys) -> None:
    """No timing metrics: 90 s / 100 steps on 2 devices = 0.9 s a step at N=2, so 0.9 x C(2) on one device."""
    run_id = _run(store, tmp_path, {"train/loss": LOSS, "val/acc": [(100, 0.9)], "amdahl/serial_fraction": [(100, 0.2)],
                                    "system/cpu_utilization_percentage": [(500, 3.0)]},  # samples, not steps
                  params={"trainer.devices": "2", "trainer.num_nodes": "1"})
    code, out = _plan(capsys, "--run", run_id, "--devices", "1,2", *ARGS)
    assert code == 0
    c2 = 1 / (0.2 + 0.8 / 2)  # Amdahl s = 0.2 at N = 2: 1.6667
    src = out["run"]
    assert (src["run_id"], src["steps"], src["world_size"]) == (run_id, 100, 2)
    assert src["measured_step_s"] == pytest.approx(0.9, rel=1e-12)
    assert src["step_time_s"] == pytest.approx(0.9 * c2, rel=1e-12)  # 1.5 s
    assert src["step_time_source"] == "wall duration 90 s / 100 steps (MLflow run start to end)"
    assert src["world_size_source"] == "params trainer.devices x trainer.num_nodes"
    assert src["scaling_law_source"] == "the run's amdahl/serial_fraction"
    assert out["inputs"]["scaling_law"] == "Amdahl s=0.2"
    # one device: 100 x 1.5 s = 150 s on-demand; two: 150 s / C(2) = 90 s (the run itself) on 2 instances
    assert _row(out, 1, "on_demand")["cost_usd"] == pytest.approx(150 / 3600 * 11.06, rel=1e-12)
    assert _row(out, 2, "on_demand")["wall_h"] == pytest.approx(90 / 3600, rel=1e-12)
    assert _row(out, 2, "on_demand")["cost_usd"] == pytest.approx(90 / 3600 * 11.06 * 2, rel=1e-12)


def test_timing_metrics_are_preferred_and_flags_override(tmp_path, store, capsys) -> None:
    mean = _run(store, tmp_path, {"train/loss": LOSS, "time/step_s": [(10, 0.4), (20, 0.6)],
                                  "time/mean/step_s": [(100, 0.5)]})
    code, out = _plan(capsys, "--run", mean, "--serial-fraction", "0.1", "--devices", "1", *ARGS)
    assert code == 0
    assert (out["run"]["measured_step_s"], out["run"]["step_time_source"]) == (
        0.5, "time/mean/step_s (StepTiming's run mean)")
    assert out["run"]["world_size_source"] == "assumed: no manifest.json and trainer.devices=None"
    assert _row(out, 1, "on_demand")["wall_h"] == pytest.approx(100 * 0.5 / 3600, rel=1e-12)
    windows = _run(store, tmp_path, {"train/loss": LOSS, "time/step_s": [(10, 0.4), (20, 0.6), (30, 0.8)]})
    code, out = _plan(capsys, "--run", windows, "--serial-fraction", "0.1", "--devices", "1", *ARGS)
    assert out["run"]["measured_step_s"] == pytest.approx(0.6, rel=1e-12)
    assert out["run"]["step_time_source"] == "mean of 3 time/step_s windows"
    code, out = _plan(capsys, "--run", windows, "--serial-fraction", "0.1", "--steps", "5000", "--step-time", "2",
                      "--devices", "1", *ARGS)
    assert (out["inputs"]["steps"], out["inputs"]["step_time_s"]) == (5000, 2.0)
    assert (out["run"]["steps_source"], out["run"]["step_time_source"]) == ("--steps", "--step-time")
    assert _row(out, 1, "on_demand")["cost_usd"] == pytest.approx(10_000 / 3600 * 11.06, rel=1e-12)


def test_scaling_law_from_a_scale_parent_run(tmp_path, store, capsys) -> None:
    run_id = _run(store, tmp_path, {"train/loss": LOSS, "time/mean/step_s": [(100, 1.0)],
                                    "amdahl/serial_fraction": [(100, 0.3)]})
    fit = {"scale/amdahl_serial_fraction": [(0, 0.05)], "scale/usl_a": [(0, 0.02)], "scale/usl_b": [(0, 0.001)]}
    usl = _run(store, tmp_path, fit, tags={"atscale.best_law": "usl"})
    code, out = _plan(capsys, "--run", run_id, "--scale-run", usl, "--devices", "4", *ARGS)
    assert code == 0
    assert out["inputs"]["scaling_law"] == "USL a=0.02 b=0.001"
    assert out["run"]["scaling_law_source"] == f"USL fit of recipes.scale run {usl} (best R²)"
    c4 = 4 / (1 + 0.02 * 3 + 0.001 * 4 * 3)  # 3.7453
    assert _row(out, 4, "on_demand")["wall_h"] == pytest.approx(100 * 1.0 / c4 / 3600, rel=1e-12)
    # the sweep's fit also serves the explicit mode
    code, explicit = _plan(capsys, "--step-time", "1", "--steps", "100", "--scale-run", usl, "--devices", "4", *ARGS)
    assert (code, explicit["rows"]) == (0, out["rows"])
    amdahl = _run(store, tmp_path, fit, tags={"atscale.best_law": "amdahl"})
    code, out = _plan(capsys, "--run", run_id, "--scale-run", amdahl, "--devices", "4", *ARGS)
    assert out["inputs"]["scaling_law"] == "Amdahl s=0.05"
    assert out["run"]["run_serial_fraction"] == 0.3  # measured by the run, not used: the sweep's fit wins
    # issue 47: the run's one-process projection stands beside the sweep's measured fit, and says what it is
    assert out["run"]["projection_note"] == ("measured by the sweep; the run's own one-process projection, s=0.3 "
                                             "(x1.54 at N=2), stands beside it")
    code, alone = _plan(capsys, "--run", run_id, "--devices", "4", *ARGS)
    assert alone["run"]["projection_note"].startswith("a projection, not a measurement: Amdahl from one process's")


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--run", "0123456789abcdef"], "unknown run '0123456789abcdef'"),
        (["--run", "{run}", "--scale-run", "feedface"], "unknown --scale-run 'feedface'"),
        (["--run", "{run}"], "no scaling law: run {run} logged no amdahl/serial_fraction; give --scale-run"),
        (["--run", "{run}", "--scale-run", "{run}"], "--scale-run {run} logged no scale/amdahl_serial_fraction"),
        (["--run", "{run}", "--scale-run", "x", "--serial-fraction", "0.1"], "--scale-run x or --serial-fraction 0.1"),
        (["--run", "{running}", "--serial-fraction", "0.1"], "run {running} has not finished (status RUNNING)"),
        (["--run", "{run}", "--serial-fraction", "0.1", "--interruption-rate", "1.5"], "interruption rate 1.5"),
        (["--run", "{run}", "--serial-fraction", "0.1", "--instance", "a9-megagpu"], "unknown instance 'a9-megagpu'"),
    ],
)
def test_bad_input_exits_2_naming_it(tmp_path, store, capsys, argv, named) -> None:
    ids = {"run": _run(store, tmp_path, {"train/loss": LOSS}),
           "running": _run(store, tmp_path, {"train/loss": LOSS}, duration_s=None)}
    argv = [a.format(**ids) for a in argv]
    code = main([*ARGS[:-1], *argv])  # later flags win: --instance / --interruption-rate of a case replace ARGS'
    err = capsys.readouterr().err
    assert code == 2
    assert named.format(**ids) in err
    assert len(err.strip().splitlines()) == 1


def test_missing_store_and_run_dir_without_records(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'none.db'}")
    assert main(["--run", "abc", *ARGS]) == 2
    assert f"no MLflow store at sqlite:///{tmp_path / 'none.db'}" in capsys.readouterr().err
    assert not (tmp_path / "none.db").exists()  # not created as a side effect
    cli_env(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    (tmp_path / "empty-run" / "checkpoints").mkdir(parents=True)
    assert main(["--run", str(tmp_path / "empty-run"), *ARGS]) == 2
    assert "has no checkpoint record naming its MLflow run" in capsys.readouterr().err


def test_from_a_real_digits_run_with_cost_tracking(tmp_path, monkeypatch, capsys) -> None:
    """One real run (with a CostTracker on a3-highgpu-1g spot), then the plan from its record."""
    result = run_fit(tmp_path, "--config", str(CONFIGS / "digits.yaml"), "--trainer.max_epochs", "1", *FAST,
                     "--cost.instance", "a3-highgpu-1g",
                     "--cost.market", "spot")
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs_of(tmp_path, "digits")
    client = client_for(tmp_path)
    metrics = run.data.metrics

    # The cost callback, in the real run: $ = billed hours x price, both markets, no interruption.
    billed = metrics["cost/billed_s"]
    assert 0 < billed < 300
    assert metrics["cost/usd"] == pytest.approx(billed / 3600 * 4.42, rel=1e-9)
    assert metrics["cost/usd_on_demand"] == pytest.approx(billed / 3600 * 11.06, rel=1e-9)
    assert metrics["cost/savings_pct"] == pytest.approx(100 * (1 - 4.42 / 11.06), rel=1e-12)
    assert (metrics["cost/lost_steps"], metrics["cost/lost_work_usd"], metrics["cost/instances"]) == (0, 0, 1)
    # every 100 steps (the CLI's cost default) and at train end: one epoch of 45 steps logs once
    assert [m.step for m in client.get_metric_history(run.info.run_id, "cost/usd")] == [45]
    assert "spot (1 x a3-highgpu-1g" in result.stdout  # the end table's cost row

    # By hand from the record: the steps from the run directory's checkpoint records, the step time from
    # StepTiming's run mean (every CLI run logs it), on one device (the manifest's world size 1: C(1) = 1).
    (run_dir,) = (tmp_path / "runs" / "digits").iterdir()
    steps = max(json.loads(p.read_text())["global_step"] for p in (run_dir / "checkpoints").glob("*.meta.json"))
    assert steps == max(m.step for m in client.get_metric_history(run.info.run_id, "cost/usd"))  # 45
    step_s = metrics["time/mean/step_s"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    argv = ["--serial-fraction", "0.1", "--devices", "1,2,8", *ARGS]
    code, out = _plan(capsys, "--run", run.info.run_id, *argv)
    assert code == 0
    assert out["run"]["step_time_s"] == step_s
    assert out["run"]["step_time_source"] == "time/mean/step_s (StepTiming's run mean)"
    assert (out["run"]["steps"], out["run"]["world_size"], out["run"]["world_size_source"]) == (
        steps, 1, "manifest.json")
    assert (out["inputs"]["step_time_s"], out["inputs"]["steps"]) == (step_s, steps)
    assert out["run"]["measured_device"] == "CPU"  # priced as an H100: said so
    assert out["run"]["caveats"][0].startswith("step time measured on CPU (manifest.json lists no GPU), priced as "
                                               "a3-highgpu-1g (1x H100 80GB)")
    work = steps * step_s
    assert _row(out, 1, "on_demand")["cost_usd"] == pytest.approx(work / 3600 * 11.06, rel=1e-12)
    c8 = 1 / (0.1 + 0.9 / 8)  # 4.7059
    assert _row(out, 8, "on_demand")["wall_h"] == pytest.approx(work / c8 / 3600, rel=1e-12)
    assert _row(out, 8, "on_demand")["cost_usd"] == pytest.approx(work / c8 / 3600 * 11.06 * 8, rel=1e-12)
    # spot, one H100: one segment (Daly's interval is far longer than the work) of M e^(R/M) (e^(W/M) - 1)
    m = 3600 / -math.log(0.95)
    wall = m * math.exp(120 / m) * math.expm1(work / m)
    assert _row(out, 1, "spot")["wall_h"] == pytest.approx(wall / 3600, rel=1e-9)
    assert _row(out, 1, "spot")["cost_usd"] == pytest.approx(wall / 3600 * 4.42, rel=1e-9)

    # The run directory names the same run; its checkpoint record agrees on the steps.
    code, by_dir = _plan(capsys, "--run", str(run_dir), *argv)
    assert code == 0
    assert (by_dir["run"]["run_id"], by_dir["run"]["step_time_s"]) == (run.info.run_id, step_s)
    assert by_dir["run"]["steps_source"] == "furthest step the run logged and checkpoint"
    assert by_dir["rows"] == out["rows"]


def _with_manifest(client: mlflow.MlflowClient, run_id: str, **manifest: Any) -> str:
    """Log ``manifest.json`` (these keys) as the run's artifact, where the CLI's Manifest callback puts it."""
    artifacts = Path(client.get_run(run_id).info.artifact_uri.removeprefix("file://"))
    artifacts.mkdir(parents=True, exist_ok=True)
    (artifacts / "manifest.json").write_text(json.dumps(manifest))
    return run_id


CPU_CAVEAT = ("caveat: step time measured on CPU (manifest.json lists no GPU), priced as a3-highgpu-1g "
              "(1x H100 80GB): the rows assume one H100 80GB steps as fast as that CPU did. Measure on the target "
              "device, or pass --step-time.")


@pytest.mark.parametrize(("manifest", "params", "caveat"), [
    ({"world_size": 1, "gpus": []}, {}, CPU_CAVEAT),
    ({"world_size": 1, "gpus": ["NVIDIA H100 80GB HBM3"]}, {}, None),
    ({"world_size": 1, "gpus": ["NVIDIA H100 80GB HBM3"]}, {"trainer.accelerator": "cpu"},
     "caveat: step time measured on CPU (params trainer.accelerator=cpu), priced as a3-highgpu-1g (1x H100 80GB): "
     "the rows assume one H100 80GB steps as fast as that CPU did. Measure on the target device, or pass --step-time."),
    ({"world_size": 1, "gpus": ["NVIDIA A100-SXM4-40GB"]}, {},
     "caveat: step time measured on NVIDIA A100-SXM4-40GB (manifest.json), priced as a3-highgpu-1g (1x H100 80GB): "
     "the rows assume one H100 80GB steps as fast as that GPU did. Measure on the target device, or pass --step-time."),
    (None, {}, "caveat: step time measured on an unknown device (no manifest.json), priced as a3-highgpu-1g "
               "(1x H100 80GB): the rows assume one H100 80GB steps as fast as that device did. Measure on the "
               "target device, or pass --step-time."),
])
def test_a_step_time_measured_elsewhere_is_priced_with_a_caveat(tmp_path, store, capsys, monkeypatch, manifest,
                                                                 params, caveat) -> None:
    """A CPU run priced as H100 time said nothing: now one line says what was measured where."""
    monkeypatch.setenv("COLUMNS", "200")
    run_id = _run(store, tmp_path, {"train/loss": LOSS, "time/mean/step_s": [(100, 0.05)]}, params=params)
    if manifest is not None:
        _with_manifest(store, run_id, **manifest)
    code, out = _plan(capsys, "--run", run_id, "--serial-fraction", "0.1", "--devices", "1", *ARGS)
    assert code == 0
    assert out["run"]["caveats"] == ([] if caveat is None else [caveat.removeprefix("caveat: ")])
    assert main(["--run", run_id, "--serial-fraction", "0.1", "--devices", "1", *ARGS[:-1]]) == 0
    text = capsys.readouterr().out
    assert (caveat in text) if caveat else ("caveat" not in text)
    # the user's own step time is not a measurement of this run: nothing to warn about
    code, out = _plan(capsys, "--run", run_id, "--serial-fraction", "0.1", "--step-time", "0.01", "--devices", "1",
                      *ARGS)
    assert out["run"]["caveats"] == []


def test_realized_overhead_beside_young_daly_and_the_flat_formula(tmp_path, store, capsys) -> None:
    """Issue 47: a run's goodput ledger (3600 s productive, 10 saves, 2 resumes) checks the interval model, by hand."""
    run_id = _run(store, tmp_path, {
        "train/loss": LOSS, "amdahl/serial_fraction": [(100, 0.2)], "time/mean/step_s": [(100, 36.0)],
        "time/checkpoint_s": [(s, 2.0) for s in range(10, 101, 10)],      # 10 saves of 2 s
        "cost/restart_s": [(0, 0.0), (30, 60.0), (30, 60.0), (70, 120.0)],  # 2 resumes of 60 s
        "goodput/productive_s": [(100, 3600.0)], "goodput/checkpoint_s": [(100, 20.0)],
        "goodput/redone_s": [(100, 180.0)], "goodput/restart_s": [(100, 120.0)], "cost/billed_s": [(100, 3900.0)]})
    code, out = _plan(capsys, "--run", run_id, "--devices", "1", *ARGS)
    assert code == 0
    check = out["run"]["overhead_check"]
    assert check["realized"] == pytest.approx(320 / 3600)
    assert check["predicted"] == pytest.approx(2 / 360 + 360 / 3900 + 60 / 1950)
    assert check["seed"] == pytest.approx(2 / (3900 / 3600) * (150 / 3600))
    assert main(["--run", run_id, "--devices", "1", *ARGS[:-1]]) == 0
    text = capsys.readouterr().out
    assert "  realized      8.89% of the productive time" in text
    assert "  Young/Daly    12.86% at the realized t (d/t + t/2M + R/M)" in text
    assert "  1 + P x O     7.69% (interruptions per hour x hours each cost): leaves out the saves" in text
