"""``python -m recipes.reproduce``: a deterministic CPU run reruns to identical metrics; differences are named."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest
import yaml

from callbacks.manifest import build_manifest
from recipes.reproduce import DEFAULT_IGNORE, compare_metrics, final_metrics, main, rerun_config
from tests.conftest import CONFIGS, FAST, cli_env, client_for, run_fit


def test_deterministic_cpu_run_reproduces_identically(tracked, capsys):
    run_fit(tracked, "--config", str(CONFIGS / "digits.yaml"), "--experiment", "repro", "--run_name", "orig",
            "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4", "--trainer.log_every_n_steps", "2",
            "--trainer.deterministic", "true", *FAST, check=True, env=cli_env(tracked))
    client = client_for(tracked)
    exp_id = client.get_experiment_by_name("repro").experiment_id
    (orig,) = client.search_runs([exp_id])
    orig_ckpts = sorted(p.name for p in (tracked / "runs/repro/orig/checkpoints").iterdir())

    assert main([orig.info.run_id, "--run_name", "again"]) == 0
    out = capsys.readouterr()

    runs = {r.info.run_name: r for r in client.search_runs([exp_id])}
    assert set(runs) == {"orig", "again"}
    again = runs["again"]
    assert again.data.tags["reproduces"] == orig.info.run_id
    assert again.info.status == "FINISHED"
    # its own directories, and the original's checkpoints untouched (not moved aside by --fresh)
    assert again.data.params["checkpoint.dirpath"] == "runs/repro/again/checkpoints"
    assert again.data.params["spot.dirpath"] == "runs/repro/again/checkpoints"
    assert any((tracked / "runs/repro/again/checkpoints").iterdir())
    assert sorted(p.name for p in (tracked / "runs/repro/orig/checkpoints").iterdir()) == orig_ckpts
    # identical numbers: the training's metrics are bitwise equal
    for key in ("val/acc", "val/loss", "train/loss", "baseline/linear_acc", "epoch"):
        assert again.data.metrics[key] == orig.data.metrics[key], key
    history = [(m.step, m.value) for m in client.get_metric_history(again.info.run_id, "train/loss")]
    assert history == [(m.step, m.value) for m in client.get_metric_history(orig.info.run_id, "train/loss")]
    compared = final_metrics(orig, DEFAULT_IGNORE)
    assert "val/acc" in compared and not any(k.startswith("system/") for k in compared)
    assert f"Reproduced: {len(compared)} metrics identical within 0" in out.out
    assert "warning: git SHA" not in out.err  # same checkout, same machine


def _fake_run(tmp_path: Path, manifest: dict, metrics: dict[str, float]) -> str:
    client = client_for(tmp_path)
    exp_id = client.create_experiment("fake")
    run = client.create_run(exp_id, run_name="old")
    config = yaml.safe_load((CONFIGS / "digits.yaml").read_text())
    ckpts = "runs/fake/old/checkpoints"
    config.update({"experiment": "fake", "run_name": "old", "runs_root": "runs", "ckpt_path": None, "fresh": False,
                   "checkpoint": {"dirpath": ckpts}, "spot": {"dirpath": ckpts}})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    client.log_artifact(run.info.run_id, str(tmp_path / "config.yaml"))
    client.log_artifact(run.info.run_id, str(tmp_path / "manifest.json"))
    for key, value in metrics.items():
        client.log_metric(run.info.run_id, key, value)
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def test_every_difference_from_here_is_warned(tracked, capsys):
    here = build_manifest(1, 42, "0" * 64)
    old = json.loads(json.dumps(here))
    old["git"] = {"sha": "1234567890abcdef", "dirty": True}
    old["versions"]["torch"] = "1.13.0"
    old["packages"] = [p for p in here["packages"] if not p.lower().startswith("numpy==")] + ["numpy==1.0.0",
                                                                                            "leftpad==0.1"]
    old["data_fingerprint"] = "f" * 64
    old["gpus"] = ["NVIDIA H100 80GB HBM3"] * 8
    old["cpu_count"] = 224
    run_id = _fake_run(tracked, old, {"val/acc": 0.5})

    assert main([run_id, "--dry_run", "--run_name", "again"]) == 0
    out = capsys.readouterr()
    warnings = [line for line in out.err.splitlines() if line.startswith("warning: ")]
    here_sha = here["git"]["sha"]
    numpy_here = next(p for p in here["packages"] if p.lower().startswith("numpy==")).split("==")[1]
    assert f"warning: git SHA: run 1234567890abcdef | here {here_sha}" in warnings
    assert "warning: git: the run's checkout had uncommitted changes, so its exact code is not recorded" in warnings
    assert f"warning: torch version: run 1.13.0 | here {here['versions']['torch']}" in warnings
    assert f"warning: package versions (run -> here): numpy 1.0.0 -> {numpy_here}" in warnings
    assert "warning: packages only in the run: leftpad" in warnings
    # the fingerprint here is the digits data's, computed from the config's datamodule
    assert any(w.startswith("warning: data fingerprint: run ffffffffffff | here ") for w in warnings)
    assert f"warning: GPUs: run {old['gpus']} | here {here['gpus']}" in warnings
    assert f"warning: CPU cores: run 224 | here {here['cpu_count']}" in warnings
    assert "Rerunning run" in out.out and "--run_name again --fresh true" in out.out
    assert not (tracked / "runs/fake/again").exists()  # dry run: nothing trained


def test_rerun_config_points_at_the_new_run():
    config = {"run_name": "old", "fresh": False, "ckpt_path": "runs/x/old/checkpoints/last.ckpt", "runs_root": "runs",
              "checkpoint": {"dirpath": "runs/x/old/checkpoints", "monitor": "val/acc"},
              "spot": {"dirpath": "runs/x/old/checkpoints", "keep": 2}}
    new = rerun_config(config, "new", "elsewhere")
    assert new == {"run_name": "new", "fresh": True, "ckpt_path": None, "runs_root": "elsewhere",
                   "checkpoint": {"dirpath": None, "monitor": "val/acc"}, "spot": {"dirpath": None, "keep": 2}}
    assert config["checkpoint"]["dirpath"] == "runs/x/old/checkpoints"  # the original is not modified


def test_metric_differences_and_ignored_keys():
    diffs = compare_metrics({"val/acc": 0.9, "val/loss": 0.3, "train/loss": 0.5},
                            {"val/acc": 0.9, "val/loss": 0.30000001, "extra": 1.0})
    table = {d.key: (d.original, d.rerun, d.delta, d.within(0.0)) for d in diffs}
    assert table["val/acc"] == (0.9, 0.9, 0.0, True)
    assert table["val/loss"][3] is False and table["val/loss"][2] == pytest.approx(1e-8, rel=1e-6)
    assert table["train/loss"] == (0.5, None, None, False)
    assert table["extra"] == (None, 1.0, None, False)
    assert next(d for d in diffs if d.key == "val/loss").within(1e-7)
    ignored = ["system/cpu_utilization_percentage", "time/step_s", "comm/measured_s", "cost/usd",
               "train/tokens_per_sec", "train/device/mfu", "spot/notice_to_saved_s", "amdahl/serial_fraction"]
    kept = ["val/acc", "train/loss", "baseline/linear_acc", "noise_scale/b_simple", "lr/actual", "epoch"]
    assert [k for k in ignored if not any(fnmatch.fnmatch(k, p) for p in DEFAULT_IGNORE)] == []
    assert [k for k in kept if any(fnmatch.fnmatch(k, p) for p in DEFAULT_IGNORE)] == []


def test_unknown_run_and_missing_artifacts_exit_2(tracked, capsys):
    assert main(["0123456789abcdef0123456789abcdef"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: run '0123456789abcdef0123456789abcdef' not found at sqlite:///{tracked}/mlflow.db."]
    client = client_for(tracked)
    run = client.create_run(client.create_experiment("bare"), run_name="bare")
    assert main([run.info.run_id]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1
    assert errors[0].startswith(f"error: run {run.info.run_id} has no config.yaml artifact (was it started by")
