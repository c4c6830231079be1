"""``python -m recipes.bench overhead|checkpoint|contention`` as commands, with settings tiny enough to run in seconds.

No speed figure is asserted (the lead measures on a quiet machine): the commands' JSON keys, the counts that
follow from the settings, and the tables printed from those figures.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
from rich.console import Console

from recipes.bench.checkpoint import GOAL_ASYNC_OVER_SYNC, print_checkpoint
from recipes.bench.contention import print_contention
from recipes.bench.overhead import VARIANTS, print_overhead
from recipes.bench.startup import PHASES, print_startup
from recipes.bench.stats import verdict_at_most
from tests.conftest import cli_env, run_module, run_script

# No figure here is a speed goal, so these run beside other tests; the contention bench alone is `serial`: its
# busy neighbour would hold both cores under the other pytest-xdist worker (.ci/run runs `serial` tests last, alone)

TINY_BATCH = 4
TINY = ["--features", "8", "--hidden", "8", "--layers", "1", "--batch-size", str(TINY_BATCH)]


def _bench(workdir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    result = run_module("recipes.bench", *args, cwd=workdir, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def _table(printer, figures: dict) -> str:
    console = Console(width=250, record=True, force_terminal=False)
    printer(figures, console)
    return console.export_text()


def test_checkpoint_command_json_and_table(tmp_path: Path) -> None:
    # 7 steps, 2 warm-up, a save every 2: saves at steps 2, 4, 6, of which 4 and 6 fall in the measured window
    result = _bench(tmp_path, "checkpoint", "--steps", "7", "--warmup", "2", "--every", "2", "--rounds", "2",
                    "--max-rounds", "2", *TINY, "--json", "--out", str(tmp_path / "out"))
    figures = json.loads(result.stdout)
    assert set(figures) == {"stalls", "ratio", "floor", "state_mb", "baseline_step_ms", "settings", "rounds_run",
                            "load_average"}
    assert figures["rounds_run"] == 2
    assert set(figures["stalls"]) == {"sync", "async"}
    assert set(figures["stalls"]["async"]) - set(figures["stalls"]["sync"]) == {"staging_s", "waited_saves"}
    assert 0 <= figures["stalls"]["async"]["staging_s"] <= figures["stalls"]["async"]["blocked_max_s"]
    for stall in figures["stalls"].values():
        assert {"checkpoints", "blocked_s", "blocked_max_s", "effective_s"} <= set(stall)
        assert stall["checkpoints"] == 4  # 2 per round
        assert 0 <= stall["blocked_s"] <= stall["blocked_max_s"]
    assert set(figures["ratio"]) == {"blocked_ratio", "effective_ratio", "ok", "verdict", "effective_ci95"}
    # the verdict is the one the goal gives for the interval reported beside it
    low, high = figures["ratio"]["effective_ci95"]
    assert figures["ratio"]["verdict"] == verdict_at_most(low, high, GOAL_ASYNC_OVER_SYNC)
    assert figures["ratio"]["ok"] == (figures["ratio"]["verdict"] == "met")
    assert set(figures["floor"]) == {"copy_s", "clone_s", "bytes", "pinned"}
    assert figures["floor"]["pinned"] == 0.0  # CPU tensors: no pinned host buffer
    assert figures["floor"]["bytes"] == (8 * 8 + 8 + 8 * 10 + 10) * 4  # Linear(8, 8) + Linear(8, 10), fp32
    assert figures["settings"] == {"steps": 7, "warmup": 2, "every": 2, "rounds": 2, "max_rounds": 2, "batch_size": 4,
                                   "hidden": 8, "layers": 1, "features": 8, "threads": 1}
    assert "round 2 (none)" in result.stderr and "round 2 (async)" in result.stderr  # progress off stdout
    # the writers' order alternates: none, sync, async, then async, sync, none
    order = [line.split("(")[1].split(")")[0] for line in result.stderr.splitlines() if line.startswith("round ")]
    assert order == ["none", "sync", "async", "async", "sync", "none"]
    # each run's first save (step 1, inside the 2 warm-up steps) is apart from the window's 2 and written first
    for mode in ("sync", "async"):
        assert 0 < figures["stalls"][mode]["first_save_s"] < 60
        assert sorted(p.name for p in (tmp_path / "out").glob(f"round*/{mode}-first/*.ckpt")) == ["first.ckpt"] * 2

    text = _table(print_checkpoint, figures)
    assert "Checkpoint stall —" in text
    for cell in ("writer", "saves", "blocked per save", "max blocked", "effective per save",
                 "sync (AtomicCheckpointIO)", "async (BoundedAsyncCheckpointIO)", "memory-copy floor", "async / sync:",
                 "async staging (the copy", "each run's first save"):
        assert cell in text, cell


@pytest.mark.timeout(600)
def test_overhead_command_json_and_table(tmp_path: Path) -> None:
    env = cli_env(tmp_path)
    del env["MLFLOW_TRACKING_URI"]  # as a user runs it: the benchmark makes its own store, in --out
    result = _bench(tmp_path, "overhead", "--steps", "4", "--warmup", "1", "--rounds", "2", "--max-rounds", "2",
                    *TINY, "--json", "--out", str(tmp_path / "out"), env=env)
    figures = json.loads(result.stdout)
    assert set(figures) == {"throughput", "median", "all", "rounds_run", "step_ms", "ratios", "median_ratios",
                            "ci95", "verdict", "full_recipe_fit_s", "timing_cost", "timing_cost_us", "params",
                            "settings", "median_step_us", "median_gap_us", "short", "short_verdict"}
    # the median step of each variant from its median throughput; the recipe's over plain Lightning's
    steps = {key: TINY_BATCH / figures["median"][key] * 1e6 for key in VARIANTS}
    assert figures["median_step_us"] == pytest.approx(steps)
    assert figures["median_gap_us"] == pytest.approx(steps["c"] - steps["b"])
    assert (figures["short"], figures["short_verdict"]) == (False, None)
    for key in ("throughput", "median", "all", "step_ms"):
        assert set(figures[key]) == set(VARIANTS), key
    assert figures["rounds_run"] == 2 and all(len(v) == 2 for v in figures["all"].values())
    assert len(figures["full_recipe_fit_s"]) == 2
    # the variants' order alternates from round to round
    order = [line.split("(")[1].split(")")[0] for line in result.stderr.splitlines() if line.startswith("round ")]
    assert order == [*VARIANTS, *reversed(VARIANTS)]
    assert set(figures["ratios"]) == set(figures["median_ratios"]) == {
        "c/a", "c/b", "c/a_ok", "c/b_ok", "overhead_vs_torch", "overhead_vs_lightning"}
    assert set(figures["ci95"]) == set(figures["verdict"]) == {"c/b", "c/a"}
    assert all(set(c) == {"ratio", "low", "high"} for c in figures["ci95"].values())
    assert figures["params"] == 8 * 8 + 8 + 8 * 10 + 10
    assert figures["settings"] == {"steps": 4, "warmup": 1, "rounds": 2, "max_rounds": 2, "batch_size": 4,
                                   "hidden": 8, "layers": 1, "features": 8, "threads": 1,
                                   "variants": list(VARIANTS), "short": False}
    # the full recipe's runs really went through the CLI: their logs are kept in --out
    assert sorted(p.name for p in (tmp_path / "out").glob("full-*.log")) == ["full-0.log", "full-1.log"]
    # and everything they stored stayed there: MLflow's default put their artifacts (the manifest, the time plot,
    # the model: 20 MB a GPT round, 2.4 GB after one long benchmark) in ./mlruns of the working directory
    assert not (tmp_path / "mlruns").exists()
    assert len(list((tmp_path / "out" / "mlruns" / "bench-overhead").glob("*/artifacts/manifest.json"))) == 2

    text = _table(print_overhead, figures)
    assert "Framework overhead — MLP with 0.00 M params, best of 2 interleaved rounds" in text
    for name in VARIANTS.values():
        assert name in text, name
    for fragment in ("c/a = ", "(goal >= 0.95)", "c/b = ", "(goal >= 0.98 with the CI above 0.97)", "95% CI",
                     "StepTiming alone:",
                     "warning: steps under 50 ms"):
        assert fragment in text, fragment


def test_a_round_without_kept_files_leaves_only_its_log_and_its_metrics(tmp_path: Path) -> None:
    """A benchmark without ``--out`` drops each round's checkpoints and artifacts once the round is over (20 MB a
    GPT round filled the disk over a few hundred); with ``--out`` they stay. Its metrics stay in the store."""
    script = tmp_path / "rounds.py"
    script.write_text(textwrap.dedent("""
        import argparse, json, sys
        from pathlib import Path
        import mlflow
        from recipes.bench.overhead import mlp_recipe
        from recipes.bench.runs import own_store, run_full_recipe

        args = argparse.Namespace(features=8, hidden=8, layers=1, batch_size=4, steps=4)
        found = {}
        for keep in (False, True):
            with own_store(Path(sys.argv[1]) / f"keep-{keep}") as root:
                ends, _ = run_full_recipe(mlp_recipe(args), root, 0, keep_files=keep)
                (run,) = mlflow.search_runs(experiment_names=["bench-overhead"], output_format="list")
                found[str(keep)] = {"steps": len(ends), "runs": (root / "runs").exists(),
                                    "artifacts": (root / "mlruns").exists(), "log": (root / "full-0.log").exists(),
                                    "metrics": sorted(run.data.metrics)}
        print(json.dumps(found))
    """))
    env = cli_env(tmp_path)
    del env["MLFLOW_TRACKING_URI"]  # each benchmark's own store
    result = run_script(script, str(tmp_path), cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert [found[k]["steps"] for k in ("False", "True")] == [4, 4]
    assert [(found[k]["runs"], found[k]["artifacts"], found[k]["log"]) for k in ("False", "True")] == [
        (False, False, True), (True, True, True)]
    assert found["False"]["metrics"] == found["True"]["metrics"] != []
    assert not (tmp_path / "mlruns").exists()


def test_overhead_b_and_c_alone_stand_side_by_side(tmp_path: Path) -> None:
    result = _bench(tmp_path, "overhead", "--variants", "c,b", "--steps", "4", "--warmup", "1", "--rounds", "2",
                    "--max-rounds", "2", *TINY, "--json")
    figures = json.loads(result.stdout)
    order = [line.split("(")[1].split(")")[0] for line in result.stderr.splitlines() if line.startswith("round ")]
    assert order == ["b", "c", "c", "b"]  # VARIANTS' order whatever the order given, alternating by round
    assert set(figures["all"]) == set(figures["throughput"]) == {"b", "c"}
    assert figures["settings"]["variants"] == ["b", "c"]
    assert set(figures["ci95"]) == set(figures["verdict"]) == {"c/b"}
    best = figures["throughput"]
    assert figures["ratios"] == {"c/b": best["c"] / best["b"], "c/b_ok": best["c"] / best["b"] >= 0.98,
                                 "overhead_vs_lightning": best["b"] / best["c"] - 1.0}
    assert figures["ci95"]["c/b"]["ratio"] == pytest.approx(sum(figures["all"]["c"]) / sum(figures["all"]["b"]))
    assert figures["timing_cost"] is None
    text = _table(print_overhead, figures)
    assert VARIANTS["b"] in text and VARIANTS["c"] in text
    assert VARIANTS["a"] not in text and "c/a" not in text and "of plain Lightning's step time here" not in text
    assert "best rounds: c/b = " in text and "StepTiming alone: measured on a trivial model" in text


@pytest.mark.serial
@pytest.mark.slow(covered_by="tests/unit/recipes/bench/test_bench.py::test_contention_figures_and_table_by_hand")
def test_contention_command_json_and_table(tmp_path: Path) -> None:
    result = _bench(tmp_path, "contention", "--rounds", "1", "--steps", "30", "--warmup", "5",
                    "--settings", "1,adaptive", "--json")
    figures = json.loads(result.stdout)
    assert figures["steps"] == 30 and figures["rounds"] == 1
    assert list(figures["settings"]) == ["1 thread", "adaptive (AdaptiveCpuThreads: not bitwise resumable)"]
    for row in figures["settings"].values():
        assert len(row["all"]["quiet"]) == len(row["all"]["contended"]) == 1
        assert row["quiet_ms"] == row["all"]["quiet"][0] > 0
        assert row["ratio"] == row["contended_ms"] / row["quiet_ms"]
        assert row["quiet_vs_today"] is None  # torch's default (the reference) was not among the settings
        assert row["ok"] == (row["ratio"] <= 2.0)
    text = _table(print_contention, figures)
    for cell in ("quiet ms", "busy ms", "busy/quiet", "1 thread", "Goal: busy <= 2x quiet"):
        assert cell in text, cell


@pytest.mark.slow(covered_by="tests/unit/recipes/bench/test_bench_startup.py::"
                            "test_stamps_callback_writes_its_readings_at_the_end_of_training")
def test_startup_command_times_a_fresh_launch_and_its_relaunch(tmp_path: Path) -> None:
    """One round: a fresh launch stopped by a drill after its first step (exit 75), the relaunch that finishes it."""
    result = _bench(tmp_path, "startup", "--rounds", "1", "--imports", "--json", "--out", str(tmp_path / "out"))
    figures = json.loads(result.stdout)
    assert set(figures) == {"launches", "median", "ci95", "load_average", "settings", "imports", "floor",
                            "over_floor"}
    # the floor (python -c "import torch, lightning.pytorch") beside each launch: the ratio of one paired round
    (floor,) = figures["floor"]["seconds"]
    assert figures["floor"]["code"] == "import torch, lightning.pytorch" and floor > 0
    for kind in ("fresh", "relaunch"):
        over = figures["over_floor"][kind]
        assert over["ratio"] == pytest.approx(figures["launches"][kind][0]["to_first_step"] / floor)
        assert over["ci95"] == [pytest.approx(over["ratio"])] * 2 and over["goal"] == 1.3
        assert over["verdict"] == ("met" if over["ratio"] <= 1.3 else "missed")
    # what a launch imports before its parse: each library is there, and they and the rest add up to the total
    imports = figures["imports"]
    assert imports["torch"] > 0 and imports["lightning"] > 0
    assert imports["mlflow"] == 0  # the CLI module no longer imports it: global rank 0's fit does, after the parse
    assert imports["total"] == pytest.approx(sum(imports[k] for k in ("torch", "lightning", "mlflow", "rest")))
    assert [launch["exit_code"] for kind in ("fresh", "relaunch") for launch in figures["launches"][kind]] == [75, 0]
    for kind in ("fresh", "relaunch"):
        (launch,) = figures["launches"][kind]
        assert figures["median"][kind] == {k: v for k, v in launch.items() if k != "exit_code"}
        assert all(launch[phase] > 0 for phase in PHASES)
        assert launch["to_first_step"] == pytest.approx(launch["imports"] + launch["cli"] + launch["setup"])
        assert launch["total"] > launch["to_first_step"] + launch["wrap-up"]
        assert figures["ci95"][kind]["total"] == [launch["total"], launch["total"]]  # one round: its own figure
    # the two launches were one run: the relaunch resumed it from the fresh launch's notice checkpoint
    assert "round 1/1 (fresh, stopped at step 1)" in result.stderr
    assert "round 1/1 (relaunch, resumed from step 1)" in result.stderr
    assert sorted(p.name for p in (tmp_path / "out" / "round0-memory" / "runs" / "digits").iterdir()) == ["startup-0"]
    text = _table(print_startup, figures)
    for cell in ("spawn to first step", "end of training to exit", "fresh launch", "relaunch",
                 'floor: python -c "import torch, lightning.pytorch"', "spawn to first step / floor, relaunch: x"):
        assert cell in text, cell


def test_verify_command_times_both_fetches_of_the_same_chunks(tmp_path: Path) -> None:
    """One round of each way over the 3 training chunks of 512 digits; the cost is the ratio of the medians."""
    result = _bench(tmp_path, "verify", "--rounds", "1", "--chunk-items", "512", "--json")
    figures = json.loads(result.stdout)
    assert (figures["chunks"], figures["rounds"], figures["chunk_items"]) == (3, 1, 512)
    assert figures["bytes"] > 0 and figures["hash_only_s"] > 0
    assert {way: len(times) for way, times in figures["times_s"].items()} == {"plain": 1, "verified": 1}
    assert figures["median_s"] == {way: times[0] for way, times in figures["times_s"].items()}
    assert figures["cost"] == figures["median_s"]["verified"] / figures["median_s"]["plain"] - 1
    from recipes.bench.verify import print_verify

    table = _table(print_verify, figures)
    assert "3 chunks" in table and f"verified vs plain: {figures['cost']:+.1%} (ratio of the medians)" in table
    refused = run_module("recipes.bench", "verify", "--rounds", "0", cwd=tmp_path, env=cli_env(tmp_path))
    assert refused.returncode == 2 and "--rounds 0 must be >= 1" in refused.stderr
