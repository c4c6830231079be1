"""recipes.api's pure parts: the command line a call becomes, the run name it gets, where it runs, the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from recipes.api import Run, arguments, default_run_name, experiment_of, flat_options, in_processes

REPO = Path(__file__).resolve().parents[3]
DIGITS, DDP, FSDP = (str(REPO / "configs" / p) for p in ("digits.yaml", "strategy/ddp.yaml", "strategy/fsdp.yaml"))


def test_options_become_the_cli_flags_as_json() -> None:
    options = {"trainer": {"max_epochs": 3, "precision": "bf16-mixed"}, "spot": {"signals": ["SIGTERM"]},
               "model": {"init_args": {"lr_scheduler": {"init_args": {"T_max": 3}}}},
               "data": {"class_path": "datamodules.digits.DigitsDataModule", "init_args": {"batch_size": 8}},
               "fresh": True, "experiment": "mine"}
    assert arguments(["a.yaml", "b.yaml"], options) == [
        "--config", "a.yaml", "--config", "b.yaml", "--trainer.max_epochs=3", "--trainer.precision=bf16-mixed",
        '--spot.signals=["SIGTERM"]', "--model.init_args.lr_scheduler.init_args.T_max=3",
        '--data={"class_path": "datamodules.digits.DigitsDataModule", "init_args": {"batch_size": 8}}',
        "--fresh=true", "--experiment=mine"]
    assert flat_options({"trainer": {}}) == {"trainer": {}}


def test_the_same_call_names_the_same_run() -> None:
    name = default_run_name([DIGITS], {"trainer": {"max_epochs": 3}})
    assert name == default_run_name([DIGITS], {"trainer": {"max_epochs": 3}})
    assert name.startswith("digits-") and len(name) == len("digits-") + 8
    assert name != default_run_name([DIGITS], {"trainer": {"max_epochs": 4}})
    assert name != default_run_name([DIGITS, DDP], {"trainer": {"max_epochs": 3}})


@pytest.mark.parametrize(("configs", "options", "expected"), [
    ([DIGITS], {}, False),
    ([DIGITS, DDP], {}, True),
    ([DIGITS, FSDP], {}, True),
    ([DIGITS], {"trainer": {"devices": 2}}, True),
    ([DIGITS], {"trainer": {"devices": [0]}}, False),
    ([DIGITS], {"trainer": {"num_nodes": 2}}, True),
    ([DIGITS, DDP], {"trainer": {"strategy": "auto", "devices": 1}}, False),
])
def test_several_devices_run_in_new_processes(configs: list[str], options: dict, expected: bool) -> None:
    assert in_processes(configs, options) is expected


def test_experiment_from_the_configs_then_the_options() -> None:
    assert experiment_of([DIGITS], {}) == "digits"
    assert experiment_of([DIGITS], {"experiment": "mine"}) == "mine"


def test_the_run_renders_as_its_table() -> None:
    run = Run("r1", "digits", "abc", Path("runs/digits/r1"), "interrupted", {"val/acc": 0.5},
              [("val/acc", "0.5000"), ("note", "<b>")])
    assert run._repr_html_() == ("<table><caption>atscale run r1 — INTERRUPTED (run the cell again to resume)"
                                 "</caption><tr><td style='text-align:left'><code>val/acc</code></td><td "
                                 "style='text-align:left'>0.5000</td></tr><tr><td style='text-align:left'><code>"
                                 "note</code></td><td style='text-align:left'>&lt;b&gt;</td></tr></table>")
    assert str(run).splitlines()[1:] == ["  val/acc  0.5000", "  note     <b>"]


def test_importing_recipes_and_train_imports_no_torch() -> None:
    code = ("import sys, recipes; from recipes import train; "
            "print(sorted(m for m in ('torch', 'lightning', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


def test_the_record_is_the_newest_run_of_the_name_and_its_table_the_keys_the_cli_shows(tracked):
    import mlflow

    from callbacks.analysis import keys
    from recipes import api
    from recipes.run import tracking

    client = mlflow.MlflowClient(tracking.tracking_uri())
    exp = client.create_experiment("digits")
    client.create_run(exp, run_name="r", start_time=1_000, tags={tracking.RUN_DIR_TAG: "/old"})
    newest = client.create_run(exp, run_name="r", start_time=2_000, tags={tracking.RUN_DIR_TAG: "/runs/digits/r"})
    for key, value in ((keys.VAL_ACC_KEY, 0.75), (keys.TRAIN_LOSS_KEY, 0.5), (keys.COST_KEY, 0.01),
                       (keys.STEP_KEY, 0.2), (keys.TRAIN_ACC_KEY, 0.8)):
        client.log_metric(newest.info.run_id, key, value)
    run = api._tracked("r", "digits", "finished")
    assert (run.run_id, run.run_dir) == (newest.info.run_id, Path("/runs/digits/r"))
    assert run.rows[:3] == [("cost/usd", "0.0100"), ("train/loss", "0.5000"), ("val/acc", "0.7500")]
    assert run.rows[3] == ("mlflow", f"experiment 'digits', run {newest.info.run_id}")
    assert api._tracked("nobody", "digits", "finished").run_id is None
