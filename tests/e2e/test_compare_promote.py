"""``recipes.compare`` over hand-made runs, and ``recipes.promote`` end to end: a real run is refused
below its linear baseline, then promoted and loaded back from the registry by alias with the same accuracy."""

from __future__ import annotations

import json
import re

import mlflow
import pytest
import torch
from mlflow.exceptions import MlflowException

from datamodules.digits import DigitsDataModule
from recipes import compare, promote
from tests.conftest import CONFIGS, FAST, cli_env, client_for, run_fit

LR = "model.init_args.optimizer.init_args.lr"







def _run(client, exp_id, name, params, metrics, start_s, seconds, status="FINISHED"):
    run = client.create_run(exp_id, run_name=name, start_time=start_s * 1000)
    for key, value in params.items():
        client.log_param(run.info.run_id, key, value)
    for key, value in metrics.items():
        client.log_metric(run.info.run_id, key, value, step=0)
    if status != "RUNNING":
        client.set_terminated(run.info.run_id, status, end_time=(start_s + seconds) * 1000)
    return run.info.run_id


@pytest.fixture
def three_runs(tracked):
    client = client_for(tracked)
    exp_id = client.create_experiment("cmp")
    same = {"model.init_args.width": "32", "trainer.max_epochs": "12"}
    base = {"baseline/linear_acc": 0.9, "baseline/majority_acc": 0.1}
    ids = {
        "slow": _run(client, exp_id, "slow", {**same, LR: "0.001", "run_name": "slow"},
                     {"val/acc": 0.91, "val/loss": 0.30, **base, "system/cpu_utilization_percentage": 50.0},
                     1_700_000_000, 90),
        "best": _run(client, exp_id, "best", {**same, LR: "0.003", "run_name": "best"},
                     {"val/acc": 0.95, "val/loss": 0.20, **base, "cost/usd": 0.42}, 1_700_000_100, 150),
        "fast": _run(client, exp_id, "fast", {**same, LR: "0.01", "run_name": "fast"},
                     {"val/acc": 0.93, "val/loss": 0.25, **base, "cost/usd": 0.12}, 1_700_000_300, 12),
    }
    return client, exp_id, ids


def test_compare_at_80_columns_puts_the_params_in_a_table_of_their_own(three_runs, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert compare.main(["--experiment", "cmp", "--long"]) == 0
    out = capsys.readouterr().out
    runs_table, params_table = out.split("params that differ")
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in runs_table.splitlines() if line.startswith("│")]
    assert [row[:2] for row in rows] == [["1", "best"], ["2", "fast"], ["3", "slow"]]
    assert "model.optimizer.lr │ 0.003 │ 0.01 │ 0.001" in " ".join(params_table.split())
    assert "Not shown at 80 columns: baseline/linear_acc, baseline/majority_acc" in " ".join(out.split())


