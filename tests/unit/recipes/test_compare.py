"""``recipes.compare`` as a newcomer reads it: a 100-column terminal, real-sized configs, a crashed run, $0 costs.

The runs are hand-made in a real MLflow store, shaped like the CLI's: about 120 flattened params each,
default run names (``YYYYMMDD-HHMMSS-xxxx``), and one run that FAILED before it logged any param.
"""

from __future__ import annotations

import json

import matplotlib.image
import mlflow
import pytest

from recipes import compare
from tests.conftest import client_for

LR = "model.init_args.optimizer.init_args.lr"
EPOCHS = "trainer.max_epochs"
#: ~120 params every run of a recipe logs with the same value (the flattened config).
SHARED = {
    **{f"trainer.option_{i:03d}": "None" for i in range(100)},
    **{f"model.init_args.layer_{i:02d}.init_args.width": "32" for i in range(14)},
    "data.class_path": "datamodules.digits.DigitsDataModule",
    "data.init_args.batch_size": "32",
    "model.class_path": "recipes.classifier.ImageClassifier",
    "seed_everything": "42",
}
NAMES = ("20261201-023630-057b", "20261201-024410-a1c3", "20261201-030000-dead")
BASE = {"baseline/linear_acc": 0.9667, "baseline/majority_acc": 0.1}


def _run(client: mlflow.MlflowClient, exp_id: str, name: str, params: dict[str, str], metrics: dict[str, float],
         start_s: int, seconds: float, status: str = "FINISHED") -> str:
    run_id = client.create_run(exp_id, run_name=name, start_time=start_s * 1000).info.run_id
    client.log_batch(run_id, metrics=[mlflow.entities.Metric(k, v, start_s * 1000, 0) for k, v in metrics.items()],
                     params=[mlflow.entities.Param(k, v) for k, v in params.items()])
    client.set_terminated(run_id, status, end_time=int((start_s + seconds) * 1000))
    return run_id


def _own(name: str) -> dict[str, str]:
    """The params that differ between any two runs by construction (their names and directories)."""
    return {"run_name": name, "checkpoint.dirpath": f"runs/digits/{name}/checkpoints",
            "spot.dirpath": f"runs/digits/{name}/checkpoints"}


@pytest.fixture
def digits(tracked):
    """Two finished runs (lr 0.003 vs 0.01, 12 vs 20 epochs, both $0 on cpu-local) and one that crashed at start."""
    client = client_for(tracked)
    exp_id = client.create_experiment("digits")
    _run(client, exp_id, NAMES[0], {**SHARED, **_own(NAMES[0]), LR: "0.003", EPOCHS: "12"},
         {"val/acc": 0.9306, "val/loss": 0.2535, **BASE, "cost/usd": 0.0}, 1_700_000_000, 11.5)
    _run(client, exp_id, NAMES[1], {**SHARED, **_own(NAMES[1]), LR: "0.01", EPOCHS: "20"},
         {"val/acc": 0.9500, "val/loss": 0.2822, **BASE, "cost/usd": 0.0}, 1_700_000_100, 6.2)
    _run(client, exp_id, NAMES[2], {}, {}, 1_700_000_200, 1.0, status="FAILED")
    return client, exp_id


