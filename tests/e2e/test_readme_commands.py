"""The README's commands, run in order as a newcomer would, on a fresh run root.

Each command is taken from the README verbatim (the test fails if the README no longer has it),
with the short settings docs/development.md names appended (fewer epochs or steps), and
placeholders (``<run>``, ``<run id or run dir>``) filled from the runs made before. For every command:
the documented exit code, no traceback, no line repeated more than twice, no path cut with ``…``,
and at most ``WARNING_BUDGET`` warning lines.

The default recipe's three commands (one device, DDP, FSDP) are the session's shared full runs
(``digits_recipe_runs``, which tests/e2e/test_fit.py checks in depth), each in a new interpreter as a newcomer
starts it: their output is checked here as any command's, and the README continues from a copy of the
single-device run's store and run folder. The other commands start as forks of the test zygote
(``tests/forked.py``: the same process, argv, environment and output, without the library imports, which the
shared runs pay and show, warnings included).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DIGITS_STRATEGIES, REPO, readme_env, readme_workdir, run_module

pytestmark = pytest.mark.e2e

README = (REPO / "README.md").read_text()
SHORT = ["--trainer.max_epochs", "2"]
#: Warning lines a command may print (Lightning's "GPU available" lines are not warnings).
WARNING_BUDGET = 3
_WARNING = re.compile(r"warn|deprecat|^\S+\.py:\d+: ", re.IGNORECASE)

# (the command as the README prints it, short settings appended here, the exit code the README documents)
SCRIPT: list[tuple[str, list[str], int]] = [
    # the first command, as is (a shared run, with --run_name single): promote needs it
    (DIGITS_STRATEGIES["single"], ["--run_name", "single"], 0),
    ("python -m recipes.fit --config configs/digits.yaml --trainer.max_epochs 5 --run_name short", [], 0),
    (DIGITS_STRATEGIES["ddp"], ["--run_name", "ddp"], 0),  # shared runs, as is: 20 epochs
    (DIGITS_STRATEGIES["fsdp"], ["--run_name", "fsdp"], 0),
    ("python -m recipes.fit --config configs/digits.yaml --config configs/precision/bf16-mixed.yaml", SHORT, 0),
    ("python -m recipes.fit --config configs/digits.yaml --print_config", [], 0),
    ("python -m recipes.fit --config configs/digits.yaml --spot.every_minutes auto --spot.interruption_rate 0.05",
     SHORT, 0),
    ("python -m recipes.fit --config configs/digits.yaml --cost.instance a3-highgpu-1g --cost.market spot", SHORT, 0),
    # no network here (and a closed proxy in the test): the README says a missing data folder is exit 2
    ("python -m recipes.fit --config configs/digits.yaml --experiment mnist --data datamodules.vision.MNISTDataModule "
     "--data.init_args.root data/ --model.init_args.in_channels 1", SHORT, 2),
    ("python -m recipes.prepare digits --output data/stream/digits", [], 0),
    ("python -m recipes.fit --config configs/digits-stream.yaml", SHORT, 0),
    ("python -m recipes.fit --config configs/gpt.yaml", ["--trainer.max_steps", "20", "--run_name", "gpt"], 0),
    ('python -m recipes.sample --ckpt runs/gpt/<run>/checkpoints/step=00000300.ckpt --prompt "def "', [], 0),
    ("python -m recipes.plan --step-time 3 --steps 10000 --serial-fraction 0.05 --instance a3-highgpu-1g", [], 0),
    ("python -m recipes.plan --run <run id or run dir> --instance a3-highgpu-8g --interruption-rate 0.05", [], 0),
    ("python -m recipes.comm --params 1.5e9 --bytes-per-param 4 --bandwidth-gbps 100 --workers 2,8,64", [], 0),
    ("python -m recipes.plan batch --b-noise 200 --ref-steps 900 --ref-batch 32 --step-times "
     "32:0.011,64:0.015,128:0.024 --batches 32,64,128,256,512,1024 --devices 1,2,4,8 --params 1.2e6 "
     "--bandwidth-gbps 100 --instance a3-highgpu-8g", [], 0),
    ("python -m recipes.compare --experiment digits", [], 0),
    ("python -m recipes.compare --experiment digits --metric val/expected_cost", [], 0),
    ("python -m recipes.promote --experiment digits --metric val/acc --mode max", [], 0),
    ("python -m recipes.promote --experiment digits --metric val/expected_cost --mode min", [], 0),
    ("python -m recipes.scale --config configs/digits.yaml --devices 1,2 --steps 60", [], 0),
    # last: the sweep adds its parent and child runs to the digits experiment that compare shows above
    ("python -m recipes.sweep --config configs/digits.yaml --space configs/sweeps/digits.yaml --trials 8 "
     "--name digits-sweep --parallel 2 --trainer.max_epochs 3",
     ["--trials", "2", "--parallel", "1", "--trainer.max_epochs", "1"], 0),
]


def readme_has(command: str) -> bool:
    """Whether the README shows ``command`` (line continuations and runs of spaces folded)."""
    folded = re.sub(r"\s*\\\n\s*", " ", README)
    return " ".join(command.split()) in " ".join(folded.split()) or command in folded


def fill(command: str, workdir: Path) -> list[str]:
    """The command's argv with its placeholders filled from the runs already made."""
    if "<run>" in command:
        steps = sorted((workdir / "runs/gpt/gpt/checkpoints").glob("step=*.ckpt"))
        assert steps, "the GPT run left no checkpoint"
        command = command.replace("runs/gpt/<run>/checkpoints/step=00000300.ckpt", str(steps[-1]))
    command = command.replace("<run id or run dir>", "runs/digits/short")
    argv = shlex.split(command)
    assert argv[0] == "python"
    return [sys.executable, *argv[1:]]


