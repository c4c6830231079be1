"""``recipes.plan`` and ``recipes.comm`` answer values that overflow with one line and exit 2, never a traceback,
an ``inf``/``nan`` row or JSON that is not JSON."""

from __future__ import annotations

import json

import pytest

from recipes import comm, plan


def test_plan_step_time_that_overflows_the_work_exits_2(capsys: pytest.CaptureFixture) -> None:
    code = plan.main(["--step-time", "1e308", "--steps", "10", "--serial-fraction", "0.05",
                      "--instance", "a3-highgpu-1g"])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert out.err == ("error: --step-time 1e+308 s x --steps 10 gives no finite plan (work_s=inf must be a positive, "
                       "finite number of seconds.); give a real step time and step count.\n")


def test_comm_zero_params_exits_2(capsys: pytest.CaptureFixture) -> None:
    assert comm.main(["--params", "0", "--bandwidth-gbps", "100", "--workers", "2"]) == 2
    assert capsys.readouterr().err == "error: --params: '0' must be a finite number > 0\n"


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_comm_params_that_overflow_exit_2_without_inf_rows(capsys: pytest.CaptureFixture, json_flag: list[str]) -> None:
    assert comm.main(["--params", "1e308", "--bandwidth-gbps", "100", "--workers", "2,8", *json_flag]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == ("error: --params 1e308 x --bytes-per-param 4 bytes overflow a float: "
                       "give a real model size (e.g. 1.5e9)\n")


def test_comm_times_that_overflow_exit_2(capsys: pytest.CaptureFixture) -> None:
    assert comm.main(["--params", "1e300", "--bandwidth-gbps", "1e-300", "--workers", "2", "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "overflow a float in " in out.err and "time_s" in out.err


def test_comm_json_is_strict_json(capsys: pytest.CaptureFixture) -> None:
    assert comm.main(["--params", "1.5e9", "--bandwidth-gbps", "100", "--workers", "2,8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))["rows"]
    assert [r["workers"] for r in rows] == [2, 8]
    assert rows[0]["time_s"] == pytest.approx(2 * 1 / 2 * 6e9 / 12.5e9)  # 2(N-1)/N * S/B at N=2: 480 ms
