"""recipes.run.context: what a launch checks of its config, what the run is called, and the resume policy."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from jsonargparse import Namespace

from callbacks.storage import ckpt_store
from recipes.run import tracking
from recipes.run.common import (
    ENV_CKPT_PATH,
    ENV_MLFLOW_RUN_ID,
    ENV_PARENT_RUN_ID,
    ENV_RUN_NAME,
    ENV_RUN_TAGS,
    UsageError,
)
from recipes.run.context import (
    TRAINER_COUNTS,
    RunContext,
    check_devices,
    check_location,
    check_trainer_values,
    default_run_name,
    explicit_checkpoint,
    flatten,
    global_rank_from_env,
    launched_by_parent,
    mlflow_run_of,
    refuse_ignored_changes,
    refused_changes,
    resolve_resume,
    resumable_change,
    run_tags,
    search_tags,
    torchrun_nodes,
)


def test_more_cpu_processes_than_cores_are_refused_naming_the_count_and_the_way_out(monkeypatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with pytest.raises(UsageError) as refused:
        check_devices(Namespace(devices=4, accelerator="cpu"))
    assert str(refused.value) == ("trainer.devices=4 asks for 4 CPU processes, but this machine has 2 CPU cores "
                                  "(--oversubscribe true starts them anyway, one thread each).")


def test_oversubscribe_lets_them_start(monkeypatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    check_devices(Namespace(devices=4, accelerator="cpu"), oversubscribe=True)
    check_devices(Namespace(devices="3", accelerator="cpu"), oversubscribe=True)


def test_as_many_as_the_cores_need_no_flag(monkeypatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    check_devices(Namespace(devices=2, accelerator="cpu"))
    check_devices(Namespace(devices="auto", accelerator="cpu"))


# ------------------------------------------------------------------------------------------ checks of the config
def test_a_storage_url_with_credentials_is_refused_with_them_masked() -> None:
    with pytest.raises(UsageError) as refused:
        check_location("--runs_root", "s3://AKIA:s3cret@bucket/runs")
    assert str(refused.value) == (
        "--runs_root s3://***@bucket/runs: credentials in a storage URL would be stored with the run and printed; "
        "give them through the store's own configuration (e.g. AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
        "GOOGLE_APPLICATION_CREDENTIALS), not in the URL.")
    check_location("--runs_root", "s3://bucket/runs")  # no credentials: accepted
    check_location("--runs_root", None)  # not a string: nothing to check


@pytest.mark.parametrize(("key", "meaning"), list(TRAINER_COUNTS.items()))
def test_a_trainer_count_below_one_is_refused_naming_key_and_meaning(key: str, meaning: str) -> None:
    with pytest.raises(UsageError) as refused:
        check_trainer_values(Namespace(**{key: 0}))
    assert str(refused.value) == f"trainer.{key}=0 must be >= 1 ({meaning})."


def test_trainer_values_lightning_can_divide_by_pass() -> None:
    check_trainer_values(Namespace(val_check_interval=0.5, check_val_every_n_epoch=None, accumulate_grad_batches=1))
    check_trainer_values(Namespace(accumulate_grad_batches=False))  # a bool is not a count
    check_trainer_values(None)


# --------------------------------------------------------------------------------------- what the run is called
def test_search_tags_name_recipe_model_data_strategy_devices_and_command(monkeypatch) -> None:
    import callbacks.manifest

    monkeypatch.setattr(callbacks.manifest, "git_state", lambda cwd: {"sha": "abc123"})
    monkeypatch.setattr(sys, "argv", ["-m", "--runs_root", "http://u:pw@h/x"])
    monkeypatch.setattr(sys, "executable", "/venv/bin/python")
    cfg = Namespace(config=["configs/digits.yaml", "configs/strategy/ddp.yaml"], experiment="digits",
                    model=Namespace(class_path="recipes.classifier.ImageClassifier"),
                    data={"class_path": "datamodules.digits.DigitsDataModule"}, cost=None,
                    trainer=Namespace(strategy="ddp", devices=2, num_nodes=None, precision=None))
    assert search_tags(cfg) == {
        "atscale.recipe": "digits.yaml + ddp.yaml",
        "atscale.model": "ImageClassifier",
        "atscale.data": "DigitsDataModule",
        "atscale.strategy": "ddp",
        "atscale.devices": "2 x 1",
        "atscale.precision": "32-true",
        "atscale.market": "on_demand",
        "mlflow.note.content": "```\npython -m --runs_root http://u:***@h/x\n```",
        "atscale.git_sha": "abc123",
    }


def test_search_tags_without_configs_or_git_fall_back_to_the_experiment(monkeypatch) -> None:
    import callbacks.manifest

    monkeypatch.setattr(callbacks.manifest, "git_state", lambda cwd: {})
    monkeypatch.setattr(sys, "argv", ["fit"])
    monkeypatch.setattr(sys, "executable", "python3")
    cfg = Namespace(config=None, experiment="gpt", model="a plain value", data=None, cost={"market": "spot"},
                    trainer=Namespace(strategy=None, devices=None, num_nodes=2, precision="bf16-mixed"))
    tags = search_tags(cfg)
    assert tags == {"atscale.recipe": "gpt", "atscale.model": "a plain value", "atscale.data": "None",
                    "atscale.strategy": "auto", "atscale.devices": "auto x 2", "atscale.precision": "bf16-mixed",
                    "atscale.market": "spot", "mlflow.note.content": "```\npython3 fit\n```"}


LAUNCH_ENV = ("RANK", "SLURM_PROCID", "LOCAL_RANK", "WORLD_SIZE", "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID",
              "SLURM_ARRAY_TASK_ID", "TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE", ENV_RUN_NAME,
              ENV_CKPT_PATH, ENV_MLFLOW_RUN_ID, ENV_RUN_TAGS, ENV_PARENT_RUN_ID)


@pytest.fixture
def launch_env(monkeypatch) -> pytest.MonkeyPatch:
    """No launcher's variables: each test sets the ones it is about."""
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("env", "rank"), [
    ({}, 0),
    ({"RANK": "3", "SLURM_PROCID": "5", "LOCAL_RANK": "1"}, 3),  # torchrun's RANK first
    ({"SLURM_PROCID": "5", "LOCAL_RANK": "1"}, 5),
    ({"LOCAL_RANK": "0"}, 0),
    ({"LOCAL_RANK": "2"}, 2),  # Lightning's launcher sets only LOCAL_RANK on one node
])
def test_global_rank_from_the_launchers_variables(launch_env, env: dict[str, str], rank: int) -> None:
    for key, value in env.items():
        launch_env.setenv(key, value)
    assert global_rank_from_env() == rank


