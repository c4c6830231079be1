"""``recipes.train`` leaves the process as it found it: the root logger, the warnings filters, the environment.

A fresh interpreter, as a notebook kernel is before its first cell: its state is taken, then ``train`` refuses a
bad value (a ``TrainError`` after the launch's imports), then trains 3 steps of the digits recipe; after each, the
state is taken again. Then a user's ``logging.warning`` must print, as it did before (the first ``train`` once left
the root logger at ERROR with a handler of its own, 14 more warnings filters and two environment variables).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, cli_env, run_module

pytestmark = pytest.mark.e2e

SCRIPT = '''
import json, logging, os, warnings

def state():
    root = logging.getLogger()
    return {"level": root.level, "handlers": [repr(h) for h in root.handlers], "filters": [repr(f) for f in
            warnings.filters], "env": dict(os.environ)}

out = {"before": state()}
from recipes import TrainError, train

try:
    train("configs/digits.yaml", model={"init_args": {"width": -3}})
except TrainError as err:
    out["error"] = str(err)
out["after_error"] = state()
run = train("configs/digits.yaml", trainer={"max_steps": 3, "limit_val_batches": 1}, run_name="kept")
out["status"] = run.status
out["after_run"] = state()
print("STATE" + json.dumps(out))
logging.warning("the next cell's warning")
'''


def changes(before: dict, after: dict) -> dict:
    """What differs between two states: each key of the environment apart, the rest whole."""
    env = {k: (before["env"].get(k), after["env"].get(k)) for k in {*before["env"], *after["env"]}
           if before["env"].get(k) != after["env"].get(k)}
    rest = {k: (before[k], after[k]) for k in before if k != "env" and before[k] != after[k]}
    return {**rest, **({"env": env} if env else {})}


def test_train_puts_back_logging_warnings_filters_and_environment(tmp_path: Path) -> None:
    (tmp_path / "configs").symlink_to(CONFIGS)
    script = tmp_path / "cells.py"
    script.write_text(SCRIPT)
    # a new interpreter (real), not a fork of the tests' zygote, whose imports have changed the process already
    result = run_module("", cwd=tmp_path, env=cli_env(tmp_path), timeout=300, real=True, script=script)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.split("STATE", 1)[1].splitlines()[0])
    assert out["error"] == "ImageClassifier(width=-3) must be >= 1."
    assert out["status"] == "finished"
    assert changes(out["before"], out["after_error"]) == {}
    assert changes(out["before"], out["after_run"]) == {}
    # printed as in a fresh interpreter (logging.warning configures the root logger it finds without a handler)
    assert result.stderr.splitlines()[-1] == "WARNING:root:the next cell's warning"