def test_compare_json_sorted_with_differing_params(three_runs, capsys):
    _, _, ids = three_runs
    assert compare.main(["--experiment", "cmp", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["metric"], data["mode"]) == ("val/acc", "max")
    assert data["differing_params"] == [LR]  # run_name differs too, but is the row's own name
    rows = data["runs"]
    assert [r["run_name"] for r in rows] == ["best", "fast", "slow"]
    assert [r["run_id"] for r in rows] == [ids["best"], ids["fast"], ids["slow"]]
    assert [r["params"][LR] for r in rows] == ["0.003", "0.01", "0.001"]
    assert [r["duration_s"] for r in rows] == [150.0, 12.0, 90.0]
    assert [r["lift_over_linear"] for r in rows] == pytest.approx([0.05, 0.03, 0.01], abs=1e-12)
    assert [r["cost_usd"] for r in rows] == [0.42, 0.12, None]
    assert "system/cpu_utilization_percentage" not in rows[2]["metrics"]

    assert compare.main(["--experiment", "cmp", "--metric", "val/loss", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mode"] == "min"  # a loss: lower is better
    assert [r["run_name"] for r in data["runs"]] == ["best", "fast", "slow"]
    assert compare.main(["--experiment", "cmp", "--metric", "val/loss", "--mode", "max", "--json"]) == 0
    assert [r["run_name"] for r in json.loads(capsys.readouterr().out)["runs"]] == ["slow", "fast", "best"]


def test_compare_table_and_plot(three_runs, capsys, tracked, monkeypatch):
    # a wide console, where the params join the runs table (pytest-xdist's workers get 80 columns; the
    # narrow layout has a test of its own below)
    monkeypatch.setenv("COLUMNS", "200")
    plot = tracked / "cmp.png"
    assert compare.main(["--experiment", "cmp", "--plot", str(plot), "--long"]) == 0
    out = capsys.readouterr().out
    assert "experiment 'cmp': 3 runs by val/acc (max)" in out
    assert "model.optimizer.lr" in out  # the differing param, without init_args levels
    assert "model.width" not in out  # shared params are left out
    lines = [line for line in out.splitlines() if re.search(r"\b(best|fast|slow)\b", line)]
    assert [re.search(r"\b(best|fast|slow)\b", line).group(1) for line in lines] == ["best", "fast", "slow"]
    cells = [c.strip() for c in lines[0].split("│")[1:-1]]
    assert cells == ["1", "best", "FINISHED", "0.003", "0.9500", "0.2000", "0.9000", "0.1000", "+0.0500", "2.5 min",
                     "0.4200"]
    cells = [c.strip() for c in lines[2].split("│")[1:-1]]
    assert cells[-3:] == ["+0.0100", "90.0 s", "-"]  # no cost logged by that run
    assert f"plot: {plot}" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(plot).shape
    assert width > height > 300


def test_compare_unknown_experiment_or_metric_exit_2(three_runs, capsys):
    assert compare.main(["--experiment", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: experiment 'nope' not found at sqlite:///")
    assert err[-1].endswith("(experiments there: Default, cmp).")
    assert compare.main(["--experiment", "cmp", "--metric", "val/f1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: metric 'val/f1' is not logged by any run of experiment 'cmp' (logged: "
                       "baseline/linear_acc, baseline/majority_acc, cost/usd, val/acc, val/loss).")


def test_promote_refusals_and_bad_input(three_runs, capsys):
    client, _, ids = three_runs
    assert promote.main(["--experiment", "nope"]) == 2
    assert "error: experiment 'nope' not found" in capsys.readouterr().err
    assert promote.main(["--experiment", "cmp", "--metric", "val/f1"]) == 2
    assert "error: metric 'val/f1' is not logged by any run of experiment 'cmp'" in capsys.readouterr().err
    assert promote.main(["--experiment", "cmp", "--metric", "val/loss", "--mode", "min"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --baseline baseline/linear_acc measures 'acc', not 'loss' like --metric val/loss: pick a baseline "
        "of the same kind, or --baseline none.")
    # only hand-made runs: the best one logged no model
    assert promote.main(["--experiment", "cmp"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"refused: run best ({ids['best']}) logged no model named 'model' "
        "(callbacks.mlflow_model.LogModel logs it when a fit completes).")
    # a run still RUNNING is never promoted
    other = client.create_experiment("unfinished")
    _run(client, other, "live", {}, {"val/acc": 0.99}, 1_700_000_000, 0, status="RUNNING")
    assert promote.main(["--experiment", "unfinished"]) == 1
    assert "refused: no FINISHED run of experiment 'unfinished' logged val/acc (their states: RUNNING)." \
        in capsys.readouterr().err


def _accuracy(model: torch.nn.Module) -> tuple[int, int]:
    dm = DigitsDataModule()
    dm.setup("fit")
    correct = total = 0
    with torch.no_grad():
        for x, y in dm.val_dataloader():
            logits = model(x)  # the logged graph keeps its batch dimension dynamic: any batch size
            correct += int((logits.argmax(-1) == y).sum())
            total += len(y)
    return correct, total


def test_promote_real_run_refused_below_baseline_then_loaded_by_alias(tracked, capsys):
    run_fit(tracked, "--config", str(CONFIGS / "digits.yaml"), "--experiment", "prom", "--run_name", "short",
            "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "5", *FAST, check=True,
            env=cli_env(tracked))
    client = client_for(tracked)
    exp_id = client.get_experiment_by_name("prom").experiment_id
    (real,) = client.search_runs([exp_id])
    acc, linear = real.data.metrics["val/acc"], real.data.metrics["baseline/linear_acc"]
    assert acc < linear  # 5 steps of training: below the logistic regression
    # a better run that FAILED is not a candidate
    _run(client, exp_id, "crashed", {}, {"val/acc": 0.999, "baseline/linear_acc": 0.5}, 1_700_000_000, 5,
         status="FAILED")

    assert promote.main(["--experiment", "prom", "--metric", "val/acc", "--mode", "max"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"refused: run short ({real.info.run_id}) has val/acc {acc:.4f}, which does not beat its "
                   f"baseline/linear_acc {linear:.4f} (short by {linear - acc:.4f}); not promoted.")
    assert client.search_registered_models() == []

    # against the majority-class baseline it qualifies: register, alias, load back by alias
    majority = real.data.metrics["baseline/majority_acc"]
    assert promote.main(["--experiment", "prom", "--metric", "val/acc", "--mode", "max", "--name", "digits-cnn",
                         "--baseline", "baseline/majority_acc"]) == 0
    out = capsys.readouterr().out
    assert f"Promoted run short ({real.info.run_id}): val/acc {acc:.4f} (beats baseline/majority_acc " \
           f"{majority:.4f} by {acc - majority:.4f})" in out
    assert 'model = mlflow.pyfunc.load_model("models:/digits-cnn@champion")' in out
    assert "mlflow models serve -m models:/digits-cnn@champion --env-manager local --port 5001" in out
    version = client.get_model_version_by_alias("digits-cnn", "champion")
    assert (str(version.version), version.run_id) == ("1", real.info.run_id)
    assert version.tags["source_run_id"] == real.info.run_id
    assert client.get_run(real.info.run_id).data.tags["registered_as"] == "digits-cnn/1@champion"

    mlflow.set_tracking_uri(cli_env(tracked)["MLFLOW_TRACKING_URI"])
    loaded = mlflow.pyfunc.load_model("models:/digits-cnn@champion").unwrap_python_model().network
    correct, total = _accuracy(loaded)
    assert total == 360
    assert correct / total == pytest.approx(acc, abs=1e-6)  # the val/acc the run logged

    # promoting again makes version 2 the champion and says which version it replaced
    assert promote.main(["--experiment", "prom", "--name", "digits-cnn", "--baseline", "none", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["version"], data["previous_version"], data["load_uri"]) == ("2", "1", "models:/digits-cnn@champion")
    assert str(client.get_model_version_by_alias("digits-cnn", "champion").version) == "2"
    with pytest.raises(MlflowException):
        client.get_model_version_by_alias("digits-cnn", "nope")
