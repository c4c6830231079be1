"""Cost-sensitive evaluation and serving, end to end (issue 14): a real digits run logs every cost key and
shows them in its table; compare and promote use val/expected_cost; the champion is served by MLflow's own
``mlflow models serve`` on loopback and answers the input example as the in-process model does; batch
scoring through ``mlflow models predict``; a bad cost matrix on the command line is exit 2, one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch

from callbacks.analysis.decision_cost import argmax_decisions, bayes_decisions
from recipes import compare, promote
from tests.conftest import CONFIGS, FAST, CliResult, cli_env, client_for, free_port, run_fit

DIGITS_RUN_TIMEOUT_S = 600  # the module's 2-epoch fit
# The module fixture runs the slow part before the first test, each run under its own subprocess timeout
# (DIGITS_RUN_TIMEOUT_S); pytest-timeout times the test functions alone, so a slow machine does not fail the first test.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600, func_only=True)]

COST_KEYS = ("val/expected_cost", "val/bayes_expected_cost", "baseline/majority_expected_cost",
             "baseline/linear_expected_cost", "baseline/linear_bayes_expected_cost")
SERVE_START_S = 300  # importing torch and MLflow on a loaded 2-core machine took 43 s


def _mlflow_env(workdir: Path) -> dict[str, str]:
    env = cli_env(workdir)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # mlflow, uvicorn
    env.pop("PYTHONPATH")  # the served model brings its own code: it must not need this repository
    return env


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    workdir = tmp_path_factory.mktemp("cost")
    result = run_fit(workdir, "--config", str(CONFIGS / "digits.yaml"), "--experiment", "digits", "--run_name",
                     "short", "--trainer.max_epochs", "2", *FAST, check=True, env=cli_env(workdir),
                     timeout=DIGITS_RUN_TIMEOUT_S)
    return workdir, result


def test_digits_run_logs_and_shows_every_cost_key(digits_run: tuple) -> None:
    workdir, result = digits_run
    client = client_for(workdir)
    (run,) = client.search_runs([client.get_experiment_by_name("digits").experiment_id])
    metrics = run.data.metrics
    assert set(COST_KEYS) <= set(metrics)
    assert run.data.params["model.init_args.costs"] == "configs/costs/digits-cheques.yaml"
    assert run.data.params["model.init_args.decision"] == "bayes"
    # the end-of-run table shows them, each baseline with the model's difference (negative: the model costs less)
    for key in COST_KEYS:
        assert key in result.stdout
    linear = metrics["baseline/linear_expected_cost"]
    assert f"{linear:.4f}  (model {metrics['val/expected_cost'] - linear:+.4f})" in result.stdout


def test_compare_sorts_by_expected_cost_ascending(digits_run: tuple, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    workdir, _ = digits_run
    for key, value in cli_env(workdir).items():
        monkeypatch.setenv(key, value)
    assert compare.main(["--experiment", "digits", "--metric", "val/expected_cost", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (row,) = data["runs"]
    assert data["mode"] == "min"
    assert row["lift_over_linear"] == pytest.approx(
        row["metrics"]["val/expected_cost"] - row["metrics"]["baseline/linear_expected_cost"], abs=1e-12)


def _serve(model_uri: str, port: int, env: dict[str, str], cwd: Path) -> subprocess.Popen:
    server = subprocess.Popen(
        ["mlflow", "models", "serve", "-m", model_uri, "--env-manager", "local", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + SERVE_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"mlflow models serve exited {server.returncode}:\n{server.stdout.read()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2) as response:
                if response.status == 200:
                    return server
        except OSError:
            time.sleep(1)
    _stop(server)
    raise AssertionError(f"mlflow models serve did not answer /ping within {SERVE_START_S} s")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM the session ``mlflow models serve`` leads and wait for every process of it, its worker too.

    The worker may still be answering while it shuts down after its parent has exited: the server is
    stopped only when the whole group is gone (SIGKILL after 30 s).
    """
    pgid = server.pid  # started with start_new_session: its pid is the group's id
    if _group_alive(pgid):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while (server.poll() is None or _group_alive(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if server.poll() is None or _group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)
        server.wait(timeout=30)


def _post(port: int, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_promote_by_expected_cost_then_serve_and_batch_score_the_champion(
        digits_run: tuple, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    workdir, _ = digits_run
    env = _mlflow_env(workdir)
    for key, value in cli_env(workdir).items():
        monkeypatch.setenv(key, value)
    client = client_for(workdir)
    (run,) = client.search_runs([client.get_experiment_by_name("digits").experiment_id])
    cost, linear = run.data.metrics["val/expected_cost"], run.data.metrics["baseline/linear_expected_cost"]
    args = ["--experiment", "digits", "--metric", "val/expected_cost", "--mode", "min", "--name", "digits"]
    if cost >= linear:  # 2 epochs may not beat the logistic regression: refused, naming its expected cost
        assert promote.main(args) == 1
        assert capsys.readouterr().err.strip() == (
            f"refused: run short ({run.info.run_id}) has val/expected_cost {cost:.4f}, which does not beat its "
            f"baseline/linear_expected_cost {linear:.4f} (short by {cost - linear:.4f}); not promoted.")
        args += ["--baseline", "baseline/majority_expected_cost"]
    assert promote.main(args) == 0
    out = capsys.readouterr().out
    assert "mlflow models serve -m models:/digits@champion --env-manager local --port 5001" in out

    uri = "models:/digits@champion"
    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    in_process = mlflow.pyfunc.load_model(uri)
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(workdir / "champion")))
    example = json.loads((local / "serving_input_example.json").read_text())  # what MLflow logged with the model
    images = np.asarray(example["inputs"], dtype=np.float32)
    expected = in_process.predict(images, params=example.get("params"))
    network = in_process.unwrap_python_model().network
    with torch.no_grad():
        probs = network(torch.as_tensor(images)).softmax(-1).double().numpy()
    costs = in_process.unwrap_python_model().costs  # from the model's serving.json artifact
    assert [r["class_index"] for r in expected] == bayes_decisions(costs, probs).tolist()  # digits.yaml: bayes
    assert not {"classes", "costs", "decision"} & set(mlflow.MlflowClient().get_run(
        in_process.metadata.run_id).data.params)  # the serving config is an artifact, not run params

    port = free_port()
    server = _serve(uri, port, env, workdir)
    try:
        answer = _post(port, example)["predictions"]
        argmax = _post(port, {"inputs": example["inputs"], "params": {"decision": "argmax"}})["predictions"]
    finally:
        _stop(server)
    assert server.returncode is not None
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2)
    assert [(r["decision"], r["class_index"], r["rule"]) for r in answer] == \
        [(r["decision"], r["class_index"], r["rule"]) for r in expected]
    for got, want in zip(answer, expected, strict=True):
        assert list(got["probabilities"]) == [str(i) for i in range(10)]
        assert got["probabilities"] == pytest.approx(want["probabilities"], abs=1e-9)
        assert got["expected_cost"] == pytest.approx(want["expected_cost"], abs=1e-9)
    assert [r["class_index"] for r in argmax] == argmax_decisions(probs).tolist()

    # batch scoring of a file through MLflow's own CLI
    (workdir / "batch.json").write_text(json.dumps({"inputs": example["inputs"]}))
    scored = subprocess.run(["mlflow", "models", "predict", "-m", uri, "-i", "batch.json", "-t", "json", "-o",
                             "scored.json", "--env-manager", "local"], cwd=workdir, env=env, capture_output=True,
                            text=True, timeout=SERVE_START_S)
    assert scored.returncode == 0, scored.stderr[-4000:]
    batch = json.loads((workdir / "scored.json").read_text())["predictions"]
    assert [r["class_index"] for r in batch] == [r["class_index"] for r in expected]


