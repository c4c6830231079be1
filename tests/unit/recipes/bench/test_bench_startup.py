"""The start-up benchmark (recipes.bench.startup): its phase arithmetic, its import breakdown, its usage errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipes.bench import startup as bench_startup
from recipes.bench import subcommands as bench


def test_phases_are_the_intervals_between_the_stamps() -> None:
    stamps = {"parse": 108.0, "fit_start": 109.5, "first_step": 110.0, "train_end": 111.0}
    assert bench_startup.phases(100.0, stamps, 114.0) == {
        "imports": 8.0, "cli": 1.5, "setup": 0.5, "wrap-up": 3.0, "to_first_step": 10.0, "total": 14.0}


@pytest.mark.parametrize("stamps", [
    {"parse": 108.0, "fit_start": 109.5, "train_end": 111.0},  # no first step
    {"parse": 108.0, "fit_start": 107.0, "first_step": 110.0, "train_end": 111.0},  # out of order
])
def test_a_missing_or_backwards_stamp_is_an_error_naming_them(stamps: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="out of order"):
        bench_startup.phases(100.0, stamps, 114.0)


IMPORTTIME = """\
import time: self [us] | cumulative | imported package
import time:       100 |        100 |   _io
import time:       300 |     2000000 |     torch._C
import time:      1000 |     2500000 |   torch
import time:       400 |      400000 |         torch.distributed
import time:      2000 |     3000000 |       lightning.fabric
import time:      1000 |     4000000 |     lightning
import time:       500 |       500000 |       mlflow.utils
import time:       700 |     1500000 |     mlflow
import time:       300 |       300000 |       torch.nn
import time:       200 |       200000 |         mlflow.pytorch
import time:       100 |       400000 |       callbacks.mlflow_model
import time:      9000 |     9000000 |   recipes.run.cli
import time:       100 |     9200000 | recipes.fit
import time:       100 |      300000 | site
"""


def test_import_breakdown_sums_each_librarys_outermost_rows() -> None:
    # torch 2.5 + 0.3 s (torch.nn, a later import of its own: no library's row around it; torch._C is inside
    # torch, torch.distributed inside Lightning), lightning 4.0, mlflow 1.5 + 0.2 (mlflow.pytorch, inside a module of
    # ours); the total is the two top-level rows, 9.2 + 0.3 s; the rest is what the three do not account for
    out = bench_startup.import_breakdown(IMPORTTIME)
    assert out == pytest.approx({"torch": 2.8, "lightning": 4.0, "mlflow": 1.7, "rest": 1.0, "total": 9.5})


def test_stamps_callback_writes_its_readings_at_the_end_of_training(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([50.0, 51.0, 53.0])  # fit start, the first batch, the end (later batches read no clock)
    monkeypatch.setattr(bench_startup.time, "time", lambda: next(clock))
    monkeypatch.setenv(bench_startup.STAMPS_ENV, str(tmp_path / "stamps.json"))
    stamps = bench_startup.StartupStamps()
    stamps.on_fit_start(None, None)  # type: ignore[arg-type]
    stamps.on_train_batch_start(None, None, None, 0)  # type: ignore[arg-type]
    stamps.on_train_batch_start(None, None, None, 1)  # type: ignore[arg-type]  (the first one counts)
    stamps.on_train_end(None, None)  # type: ignore[arg-type]
    written = json.loads((tmp_path / "stamps.json").read_text())
    assert written == {"parse": bench_startup._IMPORTED_AT, "fit_start": 50.0, "first_step": 51.0,
                       "train_end": 53.0}


def test_zero_rounds_is_one_line_and_exit_2(capsys: pytest.CaptureFixture) -> None:
    assert bench.main(["startup", "--rounds", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --rounds 0 must be >= 1"