#: The commands whose runs are the session's shared ones: command -> strategy (``digits_recipe_runs``).
SHARED = {command: name for name, command in DIGITS_STRATEGIES.items()}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory,
            digits_recipe_runs: dict[str, tuple[Path, subprocess.CompletedProcess]]) -> Path:
    """A fresh folder that looks like the repository's root to the commands (configs/ in place), holding what
    the README's first command leaves: a copy of the shared single-device run's MLflow store and run folder."""
    path = readme_workdir(tmp_path_factory.mktemp("readme"))
    single, _ = digits_recipe_runs["single"]
    shutil.copy(single / "mlflow.db", path / "mlflow.db")
    shutil.copytree(single / "runs", path / "runs", symlinks=True)
    return path


@pytest.mark.parametrize(("command", "extra", "code"), SCRIPT, ids=[c.split("recipes.")[1][:60] for c, _, _ in SCRIPT])
def test_readme_command(workdir: Path, command: str, extra: list[str], code: int,
                        digits_recipe_runs: dict[str, tuple[Path, subprocess.CompletedProcess]]) -> None:
    assert readme_has(command), f"the README no longer shows: {command}"
    if command in SHARED:  # run once for the session, as this test would run it
        result = digits_recipe_runs[SHARED[command]][1]
        assert result.args[1:] == [*fill(command, workdir), *extra][1:]
    else:
        _, flag, module, *args = fill(command, workdir)
        assert flag == "-m", command
        result = run_module(module, *args, *extra, cwd=workdir, env=readme_env(workdir), timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == code, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    rules = set("─━│┃┏┓┗┛┡┩└┘┌┐├┤╇╈┼ ")  # table borders repeat by design
    lines = [line.strip() for line in output.splitlines() if set(line.strip()) - rules]
    if "--print_config" in command:  # a YAML document repeats its keys (init_args:) by design
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
    repeated = {line for line in lines if lines.count(line) > 2}
    assert not repeated, repeated
    assert not [line for line in lines if "…" in line and ("/" in line or "runs" in line)], output[-4000:]
    warnings = [line for line in result.stderr.splitlines() if _WARNING.search(line)]
    assert len(warnings) <= WARNING_BUDGET, warnings
