"""recipes.plan from explicit numbers: hand-computed rows, picks, JSON, plot, exit codes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from callbacks.analysis.prices import get_instance, load_catalog
from recipes.plan import main
from recipes.plan.model import PlanInputs, plan

REPO = Path(__file__).resolve().parents[3]
BASE = ["--step-time", "3", "--steps", "10000", "--instance", "a3-highgpu-1g", "--interruption-rate", "0.05"]


def _instance(name: str):
    return get_instance(load_catalog(), name)


def test_plan_linear_on_demand_by_hand():
    """Serial fraction 0, on-demand: wall = steps x step_time / N, cost = wall x price x instances."""
    inputs = PlanInputs(
        step_time_s=3.0,
        steps=10_000,
        instance=_instance("a3-highgpu-8g"),
        serial_fraction=0.0,
        interruption_rate=0.05,
        devices=(1, 4, 8, 16),
        markets=("on_demand",),
    )
    rows = {r.devices: r for r in plan(inputs).rows}
    assert sorted(rows) == [1, 4, 8, 16]
    # 30,000 s / 16 = 1875 s = 0.520833 h on 2 instances of 8 GPUs at $88.49/h = $92.1771
    r16 = rows[16]
    assert (r16.instances, r16.speedup) == (2, 16.0)
    assert r16.wall_h == pytest.approx(1875 / 3600, rel=1e-12)
    assert r16.cost_usd == pytest.approx(1875 / 3600 * 88.49 * 2, rel=1e-12)
    assert r16.cost_usd == pytest.approx(92.17708, abs=1e-5)
    assert (r16.mtbf_h, r16.interval_min, r16.interruptions) == (math.inf, math.inf, 0.0)
    # 4 devices still bill one whole 8-GPU instance: 7500 s x $88.49/h = $184.35
    assert rows[4].instances == 1
    assert rows[4].cost_usd == pytest.approx(7500 / 3600 * 88.49, rel=1e-12)
    assert rows[1].wall_h == pytest.approx(30000 / 3600, rel=1e-12)


def test_plan_spot_row_by_hand():
    """1 x H100 spot, 5%/h, save 30 s, restart 120 s: Daly interval, 15 segments, Daly's exponential model."""
    inputs = PlanInputs(
        step_time_s=3.0,
        steps=10_000,
        instance=_instance("a3-highgpu-1g"),
        serial_fraction=0.0,
        interruption_rate=0.05,
        rate_period_s=3600.0,
        save_cost_s=30.0,
        restart_s=120.0,
        devices=(1,),
        markets=("spot",),
    )
    (row,) = plan(inputs).rows
    m = 3600 / -math.log(0.95)  # 70184.61 s
    x = 30 / (2 * m)
    t = math.sqrt(2 * 30 * m) * (1 + math.sqrt(x) / 3 + x / 9) - 30  # 2032.14 s
    assert t == pytest.approx(2032.1396, abs=1e-3)
    n = math.ceil(30000 / t)  # 15 segments, the last of 1550.05 s with no save
    last = 30000 - (n - 1) * t
    f = lambda length: m * math.exp(120 / m) * (math.exp(length / m) - 1)  # noqa: E731
    wall = (n - 1) * f(t + 30) + f(last)
    assert (n, round(last, 2)) == (15, 1550.05)
    assert row.mtbf_h == pytest.approx(m / 3600, rel=1e-12)
    assert row.interval_min == pytest.approx(t / 60, rel=1e-12)
    assert row.wall_h == pytest.approx(wall / 3600, rel=1e-12)
    assert row.wall_h == pytest.approx(8.5884, abs=1e-4)  # 30918.37 s
    assert row.cost_usd == pytest.approx(wall / 3600 * 4.42, rel=1e-12)
    assert row.cost_usd == pytest.approx(37.9609, abs=1e-4)
    assert row.interruptions == pytest.approx(wall / m, rel=1e-12)


def test_plan_amdahl_and_usl_speedups():
    common = dict(step_time_s=2.0, steps=3600, instance=_instance("a2-highgpu-1g"), devices=(2, 4, 8, 16, 64))
    amdahl = plan(PlanInputs(serial_fraction=0.25, markets=("on_demand",), **common))
    assert [round(r.speedup, 2) for r in amdahl.rows] == [1.60, 2.29, 2.91, 3.37, 3.82]  # DESIGN.md
    usl = plan(PlanInputs(usl_a=0.1, usl_b=0.01, markets=("on_demand",), **common))
    # N / (1 + 0.1 (N - 1) + 0.01 N (N - 1)) at N = 4: 4 / 1.42
    assert usl.rows[1].speedup == pytest.approx(4 / 1.42, rel=1e-12)
    assert usl.rows[1].wall_h == pytest.approx(7200 / (4 / 1.42) / 3600, rel=1e-12)


