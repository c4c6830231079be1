"""recipes.bench compression: medians over interleaved rounds, bytes relative to dense, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from recipes.bench import compression as bench_compression
from recipes.bench import subcommands as bench


def test_medians_and_bytes_relative_to_dense(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    order: list[tuple[str, int]] = []
    figures = {("dense", 0): {"bytes_per_step": 1000.0, "step_s": 0.010, "val_acc": 0.97},
               ("dense", 1): {"bytes_per_step": 1000.0, "step_s": 0.014, "val_acc": 0.98},
               ("dense", 2): {"bytes_per_step": 1000.0, "step_s": 0.011, "val_acc": 0.96},
               ("topk", 0): {"bytes_per_step": 80.0, "step_s": 0.020, "val_acc": 0.90},
               ("topk", 1): {"bytes_per_step": 80.0, "step_s": 0.030, "val_acc": 0.92},
               ("topk", 2): {"bytes_per_step": 80.0, "step_s": 0.025, "val_acc": 0.91}}

    def fake_run(method: str, round_: int, workdir: Path, epochs: int, timeout: float) -> dict[str, float]:
        order.append((method, round_))
        return figures[(method, round_)]

    monkeypatch.setattr(bench_compression, "_run", fake_run)
    out = bench_compression.bench_compression(["dense", "topk"], rounds=3, epochs=2, workdir=tmp_path)
    assert order == [("dense", 0), ("topk", 0), ("dense", 1), ("topk", 1), ("dense", 2), ("topk", 2)]  # interleaved
    assert out["methods"]["dense"] == {"bytes_per_step": 1000.0, "step_s": 0.011, "val_acc": 0.97,
                                       "bytes_vs_dense": 1.0}
    assert out["methods"]["topk"] == {"bytes_per_step": 80.0, "step_s": 0.025, "val_acc": 0.91,
                                      "bytes_vs_dense": 0.08}


@pytest.mark.parametrize(("argv", "message"), [
    (["compression", "--methods", "dense,int8"], "--methods dense,int8: unknown int8; choose from dense, fp16"),
    (["compression", "--rounds", "0"], "--rounds 0 and --epochs 20 must be >= 1"),
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
