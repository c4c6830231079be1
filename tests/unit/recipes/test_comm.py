"""Tests for the ``python -m recipes.comm`` CLI: hand-computed numbers and bad-input handling."""

from __future__ import annotations

import json

import pytest

from recipes.comm import main

BASE = ["--params", "1.5e9", "--bytes-per-param", "4", "--bandwidth-gbps", "100", "--latency-us", "5"]


def _run_json(capsys, argv):
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    return json.loads(out.out)


def test_json_rows_match_hand_computed_values(capsys):
    data = _run_json(capsys, [*BASE, "--workers", "2,8,64"])
    inputs = data["inputs"]
    assert inputs["size_bytes"] == 6e9
    assert inputs["bandwidth_bytes_per_s"] == 12.5e9
    assert inputs["latency_us"] == 5.0
    assert inputs["powersgd_ratio"] == 0.01
    two, eight, sixty_four = data["rows"]
    assert [two["workers"], eight["workers"], sixty_four["workers"]] == [2, 8, 64]

    # bytes sent per worker: 2(N-1)/N * 6e9
    assert two["bytes_sent_per_worker"] == pytest.approx(6e9, rel=1e-15)
    assert eight["bytes_sent_per_worker"] == pytest.approx(10.5e9, rel=1e-15)
    assert sixty_four["bytes_sent_per_worker"] == pytest.approx(11.8125e9, rel=1e-15)

    # time: 2(N-1)/N * 0.48 s + 2(N-1) * 5 us
    assert two["time_s"] == pytest.approx(0.48 + 1e-5, abs=1e-12)
    assert eight["time_s"] == pytest.approx(0.84 + 7e-5, abs=1e-12)
    assert sixty_four["time_s"] == pytest.approx(0.945 + 63e-5, abs=1e-12)

    # fp16: 3e9 B -> bandwidth term halves, latency term stays
    assert eight["fp16_size_bytes"] == 3e9
    assert eight["fp16_time_s"] == pytest.approx(0.42 + 7e-5, abs=1e-12)
    assert eight["fp16_saving_s"] == pytest.approx(0.42, abs=1e-12)

    # PowerSGD at 1%: 6e7 B -> 0.0084 s + 7e-5 s at N = 8
    assert eight["powersgd_size_bytes"] == pytest.approx(6e7, rel=1e-15)
    assert eight["powersgd_time_s"] == pytest.approx(0.0084 + 7e-5, abs=1e-12)
    assert eight["powersgd_saving_s"] == pytest.approx(0.8316, abs=1e-12)
    assert eight["powersgd_saving_frac"] == pytest.approx(0.8316 / 0.84007, rel=1e-12)


def test_dtype_name_and_powersgd_ratio(capsys):
    data = _run_json(
        capsys,
        [
            "--params", "1e9", "--bytes-per-param", "bf16", "--bandwidth-gbps", "400",
            "--workers", "4", "--powersgd-ratio", "0.1",
        ],
    )  # fmt: skip
    (row,) = data["rows"]
    # 2e9 B at 50e9 B/s, N = 4: 1.5 * 0.04 = 0.06 s; fp16 is the same size (no saving)
    assert data["inputs"]["bytes_per_param"] == 2.0
    assert row["time_s"] == pytest.approx(0.06, abs=1e-12)
    assert row["fp16_saving_s"] == pytest.approx(0.0, abs=1e-12)
    # PowerSGD at 10%: 0.006 s
    assert row["powersgd_time_s"] == pytest.approx(0.006, abs=1e-12)


def test_table_output_shows_the_numbers(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    assert main([*BASE, "--workers", "2,8"]) == 0
    out = capsys.readouterr().out
    assert "Ring all-reduce of 6.00 GB" in out
    assert "480.01" in out  # N=2, ms
    assert "840.07" in out  # N=8, ms
    assert "10.50 GB" in out  # bytes per worker at N=8
    assert "420.0 (50%)" in out  # fp16 saving at N=8


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--params", "1e9", "--bandwidth-gbps", "100", "--workers", "2,0"], "--workers: 0 must be >= 1"),
        (["--params", "1e9", "--bandwidth-gbps", "100", "--workers", "2,x"], "'x'"),
        (["--params", "-5", "--bandwidth-gbps", "100", "--workers", "2"], "'-5'"),
        (["--params", "lots", "--bandwidth-gbps", "100", "--workers", "2"], "'lots'"),
        (["--params", "1e9", "--bandwidth-gbps", "0", "--workers", "2"], "--bandwidth-gbps: '0'"),
        (["--params", "1e9", "--bandwidth-gbps", "100", "--latency-us", "-1", "--workers", "2"], "'-1'"),
        (["--params", "1", "--bytes-per-param", "int3", "--bandwidth-gbps", "1", "--workers", "2"], "'int3'"),
        (["--params", "1e9", "--bandwidth-gbps", "100", "--workers", "2", "--powersgd-ratio", "2"], "'2'"),
        (["--params", "1e9", "--bandwidth-gbps", "100"], "--workers"),
        (["--params", "1e9", "--bandwidth-gbps", "100", "--workers", "2", "--bogus"], "--bogus"),
    ],
)
def test_bad_values_exit_2_with_one_line_naming_the_value(capsys, argv, named):
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: ")
    assert named in lines[0]