def _json(capsys, argv):
    code = main(argv)
    return code, json.loads(capsys.readouterr().out)


def test_json_output_and_picks(capsys):
    code, out = _json(capsys, [*BASE, *"--serial-fraction 0 --deadline-h 2 --budget-usd 50 --json".split()])
    assert code == 0
    assert out["feasible"] is True
    rows = out["rows"]
    assert [(r["devices"], r["market"]) for r in rows[:4]] == [
        (1, "on_demand"),
        (1, "spot"),
        (2, "on_demand"),
        (2, "spot"),
    ]
    assert len(rows) == 14
    od8 = next(r for r in rows if (r["devices"], r["market"]) == (8, "on_demand"))
    assert od8["wall_h"] == pytest.approx(3750 / 3600, rel=1e-12)
    assert od8["cost_usd"] == pytest.approx(3750 / 3600 * 11.06 * 8, rel=1e-12)  # $92.17
    assert od8["mtbf_h"] is None and od8["interval_min"] is None  # infinite -> null
    picks = out["picks"]
    # cheapest overall: on-demand with linear scaling costs the same at every N ($92.17); spot N=1 is $37.96
    assert (picks["cheapest"]["devices"], picks["cheapest"]["market"]) == (1, "spot")
    assert (picks["fastest"]["devices"], picks["fastest"]["market"]) == (64, "on_demand")
    within = picks["cheapest_within_deadline"]
    assert within["wall_h"] <= 2 and within["market"] == "spot"
    assert min(r["cost_usd"] for r in rows if r["wall_h"] <= 2) == within["cost_usd"]
    budget = picks["fastest_within_budget"]
    assert budget["cost_usd"] <= 50
    assert min(r["wall_h"] for r in rows if r["cost_usd"] <= 50) == budget["wall_h"]
    assert out["inputs"]["scaling_law"] == "Amdahl s=0"
    assert out["instance"]["name"] == "a3-highgpu-1g"
    # the front by hand: with s=0 every on-demand row costs $92.17, so N=64 (the fastest of all) beats the other
    # on-demand rows; each spot row is cheaper than any on-demand one, and more spot devices are faster but dearer
    assert [(r["devices"], r["market"]) for r in rows if r["pareto"]] == [
        (1, "spot"), (2, "spot"), (4, "spot"), (8, "spot"), (16, "spot"), (32, "spot"),
        (64, "on_demand"), (64, "spot"),
    ]  # fmt: skip
    # and no row of the front is dominated by another row (a check of the flag's definition, row by row)
    for r in rows:
        dominated = any(o["wall_h"] <= r["wall_h"] and o["cost_usd"] <= r["cost_usd"]
                        and (o["wall_h"], o["cost_usd"]) != (r["wall_h"], r["cost_usd"]) for o in rows)
        assert r["pareto"] is not dominated, (r["devices"], r["market"])


def test_deadline_infeasible_exits_1_with_message(capsys):
    # fastest: 30,000 s / 64 = 468.75 s = 0.13 h on-demand, which misses a 0.1 h deadline
    code = main([*BASE, "--serial-fraction", "0", "--deadline-h", "0.1"])
    out = capsys.readouterr().out
    assert code == 1
    text = " ".join(out.split())  # the console wraps at its width, which differs under pytest-xdist's workers
    assert "No plan meets the deadline of 0.1 h" in text
    assert "fastest achievable expected time is 7.8 min (N=64 on_demand" in text  # 468.75 s


def test_budget_infeasible_exits_1(capsys):
    code, out = _json(capsys, [*BASE, "--serial-fraction", "0", "--budget-usd", "10", "--json"])
    assert code == 1
    assert out["picks"]["fastest_within_budget"] is None
    assert any(
        "No plan fits the budget of $10.00: the cheapest achievable expected cost is $37.96" in m
        for m in out["messages"]
    )