@pytest.mark.parametrize(("env", "launched"), [
    ({}, False),
    ({"LOCAL_RANK": "1"}, False),  # a rank of its own launcher (torchrun): it decides
    ({ENV_RUN_NAME: "r"}, False),
    ({"LOCAL_RANK": "0", ENV_RUN_NAME: "r"}, False),  # the launching process itself
    ({"LOCAL_RANK": "1", ENV_RUN_NAME: "r"}, True),
])
def test_launched_by_parent_needs_a_further_local_rank_and_the_parents_run_name(launch_env, env, launched) -> None:
    for key, value in env.items():
        launch_env.setenv(key, value)
    assert launched_by_parent() is launched


@pytest.mark.parametrize(("env", "name"), [
    ({"SLURM_JOB_ID": "4242"}, "slurm-4242"),
    ({"SLURM_JOB_ID": "4243", "SLURM_ARRAY_JOB_ID": "4200", "SLURM_ARRAY_TASK_ID": "7"}, "slurm-4200-7"),
    ({"TORCHELASTIC_RUN_ID": "job9", "WORLD_SIZE": "4"}, "torchrun-job9"),
])
def test_a_scheduled_job_names_its_run_the_same_on_every_rank(launch_env, env, name) -> None:
    for key, value in env.items():
        launch_env.setenv(key, value)
    assert default_run_name(["--config", "configs/digits.yaml"]) == name


def test_a_command_without_a_scheduler_is_named_by_its_arguments(launch_env) -> None:
    launch_env.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's value without --rdzv-id
    args = ["--config", "configs/digits.yaml", "--data.num_workers", "2"]
    name = default_run_name(args)
    assert name == "digits-" + hashlib.sha256(json.dumps(args).encode()).hexdigest()[:8]
    launch_env.setenv("WORLD_SIZE", "2")  # every rank of torchrun without --rdzv-id has the same command line
    assert default_run_name(args) == name


def test_a_config_given_as_a_dict_gets_the_time_and_four_hex_digits(launch_env) -> None:
    launch_env.setattr(time, "strftime", lambda fmt: "20261206-183000")
    assert re.fullmatch(r"20261206-183000-[0-9a-f]{4}", default_run_name(None))


