"""The tools' shared plumbing, and the promise that tools which do not train import no torch or Lightning."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys

import pytest

from recipes.run.common import USAGE_EXIT_CODE, ArgumentParser, UsageError, positive_ints, run_main
from tests.conftest import REPO

#: The tools that never train in their own process (scale, plan batch and reproduce train in subprocesses).
LIGHT_TOOLS = ("compare", "promote", "plan", "plan.batch_runs", "plan.batch_report", "scale", "comm",
               "reproduce", "run.common", "run.tracking")


@pytest.mark.parametrize("tool", LIGHT_TOOLS)
def test_tool_imports_neither_torch_nor_lightning(tool: str) -> None:
    code = (f"import recipes.{tool}, sys; heavy = sorted(m for m in ('torch', 'lightning') if m in sys.modules); "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_positive_ints_names_the_bad_item() -> None:
    assert positive_ints("--devices", " 1, 2,8") == [1, 2, 8]
    with pytest.raises(UsageError, match=r"^--devices: 'x' is not an integer >= 1 \(expected e.g. 1,2,4\)$"):
        positive_ints("--devices", "1,x")
    with pytest.raises(UsageError, match=r"^--workers: 0 must be >= 1 \(expected e.g. 2,8\)$"):
        positive_ints("--workers", "2,0", "2,8")
    with pytest.raises(UsageError, match=r"^--batches: -3 must be >= 1"):
        positive_ints("--batches", "-3")


def test_run_main_turns_usage_errors_and_ctrl_c_into_one_line_and_an_exit_code(
        capsys: pytest.CaptureFixture[str]) -> None:
    def bad() -> int:
        raise UsageError("--metric 'val/ac' is not logged by any run")

    def interrupted() -> int:
        raise KeyboardInterrupt

    assert run_main(bad) == USAGE_EXIT_CODE
    assert capsys.readouterr().err == "error: --metric 'val/ac' is not logged by any run\n"
    assert run_main(interrupted) == 130
    assert capsys.readouterr().err == "interrupted\n"
    assert run_main(lambda: 0) == 0


def test_parser_raises_instead_of_printing_usage() -> None:
    parser = ArgumentParser(prog="tool")
    parser.add_argument("--n", type=int, required=True)
    with pytest.raises(UsageError, match="the following arguments are required: --n"):
        parser.parse_args([])
    with pytest.raises(UsageError, match="argument --n: invalid int value: 'two'"):
        parser.parse_args(["--n", "two"])


#: Every tool but fit (Lightning's parser), each given one bad argument: (module, argv, its one error line).
BAD_ARGUMENTS = [
    ("compare", ["--bogus"], "error: the following arguments are required: --experiment"),
    ("compare", ["--experiment", "e", "--mode", "up"], "error: argument --mode: invalid choice: 'up' (choose from "
                                                       "'max', 'min')"),
    ("promote", ["--experiment", "e", "--bogus"], "error: unrecognized arguments: --bogus"),
    ("promote", [], "error: --experiment is required (or --sweep NAME)"),
    ("reproduce", [], "error: the following arguments are required: run_id"),
    ("reproduce", ["r", "--tolerance", "x"], "error: argument --tolerance: invalid float value: 'x'"),
    ("sample", ["--ckpt", "c", "--top-k", "many"], "error: argument --top-k: invalid int value: 'many'"),
    ("plan", ["--instance", "x", "--steps", "1.5"], "error: argument --steps: invalid int value: '1.5'"),
    ("plan", ["batch", "--bogus"], "error: unrecognized arguments: --bogus"),
    ("comm", ["--params", "1", "--bandwidth-gbps", "1", "--workers", "2", "--bogus"],
     "error: unrecognized arguments: --bogus"),
    ("scale", ["--config", "c.yaml", "--steps", "x"], "error: argument --steps: invalid int value: 'x'"),
    ("sweep", ["--config", "c.yaml", "--space", "s.yaml", "--trials", "x"],
     "error: argument --trials: invalid int value: 'x'"),
    ("bench.subcommands", ["nonsense"], "error: argument command: invalid choice: 'nonsense' (choose from "
                                    "'overhead', 'checkpoint', 'chaos', 'contention', 'compression', 'gpu', 'lm', "
                                    "'startup', 'stream', 'chunks', 'verify', 'fit')"),
]


@pytest.mark.parametrize(("tool", "argv", "line"), BAD_ARGUMENTS, ids=[f"{t}-{i}" for i, (t, *_) in
                                                                      enumerate(BAD_ARGUMENTS)])
def test_every_tool_reports_a_bad_argument_in_one_line_and_exits_2(tool: str, argv: list[str], line: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """One parser for every tool: no usage block, the one line that names the bad value, exit code 2."""
    import importlib

    main = importlib.import_module(f"recipes.{tool}").main
    try:
        code = main(argv)
    except SystemExit as exit_request:
        code = exit_request.code
    assert code == USAGE_EXIT_CODE
    assert capsys.readouterr().err.splitlines() == [line]


# ------------------------------------------------------------------------------ a command's run name


def test_the_same_command_names_the_same_run_however_its_options_are_written() -> None:
    from recipes.run.common import command_run_name

    spaced = ["--config", "configs/digits.yaml", "--trainer.max_epochs", "3"]
    name = command_run_name(spaced)
    assert name == "digits-" + hashlib.sha256(json.dumps(spaced).encode()).hexdigest()[:8]
    assert command_run_name(["--config=configs/digits.yaml", "--trainer.max_epochs=3"]) == name
    # how it starts is not what it trains: --fresh starts this run over, --ckpt_path continues it from that file
    assert command_run_name([*spaced, "--fresh", "true"]) == name
    assert command_run_name(["--ckpt_path=runs/x/step=1.ckpt", *spaced]) == name
    assert command_run_name([*spaced[:2], "--trainer.max_epochs", "4"]) != name
    assert command_run_name([*spaced, "--config", "configs/strategy/ddp.yaml"]) != name


def test_a_command_without_a_config_or_with_an_odd_file_name_still_gets_a_valid_name() -> None:
    from recipes.run.common import NAME_PATTERN, command_run_name

    assert re.fullmatch(r"run-[0-9a-f]{8}", command_run_name(["--model", "recipes.classifier.Classifier"]))
    odd = command_run_name(["--config", "my configs/ünïcode run.yaml"])
    assert NAME_PATTERN.fullmatch(odd) and re.fullmatch(r"n-code-run-[0-9a-f]{8}", odd)
    assert re.fullmatch(r"run-[0-9a-f]{8}", command_run_name(["--config", "__.yaml"]))