def _table(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert compare.main(["--experiment", "digits", *argv]) == 0
    return capsys.readouterr().out


def _cells(out: str, first: str) -> list[str]:
    """The cells of the table line whose first cell is ``first``."""
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no table line starting with {first!r} in:\n{out}")


def test_the_default_table_is_short_and_names_the_params_that_differ(digits, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    out = _table(capsys)
    header = next(line for line in out.splitlines() if "┃ # ┃" in line)
    assert [c.strip() for c in header.split("┃")[1:-1]] == ["#", "run", "status", "val/acc", "vs linear", "duration",
                                                           "cost $"]
    assert _cells(out, "1") == ["1", NAMES[1], "FINISHED", "0.9500", "-0.0167", "6.2 s", "0.0000"]
    assert _cells(out, "2") == ["2", NAMES[0], "FINISHED", "0.9306", "-0.0361", "11.5 s", "0.0000"]
    assert "Params that differ: model.optimizer.lr, trainer.max_epochs (--long shows their values)." in out
    assert "0.003" not in out and "baseline/" not in out and "val/loss" not in out
    assert "1 FAILED run hidden (--all shows it)." in out
    assert len(out.splitlines()) == 9


def test_a_crashed_run_without_params_does_not_make_every_param_differ(digits, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    out = _table(capsys, "--long")
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "experiment 'digits': 2 runs by val/acc (max)" in out
    assert _cells(out, "1")[:4] == ["1", NAMES[1], "FINISHED", "0.9500"]
    assert _cells(out, "2")[:4] == ["2", NAMES[0], "FINISHED", "0.9306"]
    assert NAMES[2] not in out  # FAILED: hidden, and said so
    assert "1 FAILED run hidden (--all shows it)." in out
    # the two params that differ, in full, one row each, one column per run (#1, #2)
    assert _cells(out, "model.optimizer.lr") == ["model.optimizer.lr", "0.01", "0.003"]
    assert _cells(out, "trainer.max_epochs") == ["trainer.max_epochs", "20", "12"]
    assert "trainer.option_000" not in out and "seed_everything" not in out

    out = _table(capsys, "--all", "--long")
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 100
    assert _cells(out, "3")[:3] == ["3", NAMES[2], "FAILED"]
    assert _cells(out, "model.optimizer.lr") == ["model.optimizer.lr", "0.01", "0.003", "-"]
    assert "trainer.option_000" not in out
    assert f"{NAMES[2]} logged no params." in " ".join(out.split())
    assert "hidden" not in out


def test_json_lists_the_shown_runs_and_what_was_hidden(digits, capsys):
    data = json.loads(_table(capsys, "--json"))
    assert data["differing_params"] == [LR, EPOCHS]
    assert [r["run_name"] for r in data["runs"]] == [NAMES[1], NAMES[0]]
    assert data["hidden"] == {"FAILED": 1}
    data = json.loads(_table(capsys, "--json", "--all"))
    assert data["differing_params"] == [LR, EPOCHS]  # the crashed run's missing params are not differences
    assert [r["run_name"] for r in data["runs"]] == [NAMES[1], NAMES[0], NAMES[2]]
    assert data["hidden"] == {}


def test_two_clean_runs_are_readable_at_100_columns(tracked, capsys, monkeypatch):
    """Before: the names came out as '202…' and the params as 'tra…'."""
    monkeypatch.setenv("COLUMNS", "100")
    client = client_for(tracked)
    exp_id = client.create_experiment("digits")
    for i, (name, lr) in enumerate(zip(NAMES[:2], ("0.003", "0.01"), strict=True)):
        _run(client, exp_id, name, {**SHARED, **_own(name), LR: lr, "trainer.limit_train_batches": str(5 + i)},
             {"val/acc": 0.2 - i / 10, "val/loss": 2.28, **BASE, "cost/usd": 0.0}, 1_700_000_000 + 100 * i, 6.2)
    out = _table(capsys)
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 100
    assert _cells(out, "1")[:4] == ["1", NAMES[0], "FINISHED", "0.2000"]
    assert _cells(out, "2")[:4] == ["2", NAMES[1], "FINISHED", "0.1000"]
    assert "model.optimizer.lr" in out and "trainer.limit_train_batches" in out
    assert "hidden" not in out


def test_many_differing_params_become_one_row_each(tracked, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    client = client_for(tracked)
    exp_id = client.create_experiment("digits")
    sweep = {f"model.init_args.knob_{k:02d}": k for k in range(12)}
    for i, name in enumerate(NAMES):
        params = {**SHARED, **_own(name), **{key: str(v * (i + 1)) for key, v in sweep.items()}}
        _run(client, exp_id, name, params, {"val/acc": 0.5 + i / 10, **BASE}, 1_700_000_000 + 100 * i, 60)
    out = _table(capsys, "--long")
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 100
    assert _cells(out, "model.knob_11") == ["model.knob_11", "33", "22", "11"]  # best (#1) is the third run
    assert [_cells(out, str(i))[1] for i in (1, 2, 3)] == [NAMES[2], NAMES[1], NAMES[0]]


def test_plot_without_costs_uses_wall_time_and_says_so(digits, tracked):
    rows = compare.compare(client_for(tracked), "digits", "val/acc").rows
    fig = compare.compare_figure(rows, "val/acc")
    bars, scatter = fig.axes
    assert [t.get_text() for t in bars.get_xticklabels()] == [NAMES[1], NAMES[0]]  # best first
    assert scatter.get_xlabel() == "wall time (s)"
    assert scatter.get_title() == "val/acc against wall time\n(every run cost $0.00)"
    assert sorted(x for x, _ in scatter.collections[0].get_offsets()) == pytest.approx([6.2, 11.5])
    path = tracked / "compare.png"
    compare.write_plot(rows, "val/acc", str(path))
    height, width, _ = matplotlib.image.imread(path).shape
    assert width > height > 300


#: The runs the README makes in the digits experiment, by what each sets beside the recipe's defaults.
README_RUNS = {
    "default": {},
    "short": {EPOCHS: "5"},
    "ddp": {EPOCHS: "2", "trainer.strategy": "ddp", "trainer.devices": "2"},
    "bf16": {EPOCHS: "2", "trainer.precision": "bf16-mixed"},
    "spot": {EPOCHS: "2", "spot.every_minutes": "auto", "spot.interruption_rate": "0.05"},
    "cost": {EPOCHS: "2", "cost.instance": "a3-highgpu-1g", "cost.market": "spot"},
    "fsdp": {EPOCHS: "2", "trainer.strategy": "fsdp", "trainer.devices": "2", "trainer.precision": "bf16-mixed"},
    "scale-1": {"trainer.max_steps": "60", "trainer.devices": "1"},
    "scale-2": {"trainer.max_steps": "60", "trainer.devices": "2", "trainer.strategy": "ddp"},
}


def test_a_whole_experiment_shows_each_run_by_what_it_changed(tracked, capsys, monkeypatch):
    """Before: at 100 columns nine runs split into three params tables of repeated lines such as
    ``spot.every_minutes │ None │ None │ None``, and a reader had to find the one ``auto`` among them."""
    monkeypatch.setenv("COLUMNS", "100")
    client = client_for(tracked)
    exp_id = client.create_experiment("digits")
    defaults = {EPOCHS: "10", "trainer.strategy": "auto", "trainer.devices": "1", "trainer.precision": "32-true",
                "trainer.max_steps": "-1", "spot.every_minutes": "None", "spot.interruption_rate": "None",
                "cost.instance": "cpu-local", "cost.market": "on_demand"}
    for i, (name, changes) in enumerate(README_RUNS.items()):
        _run(client, exp_id, name, {**SHARED, **_own(name), **defaults, **changes},
             {"val/acc": 0.99 - i / 100, **BASE}, 1_700_000_000 + 100 * i, 60)
    out = _table(capsys, "--long")
    lines = [line.strip() for line in out.splitlines() if set(line.strip()) - set("─━│┃┏┓┗┛┡┩└┘┌┐├┤╇╈┼ ")]
    assert not {line for line in lines if lines.count(line) > 1}, out
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 100
    # each param once with the value most runs have, then each run by what it changes
    assert _cells(out, "trainer.max_epochs") == ["trainer.max_epochs", "2"]
    assert _cells(out, "spot.every_minutes") == ["spot.every_minutes", "None"]
    assert _cells(out, "trainer.strategy") == ["trainer.strategy", "auto"]
    changes = out[out.index("what each run changes"):]
    assert [_cells(changes, str(i))[1:] for i in range(1, 10)] == [
        ["default", "trainer.max_epochs=10"],
        ["short", "trainer.max_epochs=5"],
        ["ddp", "trainer.devices=2, trainer.strategy=ddp"],
        ["bf16", "trainer.precision=bf16-mixed"],
        ["spot", "spot.every_minutes=auto, spot.interruption_rate=0.05"],
        ["cost", "cost.instance=a3-highgpu-1g, cost.market=spot"],
        ["fsdp", "trainer.devices=2, trainer.precision=bf16-mixed, trainer.strategy=fsdp"],
        ["scale-1", "trainer.max_epochs=10, trainer.max_steps=60"],
        ["scale-2", "trainer.devices=2, trainer.max_epochs=10, trainer.max_steps=60,"],  # wraps at 100 columns
    ]
    assert _cells(changes, "")[1:] == ["", "trainer.strategy=ddp"]
    assert "Params: only those that differ among these runs; each run by what it changes from most runs." in out


def test_a_scale_sweeps_parent_run_is_left_out_and_counted(digits, capsys):
    client, exp_id = digits
    # a sweep's parent: FINISHED, no params of its own, the sweep's fits as metrics (its children are the runs)
    parent = client.create_run(exp_id, run_name="scale-digits", tags={"atscale.kind": "scale"}).info.run_id
    client.log_batch(parent, metrics=[mlflow.entities.Metric("val/acc", 0.99, 0, 0),
                                      mlflow.entities.Metric("amdahl/serial_fraction", 0.2, 0, 0)])
    client.set_terminated(parent, "FINISHED")
    data = json.loads(_table(capsys, "--json"))
    assert [r["run_name"] for r in data["runs"]] == [NAMES[1], NAMES[0]]  # not first, despite its 0.99
    assert data["differing_params"] == [LR, EPOCHS]  # its missing params are no differences
    assert data["hidden"] == {"FAILED": 1, "scale sweep": 1}
    assert "1 scale sweep run hidden (--all shows it)." in _table(capsys)
    data = json.loads(_table(capsys, "--json", "--all"))
    assert [r["run_name"] for r in data["runs"]] == ["scale-digits", NAMES[1], NAMES[0], NAMES[2]]
    assert data["hidden"] == {}


def test_a_sweeps_parent_run_is_left_out_and_counted(digits, capsys):
    client, exp_id = digits
    # recipes.sweep's parent: the sweep's own settings as params (none a training run has), its trials are the runs
    parent = client.create_run(exp_id, run_name="sweep-digits",
                               tags={"atscale.kind": "sweep", "atscale.sweep": "s"}).info.run_id
    client.log_batch(parent, metrics=[mlflow.entities.Metric("val/acc", 0.99, 0, 0)],
                     params=[mlflow.entities.Param(f"sweep.option_{i:03d}", str(i)) for i in range(40)])
    client.set_terminated(parent, "FINISHED")
    data = json.loads(_table(capsys, "--json"))
    assert [r["run_name"] for r in data["runs"]] == [NAMES[1], NAMES[0]]
    assert data["differing_params"] == [LR, EPOCHS]  # the parent's 40 settings are no differences
    assert data["hidden"] == {"FAILED": 1, "sweep": 1}
    assert "1 sweep run hidden (--all shows it)." in _table(capsys)


def test_a_long_param_value_is_shortened_in_the_tables_and_kept_whole_in_json(digits, capsys, monkeypatch):
    """A callback's whole init_args as one JSON param used to fill a screen of 'what each run changes'."""
    monkeypatch.setenv("COLUMNS", "100")
    client, exp_id = digits
    value = json.dumps({"class_path": "callbacks.SpotCheckpoint", "init_args": {f"knob_{i}": i for i in range(30)}})
    name = "20261201-040000-beef"
    _run(client, exp_id, name, {**SHARED, **_own(name), LR: "0.02", EPOCHS: "20", "spot": value},
         {"val/acc": 0.96, **BASE}, 1_700_000_300, 5.0)
    out = _table(capsys, "--long")
    assert "SpotCheckpoint" in out and "…" in out  # its first characters (the cell folds them over lines)
    assert "knob_" not in out and len(value) > 2 * compare.SHOWN_VALUE_CHARS
    data = json.loads(_table(capsys, "--json"))
    assert next(r for r in data["runs"] if r["run_name"] == name)["params"]["spot"] == value


def test_a_sweeps_trials_are_compared_among_themselves_not_with_the_plain_runs(digits, capsys, monkeypatch):
    """Before: the trials sat in the plain runs' table, and every knob the sweep turned (and its callback's whole
    JSON) was a param 'that differs' for the plain runs too: about 220 lines after the README's sweep."""
    monkeypatch.setenv("COLUMNS", "100")
    client, exp_id = digits
    parent = client.create_run(exp_id, run_name="digits-lr", start_time=1_700_000_300_000,
                               tags={"atscale.kind": "sweep", "atscale.sweep": "digits-lr"}).info.run_id
    client.set_terminated(parent, "FINISHED")
    callback = json.dumps({"class_path": "recipes.sweep.pruning.SweepTrial", "init_args": {"trial": 0}})
    for i, lr in enumerate(("0.001", "0.02", "0.005")):
        name = f"digits-lr-t{i:03d}"
        run_id = _run(client, exp_id, name, {**SHARED, **_own(name), LR: lr, EPOCHS: "3", "cpu_threads": "2",
                                             "trainer.callbacks": callback.replace("0", str(i))},
                      {"val/acc": 0.8 + i / 100, **BASE}, 1_700_000_400 + 10 * i, 3.0)
        client.set_tag(run_id, "mlflow.parentRunId", parent)
        client.set_tag(run_id, "sweep", "digits-lr")
    out = _table(capsys)
    plain, sweep = out.split("sweep 'digits-lr': 3 runs by val/acc (max)")
    assert "experiment 'digits': 2 runs by val/acc (max)" in plain and "digits-lr-t" not in plain
    assert "Params that differ: model.optimizer.lr, trainer.max_epochs (--long shows their values)." in plain
    assert [_cells(sweep, str(i))[1] for i in (1, 2, 3)] == ["digits-lr-t002", "digits-lr-t001", "digits-lr-t000"]
    assert "Params that differ: model.optimizer.lr, trainer.callbacks (--long shows their values)." in sweep
    assert "1 sweep run hidden (--all shows it)." in out
    assert len(out.splitlines()) == 19

    data = json.loads(_table(capsys, "--json"))
    assert [(g["title"], len(g["run_ids"])) for g in data["groups"]] == [("experiment 'digits'", 2),
                                                                         ("sweep 'digits-lr'", 3)]
    assert data["groups"][0]["differing_params"] == [LR, EPOCHS]
    long = _table(capsys, "--long")
    assert "cpu_threads" not in long  # every trial has the same: no difference among them
    trials = long.split("sweep 'digits-lr'")[1]
    assert all(f"model.optimizer.lr={lr}" in trials for lr in ("0.005", "0.02", "0.001"))