def test_several_processes_without_a_shared_name_are_refused(launch_env) -> None:
    launch_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match=r"^several processes were launched without a shared run name: pass "
                                         r"--run_name NAME \(or torchrun --rdzv-id ID\)"):
        default_run_name(None)


@pytest.mark.parametrize(("env", "nodes"), [
    ({}, None),
    ({"TORCHELASTIC_RUN_ID": "none", "GROUP_WORLD_SIZE": "2"}, None),
    ({"TORCHELASTIC_RUN_ID": "j", "GROUP_WORLD_SIZE": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, 3),
    ({"TORCHELASTIC_RUN_ID": "j", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, 2),
    ({"TORCHELASTIC_RUN_ID": "j", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, None),  # not a whole count
    ({"TORCHELASTIC_RUN_ID": "j", "GROUP_WORLD_SIZE": "0"}, None),
])
def test_torchrun_nodes_of_the_round(launch_env, env, nodes) -> None:
    for key, value in env.items():
        launch_env.setenv(key, value)
    assert torchrun_nodes() == nodes


def test_run_tags_from_the_environment(launch_env) -> None:
    assert run_tags() is None
    launch_env.setenv(ENV_RUN_TAGS, json.dumps({"sweep": "s1", "trial": "3"}))
    launch_env.setenv(ENV_PARENT_RUN_ID, "parent42")
    assert run_tags() == {"sweep": "s1", "trial": "3", "mlflow.parentRunId": "parent42"}


# ------------------------------------------------------------------------------------------ params and changes
def test_flatten_makes_dotted_keys_json_lists_redacted_and_capped_values() -> None:
    cfg = Namespace(trainer=Namespace(max_epochs=3, devices=[0, 1]), uri="http://u:pw@host/x", note="y" * 7000,
                    off=None)
    assert flatten(cfg) == {"trainer.max_epochs": "3", "trainer.devices": "[0, 1]", "uri": "http://u:***@host/x",
                            "note": "y" * 6000, "off": "None"}
    assert flatten({"a": {"b": (1, "c")}}, prefix="p.") == {"p.a.b": '[1, "c"]'}


@pytest.mark.parametrize(("key", "resumable"), [
    ("trainer.max_epochs", True), ("spot", True), ("spot.every_n_steps", True), ("checkpoint.dirpath", True),
    ("trainer.max_epochs_x", False), ("spotted", False), ("checkpoint.monitor", False),
    ("model.init_args.optimizer.init_args.lr", False),
])
def test_resumable_change_is_a_listed_key_or_below_one(key: str, resumable: bool) -> None:
    assert resumable_change(key) is resumable


def test_refused_changes_are_the_changed_logged_keys_that_resume_would_ignore_sorted() -> None:
    logged = {"trainer.max_epochs": "2", "seed_everything": "0", "model.lr": "0.003", "data.batch_size": "32"}
    params = {"trainer.max_epochs": "4", "seed_everything": "1", "model.lr": "0.003", "data.batch_size": "64",
              "new.key": "x"}
    assert refused_changes(logged, params) == [("data.batch_size", "32", "64"), ("seed_everything", "0", "1")]


class FakeClient:
    """The part of ``MlflowClient`` the resume policy reads: runs by id, with params and tags."""

    def __init__(self, runs: dict[str, SimpleNamespace], experiments: dict[str, str] | None = None) -> None:
        self.runs, self.experiments = runs, experiments or {}

    def get_run(self, run_id: str) -> SimpleNamespace:
        from mlflow.exceptions import MlflowException

        if run_id not in self.runs:
            raise MlflowException(f"Run '{run_id}' not found")
        return self.runs[run_id]

    def get_experiment_by_name(self, name: str) -> SimpleNamespace | None:
        return SimpleNamespace(experiment_id=self.experiments[name]) if name in self.experiments else None


def _run(params: dict[str, str] | None = None, tags: dict[str, str] | None = None, experiment_id: str = "1",
         run_name: str = "r") -> SimpleNamespace:
    return SimpleNamespace(data=SimpleNamespace(params=params or {}, tags=tags or {}),
                           info=SimpleNamespace(experiment_id=experiment_id, run_name=run_name))


def test_an_ignored_change_on_resume_is_refused_naming_old_and_new() -> None:
    client = FakeClient({"r1": _run({"seed_everything": "0", "trainer.max_epochs": "2"})})
    cfg = Namespace(experiment="digits", seed_everything=1, trainer=Namespace(max_epochs=5))
    with pytest.raises(UsageError) as refused:
        refuse_ignored_changes(client, "r1", cfg, "c", "runs/digits/c/checkpoints/step=00000045.ckpt")
    assert str(refused.value) == (
        "run digits/c was started with another config; resuming would keep the checkpoint's training state and "
        "ignore: seed_everything (0 -> 1). Relaunch with the original values, or start over with --fresh true or "
        "a new --run_name.")


def test_a_change_without_a_checkpoint_starts_a_new_mlflow_run_and_a_resumable_one_continues() -> None:
    client = FakeClient({"r1": _run({"seed_everything": "0", "trainer.max_epochs": "2"})})
    changed = Namespace(experiment="digits", seed_everything=1, trainer=Namespace(max_epochs=2))
    assert refuse_ignored_changes(client, "r1", changed, "c", None) is None
    longer = Namespace(experiment="digits", seed_everything=0, trainer=Namespace(max_epochs=5))
    assert refuse_ignored_changes(client, "r1", longer, "c", "x.ckpt") == "r1"
    assert refuse_ignored_changes(client, "other-store", changed, "c", "x.ckpt") == "other-store"


# ----------------------------------------------------------------------------------------------- the policy
def _checkpoint(path: Path, step: int, run_id: str | None = "mlrun1") -> Path:
    """A small checkpoint that loads safely, published with its integrity record."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "w": torch.arange(3.0)}, path)
    ckpt_store.write_record(path, step, 0, extra={"mlflow_run_id": run_id} if run_id else {})
    return path


def _ctx(tmp_path: Path) -> RunContext:
    return RunContext(experiment="digits", run_name="r", run_dir=tmp_path / "runs/digits/r",
                      tracking_uri="sqlite:///mlflow.db", ckpt_path=None, mlflow_run_id=None)


def _cfg(**over: object) -> Namespace:
    return Namespace(**{"ckpt_path": None, "fresh": False, **over})


def test_the_run_context_names_its_places(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    assert ctx.checkpoint_dir == tmp_path / "runs/digits/r/checkpoints"
    assert ctx.identity == str((tmp_path / "runs/digits/r").resolve())
    assert ctx.location == str(tmp_path / "runs/digits/r")
    assert ctx.remote_checkpoints() is None
    remote = RunContext("digits", "r", tmp_path / "stage", "sqlite:///x", None, None,
                        run_url="s3://u:pw@bucket/runs/digits/r")
    assert remote.identity == "s3://u:***@bucket/runs/digits/r" and remote.location == remote.run_url


def test_resume_takes_the_newest_checkpoint_that_verifies_and_says_so(tmp_path: Path, launch_env) -> None:
    ctx = _ctx(tmp_path)
    _checkpoint(ctx.checkpoint_dir / "step=00000010.ckpt", 10, "old")
    newest = _checkpoint(ctx.checkpoint_dir / "step=00000020.ckpt", 20, "mlrun1")
    assert resolve_resume(_cfg(), ctx) == (str(newest), "mlrun1")
    assert ctx.resume_note == f"Resuming from {newest} (step 20)."


def test_nothing_to_resume_is_a_new_start(tmp_path: Path, launch_env) -> None:
    ctx = _ctx(tmp_path)
    assert resolve_resume(_cfg(), ctx) == (None, None)
    assert ctx.resume_note is None


def test_checkpoints_none_of_which_verifies_stop_the_launch(tmp_path: Path, launch_env) -> None:
    ctx = _ctx(tmp_path)
    path = _checkpoint(ctx.checkpoint_dir / "step=00000010.ckpt", 10)
    path.write_bytes(path.read_bytes()[:-1])  # truncated: its record no longer matches
    with pytest.raises(UsageError) as refused:
        resolve_resume(_cfg(), ctx)
    assert str(refused.value) == (f"none of the 1 checkpoint(s) of {ctx.run_dir} verifies (see the warnings above); "
                                  "pass --ckpt_path to choose one, or --fresh true to set them aside.")


def test_fresh_moves_the_checkpoints_aside_and_starts_over(tmp_path: Path, launch_env) -> None:
    ctx = _ctx(tmp_path)
    _checkpoint(ctx.checkpoint_dir / "step=00000010.ckpt", 10)
    launch_env.setattr(time, "strftime", lambda fmt: "20261206-183000")
    assert resolve_resume(_cfg(fresh=True), ctx) == (None, None)
    assert not ctx.checkpoint_dir.exists()
    assert (ctx.run_dir / "checkpoints.before-20261206-183000/step=00000010.ckpt").exists()


def test_a_rank_started_by_the_launching_process_takes_its_decision(tmp_path: Path, launch_env) -> None:
    launch_env.setenv("LOCAL_RANK", "1")
    launch_env.setenv(ENV_RUN_NAME, "r")
    launch_env.setenv(ENV_CKPT_PATH, "/somewhere/step=00000007.ckpt")
    launch_env.setenv(ENV_MLFLOW_RUN_ID, "decided")
    assert resolve_resume(_cfg(fresh=True), _ctx(tmp_path)) == ("/somewhere/step=00000007.ckpt", "decided")
    launch_env.setenv(ENV_CKPT_PATH, "")
    launch_env.setenv(ENV_MLFLOW_RUN_ID, "")
    assert resolve_resume(_cfg(), _ctx(tmp_path)) == (None, None)


def test_an_explicit_checkpoint_is_verified_first(tmp_path: Path) -> None:
    good = _checkpoint(tmp_path / "a/step=00000005.ckpt", 5, "theirs")
    assert explicit_checkpoint(str(good), tmp_path / "ckpts") == (str(good), "theirs")
    bare = tmp_path / "bare.ckpt"  # no record: loads safely, no run named
    import torch

    torch.save({"w": torch.ones(1)}, bare)
    assert explicit_checkpoint(str(bare), tmp_path / "ckpts") == (str(bare), None)
    with pytest.raises(UsageError, match=r"^--ckpt_path /nowhere\.ckpt does not exist\.$"):
        explicit_checkpoint("/nowhere.ckpt", tmp_path)
    good.write_bytes(good.read_bytes() + b"x")
    with pytest.raises(UsageError) as refused:
        explicit_checkpoint(str(good), tmp_path)
    assert str(refused.value) == (f"--ckpt_path {good} does not match its integrity record (truncated, changed or "
                                  "unreadable; see the warning above); nothing was loaded.")


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path: Path) -> None:
    import pickle

    evil = tmp_path / "evil.ckpt"
    evil.write_bytes(pickle.dumps(SimpleNamespace(x=1)))
    with pytest.raises(UsageError, match=r"^--ckpt_path .*evil\.ckpt is not a checkpoint this run can load \("):
        explicit_checkpoint(str(evil), tmp_path)


# ------------------------------------------------------------------------------------ which MLflow run continues
def test_the_mlflow_run_continued_is_the_runs_own(tmp_path: Path, monkeypatch) -> None:
    ctx = _ctx(tmp_path)
    monkeypatch.setattr(tracking, "find_run", lambda client, experiment, location: "own")
    client = FakeClient({"own": _run(), "theirs": _run(run_name="other", experiment_id="1"),
                         "moved": _run(run_name="r", experiment_id="1")}, experiments={"digits": "1"})
    assert mlflow_run_of(client, ctx, "x.ckpt", None, explicit=False) == "own"
    assert mlflow_run_of(client, ctx, "x.ckpt", "own", explicit=False) == "own"
    assert mlflow_run_of(client, ctx, "x.ckpt", "moved", explicit=False) == "moved"  # same experiment and name
    assert mlflow_run_of(client, ctx, "x.ckpt", "theirs", explicit=True) == "own"  # another run's record: never


def test_a_run_tagged_with_this_runs_files_is_its_own_record(tmp_path: Path, monkeypatch) -> None:
    ctx = _ctx(tmp_path)
    monkeypatch.setattr(tracking, "find_run", lambda client, experiment, location: None)
    client = FakeClient({"tagged": _run(tags={tracking.RUN_DIR_TAG: ctx.identity}, run_name="renamed")})
    assert mlflow_run_of(client, ctx, "x.ckpt", "tagged", explicit=False) == "tagged"


def test_a_checkpoint_of_a_run_this_store_lacks_stops_an_implicit_resume(tmp_path: Path, monkeypatch) -> None:
    ctx = _ctx(tmp_path)
    monkeypatch.setattr(tracking, "find_run", lambda client, experiment, location: None)
    with pytest.raises(UsageError) as refused:
        mlflow_run_of(FakeClient({}), ctx, "c.ckpt", "gone", explicit=False)
    assert str(refused.value).startswith("run digits/r would resume from c.ckpt, written by MLflow run gone, which "
                                         "sqlite:///mlflow.db does not hold")
    assert mlflow_run_of(FakeClient({}), ctx, "c.ckpt", "gone", explicit=True) is None  # a new MLflow run
