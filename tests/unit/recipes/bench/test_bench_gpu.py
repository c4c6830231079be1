"""recipes.bench gpu: the cpu reduced mode end to end (tiny sizes), the table by hand, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recipes.bench.gpu import CPU_MODE, KEYS, markdown
from recipes.bench.subcommands import main

ROWS = ("| tokens/s, full recipe", "| MFU", "| full recipe / plain Lightning", "| StepTiming", "| async checkpoint",
        "| sync checkpoint")


def test_cpu_reduced_mode_writes_the_json_and_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # the text corpus cache and the run files stay in the test's folder
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "out"
    code = main(["gpu", "--device", "cpu", "--steps", "5", "--warmup", "2", "--saves", "2", "--out", str(out)])
    assert code == 0
    figures = json.loads((out / "bench_gpu.json").read_text())
    assert tuple(figures) == KEYS
    assert figures["mode"] == CPU_MODE
    assert figures["mfu"] is None  # no MFU claim on a CPU
    assert figures["settings"]["steps"] == 5 and figures["settings"]["precision"] == "32-true"
    assert set(figures["throughput"]["tokens_per_s"]) == {"b", "b+timing", "c"}
    assert all(v > 0 for v in figures["throughput"]["tokens_per_s"].values())
    assert figures["overhead"]["verdict"] == "inconclusive"  # one round decides nothing
    assert figures["step_timing"]["clock"] == "perf_counter" and figures["step_timing"]["rounds"][0]["steps"] == 3
    ckpt = figures["checkpoint"]
    assert len(ckpt["async_all_s"]) == 2 and ckpt["floor_pinned"] is False and ckpt["bytes"] > 0
    table = (out / "bench_gpu.md").read_text()
    assert CPU_MODE in table and "not GPU figures" in table
    body = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| measure")]
    assert len(body) == len(ROWS) and all(row.startswith(prefix) for row, prefix in zip(body, ROWS, strict=True))
    assert "| MFU | not claimed (cpu reduced mode) |" in table
    assert table in capsys.readouterr().out


def _figures() -> dict:
    return {
        "mode": "gpu", "device": "NVIDIA H200",
        "settings": {"torch": "2.9", "rounds": 3, "steps": 250, "warmup": 50, "config": "configs/gpt-124m.yaml",
                     "precision": "bf16-mixed", "compile": True},
        "model": {"params": 85_000_000},
        "throughput": {"tokens_per_s": {"b": 500_000.0, "b+timing": 499_000.0, "c": 495_000.0}},
        "mfu": {"full_recipe": 0.4712, "plain_lightning": 0.476, "peak_tflops": 989.0},
        "overhead": {"c/b": 0.99, "low": 0.985, "high": 0.995, "verdict": "inconclusive", "rounds_run": 3},
        "step_timing": {"clock": "cuda events", "ratio": 1.0041},
        "checkpoint": {"bytes": 1.03e9, "floor_pinned": True, "async_blocked_s": 0.0251, "floor_copy_s": 0.02,
                       "async_over_floor": 1.255, "async_first_s": 0.3, "sync_s": 2.5, "async_over_sync": 0.01004},
        "elapsed_s": 301.0,
    }


def test_gpu_table_by_hand() -> None:
    table = markdown(_figures())
    assert table.splitlines()[0] == ("`python -m recipes.bench gpu` — NVIDIA H200, torch 2.9; 3 interleaved round(s) "
                                     "of 250 steps (50 warm-up); 301 s in all.")
    assert ("| tokens/s, full recipe (configs/gpt-124m.yaml, bf16-mixed, compile True) | 495,000 "
            "(plain Lightning 500,000) | |") in table
    assert "| MFU, full recipe (dense bf16 peak 989 TFLOP/s) | 47.1% (plain Lightning 47.6%) | >= 45% |" in table
    assert "| full recipe / plain Lightning, tokens/s | 0.990 (95 % CI 0.985 .. 0.995: inconclusive) | >= 0.99 |" \
        in table
    assert "| StepTiming (cuda events) / wall clock, summed over the window | 1.004 | 1 +- 2% |" in table
    assert ("| async checkpoint stall per save (1,030 MB: weights + AdamW state) vs pinned device-to-host copy | "
            "25.1 ms vs 20.0 ms = 1.25x (first save, which allocates the buffer: 300.0 ms) | <= 1.5x |") in table
    assert "| sync checkpoint save (AtomicCheckpointIO) | 2500.0 ms; async = 1.0% of it | |" in table


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "3", "--warmup", "3"], "--steps 3 must exceed --warmup 3 + 1"),
    (["--saves", "1"], "--saves 1 must be >= 2"),
    (["--rounds", "0"], "--rounds 0 must be >= 1"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
])
def test_bad_input_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gpu", "--device", "cpu", *argv] if "--device" not in argv else ["gpu", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU that is there")
def test_cuda_without_a_gpu_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gpu", "--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device is available" in capsys.readouterr().err
