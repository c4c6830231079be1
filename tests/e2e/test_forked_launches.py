"""The test suite's forked launches (``tests/forked.py``) behave as ``python -m`` processes do.

Most end-to-end tests start the CLI as a fork of a zygote that imported torch, Lightning and MLflow once;
these tests hold the fork to what a new interpreter does: argv, working directory, environment, streams,
exit codes (returned, raised, uncaught, killed by a signal), its own pid and session, and, for the CLI
itself, the same output as a new interpreter line for line.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, FAST, cli_env, start_module
from tests.forked import ForkedProcess, same_import_environment

pytestmark = pytest.mark.e2e

PROGRAM = textwrap.dedent("""
    import os, sys, time
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("PROBE"), "main", __name__)
    print("err", file=sys.stderr)
    what = sys.argv[1]
    if what == "raise":
        raise ValueError("boom")
    if what == "sleep":
        print("sleeping", flush=True)
        open("sleeping", "w").close()
        time.sleep(60)
    sys.exit(int(what))
""")


@pytest.fixture
def program(tmp_path: Path) -> Path:
    (tmp_path / "probe_program.py").write_text(PROGRAM)
    return tmp_path


def forked(workdir: Path, *args: str, **popen: object) -> ForkedProcess:
    proc = start_module("probe_program", *args, cwd=workdir, env=cli_env(workdir, PROBE="x"), **popen)
    assert isinstance(proc, ForkedProcess)  # the zygote served it
    return proc


def test_argv_cwd_environment_streams_and_exit_codes(program: Path) -> None:
    proc = forked(program, "3", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3
    assert out == f"argv ['3'] cwd {program} env x main __main__\n"
    assert err == "err\n"
    assert proc.pid != os.getpid()


def test_an_uncaught_exception_prints_its_traceback_and_exits_1(program: Path) -> None:
    proc = forked(program, "raise", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert err.splitlines()[0] == "err" and "Traceback (most recent call last):" in err
    assert err.rstrip().splitlines()[-1] == "ValueError: boom"


@pytest.mark.parametrize("group", [False, True])
def test_a_signal_reaches_the_process_itself_and_its_status_says_so(program: Path, group: bool) -> None:
    proc = forked(program, "sleep", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                  start_new_session=group)
    assert proc.stdout.readline().startswith("argv ['sleep']") and proc.stdout.readline() == "sleeping\n"
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.1)
    if group:
        assert os.getpgid(proc.pid) == proc.pid  # a session (and group) of its own, as start_new_session gives
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        assert os.getpgid(proc.pid) != proc.pid
        os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM


def test_a_new_session_exists_when_the_pid_is_handed_out(program: Path) -> None:
    """``os.killpg(proc.pid, ...)`` right after the start reaches the child: its group exists before its pid does."""
    for _ in range(20):
        proc = forked(program, "sleep", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            assert os.getpgid(proc.pid) == proc.pid
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_a_different_import_time_environment_gets_a_new_interpreter(program: Path) -> None:
    env = cli_env(program, OMP_NUM_THREADS="7")
    assert not same_import_environment(env, cli_env(program))
    assert same_import_environment(cli_env(program, MLFLOW_TRACKING_URI="sqlite:///x.db"), cli_env(program))
    # the zygote serves the environment of its first launch: this test alone (``-k``) must not start it with OMP=7
    usual = start_module("probe_program", "0", cwd=program, stdout=subprocess.DEVNULL)
    assert isinstance(usual, ForkedProcess) and usual.wait(timeout=60) == 0
    proc = start_module("probe_program", "0", cwd=program, env=env, stdout=subprocess.DEVNULL)
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 0
    assert isinstance(start_module("probe_program", "0", cwd=program, real=True, stdout=subprocess.DEVNULL),
                      subprocess.Popen)


def _normalized(text: str, run_name: str) -> list[str]:
    """Output lines with numbers, run ids, and times masked (they differ between any two runs), and runs of spaces
    and rules collapsed: the end table's width follows its widest figure (a start-up of 10.2 s is a column wider
    than one of 6.71 s). The end table's badput rows come largest first, an order of measured times: sorted."""
    text = text.replace(run_name, "RUN")
    masked = (re.sub(r"[0-9a-f]{32}|\d+(\.\d+)?|v_num: \w+", "N", line) for line in text.splitlines())
    lines = [re.sub(r" +", " ", re.sub("─+", "─", line)).rstrip() for line in masked]
    badput = [i for i, line in enumerate(lines) if line.startswith("│ badput:")]
    for i, line in zip(badput, sorted(lines[i] for i in badput), strict=True):
        lines[i] = line
    return lines


def test_the_cli_prints_what_it_prints_in_a_new_interpreter(tmp_path: Path) -> None:
    """Line for line, stdout and stderr: no import-time logging or warning configuration is lost or added."""
    args = ("--config", str(CONFIGS / "digits.yaml"), *FAST, "--trainer.max_epochs", "1",
            "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2", "--log_model", "false")
    outputs = {}
    for real in (True, False):
        name = "real" if real else "fork"  # the same length: the end table sizes to it
        proc = start_module("recipes.fit", *args, "--run_name", name, cwd=tmp_path, real=real,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        assert isinstance(proc, ForkedProcess) != real
        outputs[real] = (_normalized(out, name), _normalized(err, name))
    assert outputs[False] == outputs[True]


def test_communicate_times_out_then_returns_what_was_written_once_killed(program: Path) -> None:
    proc = forked(program, "sleep", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.communicate(timeout=0.2)
    deadline = time.monotonic() + 60
    while not (program / "sleeping").exists():  # everything written: what is read after the kill is all of it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.kill()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert out.splitlines()[1:] == ["sleeping"] and err == "err\n"
