"""recipes.scale: a real 1- and 2-process sweep, a hand-made CSV fit, and bad input."""

from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path

import pytest

from callbacks.analysis.scaling import amdahl_speedup
from recipes.run.common import UsageError
from recipes.scale import main
from recipes.scale.points import parse_devices, per_device_batch
from tests.conftest import CONFIGS, REPO, client_for, run_module

PNG = b"\x89PNG\r\n\x1a\n"
#: Parameters of the digits recipe's small CNN (width 32): conv 320 + conv 18,496 + linear 131,200 + 1,290.
DIGITS_PARAMS = 151_306


def _scale(workdir: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return run_module("recipes.scale", *args, cwd=workdir, timeout=timeout)


@pytest.mark.e2e
@pytest.mark.slow(covered_by="tests/e2e/test_readme_commands.py::test_readme_command")  # its `recipes.scale` line
@pytest.mark.timeout(900)
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores for the 2-process run")
def test_sweep_on_one_and_two_processes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = _scale(tmp_path, "--config", str(CONFIGS / "digits.yaml"), "--devices", "1,2", "--steps", "6",
                    "--warmup", "2", "--out", str(out), "--runs-root", str(tmp_path / "runs"), "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    data = json.loads(result.stdout)  # --json: only JSON on stdout

    one, two = data["points"]
    assert (one["devices"], one["per_device_batch"], one["global_batch"]) == (1, 32, 32)  # strong: 32 = 2 x 16
    assert (two["devices"], two["per_device_batch"], two["global_batch"]) == (2, 16, 32)
    assert one["throughput"] > 0 and two["throughput"] > 0
    assert one["speedup"] == 1.0
    assert two["speedup"] == pytest.approx(two["throughput"] / one["throughput"], rel=1e-12)
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2, rel=1e-12)
    # one N > 1: Amdahl's s is that point's Karp-Flatt fraction 2/C - 1, clipped to [0, 1]
    expected_s = min(1.0, max(0.0, 2 / two["speedup"] - 1))
    assert data["fits"]["amdahl"]["serial_fraction"] == pytest.approx(expected_s, abs=1e-12)
    assert data["fits"]["underdetermined"] is True
    assert "real processes on this machine's" in data["notes"][0]
    (check,) = data["prediction_check"]
    assert check["devices"] == 2 and 0 <= check["serial_fraction"] <= 1
    assert check["predicted_speedup"] == pytest.approx(amdahl_speedup(2, check["serial_fraction"]), rel=1e-12)
    assert check["measured_speedup"] == two["speedup"]

    # the CSV holds the same rows, the PNG is a PNG
    with open(out / "scaling.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["devices"]) for r in rows] == [1, 2]
    assert float(rows[1]["throughput"]) == pytest.approx(two["throughput"], rel=1e-5)
    assert rows[1]["run_id"] == two["run_id"]
    assert (out / "scaling.png").read_bytes()[:8] == PNG

    # MLflow: a finished parent with the outputs, and both training runs as its children
    client = client_for(tmp_path)
    parent = client.get_run(data["parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.params["mode"] == "strong" and parent.data.params["devices"] == "1,2"
    assert sorted(a.path for a in client.list_artifacts(parent.info.run_id)) == \
        ["scaling.csv", "scaling.json", "scaling.png"]
    history = client.get_metric_history(parent.info.run_id, "scale/speedup")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, pytest.approx(two["speedup"]))]
    children = {p["devices"]: client.get_run(p["run_id"]) for p in data["points"]}
    for child in children.values():
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.info.status == "FINISHED"
        assert "time_breakdown.png" in [a.path for a in client.list_artifacts(child.info.run_id)]
    m1, m2 = children[1].data.metrics, children[2].data.metrics
    assert m1["time/mean/samples_per_s"] == one["throughput"]
    assert not any(k.startswith("comm/") for k in m1)  # one process: nothing to communicate
    # the 2-process run: DDP's single bucket all-reduced once per step, 4 bytes per parameter
    assert m2["comm/hook_calls_per_step"] == 1.0
    assert m2["comm/bytes_per_step"] == 4 * DIGITS_PARAMS
    assert m2["comm/measured_s"] > 0 and m2["comm/predicted_s"] > 0 and m2["comm/bandwidth_gbps"] > 0
    parts = sum(m2[f"time/mean/{p}_s"] for p in ("data", "forward", "backward", "comm_exposed", "optimizer"))
    assert parts == pytest.approx(m2["time/mean/step_s"], rel=1e-9)
    assert m2["time/mean/comm_exposed_s"] <= m2["time/mean/comm_s"] + 1e-12 <= m2["time/mean/step_s"]


def _write_csv(path: Path, rows: list[tuple[int, float]]) -> Path:
    path.write_text("devices,throughput,notes\n" + "".join(f"{n},{x},run {n}\n" for n, x in rows))
    return path


def test_from_csv_fits_hand_made_amdahl_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # throughput 100 x Amdahl(s = 0.25): x1.6, x2.2857, x2.9091 at N = 2, 4, 8
    rows = [(1, 100.0), (2, 160.0), (4, 100 / (0.25 + 0.75 / 4)), (8, 100 / (0.25 + 0.75 / 8))]
    source = _write_csv(tmp_path / "mine.csv", rows)
    assert main(["--from-csv", str(source), "--json", "--no-mlflow", "--out", str(tmp_path / "fit")]) == 0
    data = json.loads(capsys.readouterr().out)
    amdahl = data["fits"]["amdahl"]
    assert amdahl["serial_fraction"] == pytest.approx(0.25, abs=1e-12)
    assert amdahl["ceiling"] == pytest.approx(4.0, abs=1e-9)
    assert amdahl["r_squared"] == pytest.approx(1.0, abs=1e-12)
    assert data["fits"]["best"] == "amdahl"  # USL ties it (b = 0); a tie goes to the simpler law
    assert data["fits"]["usl"]["b"] == pytest.approx(0.0, abs=1e-9)
    peak = data["fits"]["usl"]["peak_n"]
    assert peak is None or peak > 1e6  # no peak in sight (b is 0 up to rounding)
    assert [round(p["speedup"], 4) for p in data["points"]] == [1.0, 1.6, 2.2857, 2.9091]
    assert [round(p["karp_flatt"], 12) for p in data["points"][1:]] == [0.25, 0.25, 0.25]
    assert data["prediction_check"] == []  # no StepTiming runs behind a CSV
    with open(tmp_path / "fit" / "scaling.csv", newline="") as handle:
        written = list(csv.DictReader(handle))
    assert [(int(r["devices"]), round(float(r["efficiency"]), 4)) for r in written] == \
        [(1, 1.0), (2, 0.8), (4, 0.5714), (8, 0.3636)]
    assert (tmp_path / "fit" / "scaling.png").read_bytes()[:8] == PNG


def test_from_csv_logs_a_run_and_finds_the_usl_peak(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    # USL with a = 0.05, b = 0.01: N* = sqrt(0.95 / 0.01) = 9.75
    usl = [(n, 50.0 * n / (1 + 0.05 * (n - 1) + 0.01 * n * (n - 1))) for n in (1, 2, 4, 8, 16)]
    source = _write_csv(tmp_path / "usl.csv", usl)
    assert main(["--from-csv", str(source), "--out", str(tmp_path / "fit"), "--experiment", "mine"]) == 0
    text = capsys.readouterr().out
    assert "N* = 9.7" in text and "* predicted by the fits, not measured" in text
    client = client_for(tmp_path)
    (run,) = client.search_runs([client.get_experiment_by_name("mine").experiment_id])
    assert run.data.metrics["scale/usl_a"] == pytest.approx(0.05, abs=1e-9)
    assert run.data.metrics["scale/usl_b"] == pytest.approx(0.01, abs=1e-9)
    assert run.data.metrics["scale/usl_peak_n"] == pytest.approx(0.95 ** 0.5 * 10, abs=1e-6)
    assert run.data.tags["atscale.best_law"] == "usl"
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == \
        ["scaling.csv", "scaling.json", "scaling.png"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--from-csv", "missing.csv"], "--from-csv missing.csv:"),
    (["--config", "x.yaml", "--devices", "1,two"], "--devices: 'two' is not an integer >= 1"),
    (["--config", "x.yaml", "--devices", "2,4"], "include 1"),
    (["--config", str(CONFIGS / "digits.yaml"), "--devices", "1,512"], "cannot be real processes here"),
    (["--config", str(CONFIGS / "digits.yaml"), "--devices", "1,2", "--batch-size", "33"],
     "global batch 33 does not split evenly over 2 devices"),
    (["--config", str(CONFIGS / "digits.yaml"), "--steps", "3", "--warmup", "5"], "--steps 3 must exceed"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'never.db'}")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "never.db").exists()  # nothing was started


def test_csv_without_n1_or_columns_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    no_one = _write_csv(tmp_path / "a.csv", [(2, 10.0), (4, 18.0)])
    assert main(["--from-csv", str(no_one), "--no-mlflow"]) == 2
    assert "has no N=1 measurement" in capsys.readouterr().err
    bad = tmp_path / "b.csv"
    bad.write_text("gpus,samples\n1,2\n")
    assert main(["--from-csv", str(bad), "--no-mlflow"]) == 2
    assert "needs a header with columns devices,throughput" in capsys.readouterr().err


def test_helpers() -> None:
    assert parse_devices("4, 1,2") == [1, 2, 4]
    assert per_device_batch("strong", 32, 4) == 8
    assert per_device_batch("weak", 32, 4) == 32
    with pytest.raises(UsageError, match="listed twice"):
        parse_devices("1,2,2")
    assert REPO.is_dir()


def test_from_csv_writes_under_the_runs_root_not_beside_the_csv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # as from the repository root, which git does not ignore
    (tmp_path / "data").mkdir()
    _write_csv(tmp_path / "data" / "mine.csv", [(1, 100.0), (2, 160.0)])
    assert main(["--from-csv", "data/mine.csv", "--no-mlflow", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["out_dir"] == "runs/scale/scale-mine"
    assert sorted(p.name for p in (tmp_path / "runs" / "scale" / "scale-mine").iterdir()) == \
        ["scaling.csv", "scaling.json", "scaling.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "runs"]
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["mine.csv"]
    # --runs_root as recipes.fit spells it, and the old --runs-root still accepted
    for flag, root in (("--runs_root", "elsewhere"), ("--runs-root", "other")):
        assert main(["--from-csv", "data/mine.csv", "--no-mlflow", "--json", flag, root, "--experiment", "e"]) == 0
        assert json.loads(capsys.readouterr().out)["out_dir"] == f"{root}/e/scale-mine"
        assert (tmp_path / root / "e" / "scale-mine" / "scaling.json").is_file()


def _report(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
            rows: list[tuple[int, float]]) -> tuple[dict, str]:
    """The fit of these (devices, throughput) rows as JSON, and the report as 100-column text, whitespace folded."""
    monkeypatch.setenv("COLUMNS", "100")
    argv = ["--from-csv", str(_write_csv(tmp_path / "m.csv", rows)), "--no-mlflow", "--out", str(tmp_path / "fit")]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    return data, " ".join(capsys.readouterr().out.replace("│", " ").split())


def test_note_agrees_with_the_numbers_when_nothing_sped_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A loaded machine: N=2 ran at half the speed of N=1. The old note said the laws fit it exactly."""
    data, text = _report(capsys, monkeypatch, tmp_path, [(1, 100.0), (2, 50.0)])
    amdahl = data["fits"]["amdahl"]
    assert (amdahl["serial_fraction"], amdahl["ceiling"], amdahl["r_squared"]) == (1.0, 1.0, pytest.approx(-1.0))
    note = ("No speedup measured (x0.50 at N=2): more devices were no faster than one. The machine was loaded or "
            "the work per step is too small to split; the fitted laws describe no scaling and predict nothing. "
            "Measure again on an idle machine or with more work per step.")
    assert data["fits"]["note"] == note
    assert "Amdahl s = 1.0000, ceiling x1.00, R² -1.0000" in text
    assert f"note {note}" in text
    assert "exactly" not in text


def test_note_for_a_superlinear_point_and_two_inconsistent_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    data, text = _report(capsys, monkeypatch, tmp_path, [(1, 100.0), (2, 240.0)])
    assert data["fits"]["amdahl"]["serial_fraction"] == 0.0 and data["fits"]["amdahl"]["r_squared"] < 0.9
    assert data["fits"]["note"].startswith("Only one device count N > 1 was measured (x2.40 at N=2), a speedup "
                                           "above N that Amdahl and Gustafson cannot reach (their s is clipped to 0;")
    assert "fit it exactly" not in text
    # x1.8 at N=2 but x4.2 at N=4 (superlinear there): USL's a, b >= 0 cannot pass through both
    data, _ = _report(capsys, monkeypatch, tmp_path, [(1, 100.0), (2, 180.0), (4, 420.0)])
    assert data["fits"]["usl"]["r_squared"] < 1 - 1e-6
    assert data["fits"]["note"].startswith("Only two device counts N > 1 were measured (x1.80 at N=2, x4.20 at N=4), "
                                           "and not even USL's two parameters pass through them (R² ")
    # consistent data keep the fitting module's own note: one N > 1 in reach of Amdahl is fitted exactly
    data, _ = _report(capsys, monkeypatch, tmp_path, [(1, 100.0), (2, 160.0)])
    assert data["fits"]["amdahl"]["r_squared"] == pytest.approx(1.0, abs=1e-12)
    assert data["fits"]["note"].startswith("Only one device count N > 1 was measured: Amdahl and Gustafson")


def test_scaling_plot_labels_devices_as_plain_integers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from recipes.scale.points import ScaleResult, fit_points, read_csv
    from recipes.scale.report import scaling_figure

    points = read_csv(str(_write_csv(tmp_path / "m.csv", [(1, 100.0), (2, 180.0), (4, 300.0)])))
    fig = scaling_figure(ScaleResult("strong", points, fit_points(points), 4, tmp_path))
    fig.canvas.draw()
    (ax,) = fig.axes
    low, high = ax.get_xlim()
    shown = [t for t in ax.xaxis.get_major_ticks() if low <= t.get_loc() <= high]
    assert [t.label1.get_text() for t in shown] == ["1", "2", "4", "8", "16"]
    assert all(t.label1.get_text() == "" for t in ax.xaxis.get_minor_ticks())
    ylow, yhigh = ax.get_ylim()
    ylabels = [t.label1.get_text() for t in ax.yaxis.get_major_ticks() if ylow <= t.get_loc() <= yhigh]
    assert ylabels and all(label.replace(".", "").isdigit() for label in ylabels)  # 1, 2, 4 ... not 2^k
