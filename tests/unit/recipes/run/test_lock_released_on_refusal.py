"""A launch refused at start-up lets go of the run's lock: an in-process caller (a test, a sweep) can relaunch it."""

from __future__ import annotations

from pathlib import Path

from recipes.run.cli import run_cli
from recipes.run.common import USAGE_EXIT_CODE
from recipes.run.lock import RunLock
from tests.conftest import CONFIGS, FAST

ARGS = ["--config", str(CONFIGS / "digits.yaml"), "--run_name", "r", "--trainer.max_steps", "2",
        "--trainer.limit_val_batches", "1", "--log_model", "false", *FAST]


def test_a_refused_resume_releases_the_lock(tracked: Path) -> None:
    assert run_cli(ARGS) == 0
    # a changed learning rate: the restored optimizer state would override it, so the resume is refused
    assert run_cli([*ARGS, "--trainer.max_steps", "4", "--model.init_args.optimizer.init_args.lr", "0.1"]) == \
        USAGE_EXIT_CODE
    lock = RunLock(tracked / "runs" / "digits" / "r")
    lock.acquire()  # raises RunLocked while the refused launch still holds it
    lock.release()