@pytest.mark.parametrize(("costs", "named"), [
    ("[[0,1],[1,0]]", "cost matrix (inline) has 2 rows; 10 classes need a 10x10 matrix."),
    ("configs/costs/no-such.yaml", "cost matrix file configs/costs/no-such.yaml not found"),
])
def test_bad_cost_matrix_on_the_command_line_exits_2_in_one_line(costs: str, named: str,
                                                                 fit_in_process: Callable[..., CliResult]) -> None:
    result = fit_in_process("--config", str(CONFIGS / "digits.yaml"), *FAST, "--model.init_args.costs", costs)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ImageClassifier(costs=") and named in lines[0], lines


@pytest.mark.parametrize(("text", "named"), [
    ("costs:\n" + "".join(f"  - [{', '.join('0' if i == j else '-1' for j in range(10))}]\n" for i in range(10)),
     "row 0, column 1 is -1; costs must not be negative."),
    ("costs:\n" + "".join(f"  - [{', '.join('0' if i == j else 'high' for j in range(10))}]\n" for i in range(10)),
     "row 0, column 1 is 'high', not a number."),
])
def test_bad_cost_file_exits_2_naming_the_value(tmp_path: Path, text: str, named: str,
                                                fit_in_process: Callable[..., CliResult]) -> None:
    (tmp_path / "costs.yaml").write_text(text)
    result = fit_in_process("--config", str(CONFIGS / "digits.yaml"), *FAST, "--model.init_args.costs", "costs.yaml")
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"error: ImageClassifier(costs='costs.yaml'): cost matrix (costs.yaml): {named}"]