@pytest.mark.e2e
def test_real_cli_exit_code_and_table():
    cmd = [sys.executable, "-m", "recipes.plan", *BASE, "--serial-fraction", "0.05", "--deadline-h", "0.1"]
    env = {**os.environ, "COLUMNS": "100"}  # pytest's own COLUMNS would reach the child
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1, proc.stderr
    assert max(len(line) for line in proc.stdout.splitlines()) <= 100 and "…" not in proc.stdout
    assert "No plan meets the deadline of 0.1 h" in proc.stdout
    assert "ckpt every" in proc.stdout and "a3-highgpu-1g" in proc.stdout
    assert "fastest:  N=64 on_demand, 32 min, $382.49" in proc.stdout


def test_plot_writes_png(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert main([*BASE, "--serial-fraction", "0.05", "--plot", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert f"wrote {png}" in capsys.readouterr().out


def test_aws_spot_needs_a_price(capsys):
    argv = (
        "--step-time 3 --steps 10000 --serial-fraction 0 --instance p5.48xlarge "
        "--interruption-rate 0.05 --devices 8,16 --json"
    ).split()
    code, out = _json(capsys, argv)
    assert code == 0
    assert [r["market"] for r in out["rows"]] == ["on_demand", "on_demand"]
    assert "lacks a spot price for instance 'p5.48xlarge'" in out["messages"][0]
    code, out = _json(capsys, [*argv, "--price-spot", "22"])
    assert [(r["market"], r["price_per_h"]) for r in out["rows"]] == [
        ("on_demand", 55.04),
        ("spot", 22.0),
        ("on_demand", 55.04),
        ("spot", 22.0),
    ]
    # 16 devices = 2 instances of 8: 30,000 s / 16 = 1875 s x 2 x $55.04/h
    assert out["rows"][2]["cost_usd"] == pytest.approx(1875 / 3600 * 2 * 55.04, rel=1e-12)


def test_cpu_local_counts_one_device_per_machine(capsys):
    argv = (
        "--step-time 3 --steps 100 --serial-fraction 0 --instance cpu-local "
        "--interruption-rate 0 --devices 1,4 --json"
    ).split()
    code, out = _json(capsys, argv)
    assert code == 0
    assert [(r["instances"], r["cost_usd"], r["wall_h"]) for r in out["rows"]] == [
        (1, 0.0, 300 / 3600),
        (1, 0.0, 300 / 3600),
        (4, 0.0, 75 / 3600),
        (4, 0.0, 75 / 3600),
    ]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--instance", "a9-megagpu"], "unknown instance 'a9-megagpu'"),
        (["--price-on-demand", "-3"], "on_demand_usd_per_h=-3.0"),
        (["--price-spot", "-1.5"], "spot_usd_per_h=-1.5"),
        (["--interruption-rate", "1.0"], "interruption rate 1.0"),
        (["--interruption-rate", "-0.2"], "interruption rate -0.2"),
        (["--serial-fraction", "1.5"], "serial fraction 1.5"),
        (["--step-time", "0"], "step time 0.0"),
        (["--step-time", "-3"], "step time -3.0"),
        (["--steps", "0"], "steps=0"),
        (["--devices", "1,x"], "'x' is not an integer"),
        (["--devices", "0,2"], "--devices: 0 must be >= 1"),
        (["--usl-a", "0.1"], "not both"),
        (["--deadline-h", "-1"], "deadline -1.0"),
        (["--catalog", "/nonexistent/prices.yaml"], "/nonexistent/prices.yaml"),
    ],
)
def test_bad_input_exits_2_naming_the_value(capsys, extra, named):
    argv = [*BASE, "--serial-fraction", "0.05", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert named in err
    assert len(err.strip().splitlines()) == 1


def test_no_scaling_law_exits_2(capsys):
    assert main(BASE) == 2
    assert "give a scaling law" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("drop", "named"), [("--step-time", "--step-time is required"), ("--steps", "--steps is required")]
)
def test_explicit_mode_needs_step_time_and_steps(capsys, drop, named):
    argv = [*BASE, "--serial-fraction", "0.05"]
    i = argv.index(drop)
    del argv[i : i + 2]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert named in err and "--run RUN_ID_OR_RUN_DIR" in err


def test_human_duration_picks_a_unit_that_fits():
    from recipes.run.common import human_duration

    cases = [(0.0, "0 s"), (0.0463, "0.046 s"), (2.5, "2.5 s"), (22.4, "22 s"), (90, "1.5 min"),
             (2032.14, "34 min"), (3750, "1.04 h"), (30918.4, "8.59 h"), (70184.6, "19.5 h"),
             (1_000_000, "11.6 d"), (math.inf, "-")]
    assert [(s, human_duration(s)) for s, _ in cases] == cases


def _folded(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def test_interruption_rate_defaults_to_the_catalogs_with_its_source(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    argv = ["--step-time", "3", "--steps", "10000", "--serial-fraction", "0.05", "--instance", "a3-highgpu-1g"]
    code, out = _json(capsys, [*argv, "--json"])
    assert code == 0
    assert (out["inputs"]["interruption_rate"], out["inputs"]["rate_period_s"]) == (0.15, 86400.0)
    source = load_catalog()["a3-highgpu-1g"].spot_interruption_source
    assert out["interruption_rate_source"] == f"catalog default for a3-highgpu-1g spot: {source}"
    m = 24 * 3600 / -math.log(1 - 0.15)  # one instance's MTBF: 147.7 h
    assert next(r for r in out["rows"] if r["market"] == "spot")["mtbf_h"] == pytest.approx(m / 3600, rel=1e-12)
    assert main(argv) == 0
    text = _folded(capsys.readouterr().out)
    assert text.startswith(f"interruption rate 0.15 per 24 h (catalog default for a3-highgpu-1g spot: {source}; "
                           "pass --interruption-rate to override)")
    # the user's rate wins, and is not announced as a default
    code, out = _json(capsys, [*argv, "--interruption-rate", "0.05", "--json"])
    assert (out["inputs"]["interruption_rate"], out["inputs"]["rate_period_s"]) == (0.05, 3600.0)
    assert out["interruption_rate_source"] == "--interruption-rate"
    assert main([*argv, "--interruption-rate", "0.05"]) == 0
    assert "catalog default" not in capsys.readouterr().out


def test_a_catalog_without_a_rate_asks_for_one_only_when_spot_is_priced(tmp_path, capsys):
    catalog = tmp_path / "mine.yaml"
    row = "  provider: lab\n  gpu: L4\n  gpus: 1\n  on_demand_usd_per_h: 1.0\n  source: invoice\n  date: '2025-05'\n"
    catalog.write_text(f"box:\n{row}  spot_usd_per_h: 0.4\nnospot:\n{row}")
    argv = ["--step-time", "1", "--steps", "100", "--serial-fraction", "0", "--catalog", str(catalog)]
    assert main([*argv, "--instance", "box"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --interruption-rate is required: the catalog has no spot interruption rate for 'box' (give its row "
        "spot_interruption_rate, spot_interruption_period_h and spot_interruption_source, or pass "
        "--interruption-rate P [--rate-period-h H]).")
    code, out = _json(capsys, [*argv, "--instance", "nospot", "--json"])  # no spot price: no spot rows, no rate
    assert code == 0 and [r["market"] for r in out["rows"]] == ["on_demand"] * 7
    assert out["interruption_rate_source"] == "unused: the catalog has no spot price for 'nospot'"
    assert main([*argv, "--instance", "box", "--rate-period-h", "24"]) == 2
    assert "--rate-period-h 24 is the period of --interruption-rate: give both" in capsys.readouterr().err


def test_a_tiny_job_in_units_that_fit_and_no_periodic_checkpoint(capsys, monkeypatch):
    """5 steps of 46 ms: the old table said 0.00 h everywhere and 'ckpt every 33.9 min' for a 0.23 s job."""
    monkeypatch.setenv("COLUMNS", "100")
    argv = ["--step-time", "0.0463", "--steps", "5", "--serial-fraction", "0.7", "--instance", "a3-highgpu-1g",
            "--interruption-rate", "0.05", "--devices", "1,2"]
    code, out = _json(capsys, [*argv, "--json"])
    assert code == 0
    spot1 = next(r for r in out["rows"] if (r["devices"], r["market"]) == (1, "spot"))
    assert spot1["interval_min"] == pytest.approx(33.87, abs=0.01)  # Daly's optimum, still reported
    assert [r["periodic_checkpoint"] for r in out["rows"]] == [False, False, False, False]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]
    assert lines[0] == ["1", "on_demand", "1", "1.00", "0.23 s", "-", "0.23 s", "0.00071", "0", ""]
    assert lines[1] == ["1", "spot", "1", "1.00", "0.23 s", "not needed", "0.23 s", "0.00028", "<0.01",
                        "* cheapest"]
    assert "cheapest: N=1 spot, 0.23 s, $0.00028" in out
    assert "0.00 h" not in out and "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert ("no periodic checkpoint needed in any spot row: the job is shorter than the optimal interval (N=1 spot: "
            "0.23 s of work, 34 min between checkpoints); the final checkpoint is enough.") in _folded(out)
