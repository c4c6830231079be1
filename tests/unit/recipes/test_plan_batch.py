"""recipes.plan batch: the batch-size planner's command line, by hand-computed values (no training)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from recipes import plan as plan_cli
from recipes.plan import batch_main as main

# B_noise 100; 300 steps at batch 50 -> S_min 100; t(b) = 10 ms + 0.1 ms x b; cpu-local is $0/h, so price by hand
BASE = ["--b-noise", "100", "--ref-steps", "300", "--ref-batch", "50", "--step-times", "50:0.015,100:0.02",
        "--batches", "50,100,200,400", "--price-per-h", "3.6"]


def test_json_rows_and_picks_by_hand(capsys):
    assert main([*BASE, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["s_min"] == pytest.approx(100.0)
    assert out["step_time_model"] == pytest.approx({"t0": 0.01, "per_example_s": 1e-4})
    walls = {r["batch"]: r["wall_s"] for r in out["rows"]}
    assert walls == pytest.approx({50: 4.5, 100: 4.0, 200: 4.5, 400: 6.25})
    assert out["fastest"]["batch"] == out["cheapest"]["batch"] == 100
    assert out["fastest"]["cost_usd"] == pytest.approx(0.004)  # 4 s at $3.60/h


def test_table_names_the_picks_and_diminishing_returns(capsys, tmp_path):
    png = tmp_path / "batch.png"
    assert plan_cli.main(["batch", *BASE, "--batches", "50,100,200,400,800", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "fastest: batch 100 on 1 device(s): 200 steps x 0.02 s = 4 s, $0.004" in out
    assert "past diminishing returns: batch 800 (> 4 x B_noise = 400)" in out
    assert "step time extrapolated" in out  # 200 and up are beyond the measured per-device batches
    assert png.stat().st_size > 10_000


def test_devices_and_ring_comm(capsys):
    """2 devices, 1e6 fp32 params over 8 Gbit/s (1 GB/s), no latency: ring 2(N-1)/N x 4 MB / 1 GB/s = 4 ms."""
    assert main([*BASE, "--devices", "1,2", "--params", "1e6", "--bandwidth-gbps", "8", "--latency-us", "0",
                 "--json"]) == 0
    rows = {(r["batch"], r["devices"]): r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows[(200, 2)]["step_s"] == pytest.approx(0.01 + 0.01 + 0.004)  # t(100) + comm
    assert rows[(200, 2)]["cost_usd"] == pytest.approx(150 * 0.024 / 3600 * 2 * 3.6)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--b-noise", "-3", "--s-min", "5", "--step-times", "8:0.1"], "--b-noise -3.0 must be a positive"),
    (["--b-noise", "3", "--step-times", "8:0.1"], "give --ref-steps S --ref-batch B"),
    (["--b-noise", "3", "--s-min", "5", "--step-times", "8:x"], "--step-times: '8:x' is not BATCH:SECONDS"),
    (["--b-noise", "3", "--s-min", "5"], "give exactly one source of step times"),
    (["--b-noise", "3", "--s-min", "5", "--step-times", "8:0.1", "--batches", "8,0"], "--batches: 0 must be >= 1"),
    (["--b-noise", "3", "--s-min", "5", "--step-times", "8:0.1", "--instance", "nope"], "unknown instance 'nope'"),
    (["--b-noise", "3", "--s-min", "5", "--step-times", "8:0.1", "--params", "10"], "give both --params"),
    (["--validate", "configs/digits.yaml", "--batches", "16,32"], "--validate needs --target"),
    (["--target", "val/acc"], "--target: 'val/acc' is not METRIC=VALUE"),
])
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_from_a_run_in_mlflow(tmp_path, monkeypatch, capsys):
    """--run: B_noise and batch from GradientNoiseScale's metrics, steps to the first val/acc >= target."""
    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("digits")
    run = client.create_run(exp).info.run_id
    client.log_param(run, "data.init_args.batch_size", "25")
    client.log_param(run, "trainer.accumulate_grad_batches", "2")
    for step, acc in ((100, 0.90), (200, 0.95), (300, 0.97), (400, 0.96), (500, 0.98)):
        client.log_metric(run, "val/acc", acc, step=step)
    client.log_metric(run, "noise_scale/b_simple", 100.0, step=500)
    client.log_metric(run, "noise_scale/batch_used", 50.0, step=500)
    client.log_metric(run, "time/mean/step_s", 0.015, step=500)
    client.set_terminated(run)
    # 300 steps to 0.97 at batch 50 with B_noise 100 -> S_min 100: the by-hand plan above
    assert main(["--run", run, "--target", "val/acc=0.97", "--step-time-runs", run, "--step-times", "1:1"]) == 2
    assert "exactly one source of step times" in capsys.readouterr().err
    assert main(["--run", run, "--target", "val/acc=0.97", "--step-times", "50:0.015,100:0.02",
                 "--batches", "50,100,200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["b_noise"], out["s_min"]) == pytest.approx((100.0, 100.0))
    assert main(["--run", run, "--target", "val/acc=0.99", "--step-times", "50:0.015"]) == 2
    assert "never reached val/acc=0.99" in capsys.readouterr().err
    # step times from runs: this run's time/mean/step_s at its per-device batch 25
    assert main(["--run", run, "--target", "val/acc=0.97", "--step-time-runs", run, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_model"] == pytest.approx({"t0": 0.015, "per_example_s": 0.0})


def test_planner_imports_no_torch():
    code = ("import sys, recipes.plan, recipes.plan.batch_report, recipes.plan.batch_runs; "
            "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"



def test_a_reused_run_is_the_newest_finished_one_and_a_trained_run_the_newest(tracked, monkeypatch, tmp_path):
    """``--stamp`` reuses a FINISHED run, not a newer failed attempt of the same name (a quote in it too); a run
    trained now is read, not an older attempt of its name."""
    import mlflow

    from callbacks.analysis.keys import STEP_KEY
    from recipes.plan import batch_train

    uri = f"sqlite:///{tracked / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("digits-batch")

    def record(name: str, status: str, step_s: float, start_ms: int) -> None:
        run = client.create_run(exp, start_time=start_ms, run_name=name).info.run_id
        client.log_metric(run, STEP_KEY, step_s)
        client.set_terminated(run, status)

    record("sweep-b8-it's", "FINISHED", 0.5, 1_000)
    record("sweep-b8-it's", "FAILED", 9.0, 2_000)
    record("sweep-b16", "FAILED", 9.0, 1_000)
    trained = []
    monkeypatch.setattr(batch_train, "_fit", lambda config, name, *rest: (trained.append(name),
                                                                           record(name, "FINISHED", 0.25, 3_000)))
    ref = batch_train._train_or_reuse(client, uri, "cfg.yaml", "digits-batch", "sweep-b8-it's", [], tmp_path, None)
    assert (ref.step_s, trained) == (0.5, [])
    ref = batch_train._train_or_reuse(client, uri, "cfg.yaml", "digits-batch", "sweep-b16", [], tmp_path, None)
    assert (ref.step_s, trained) == (0.25, ["sweep-b16"])
