"""One test per private coupling in ``recipes/run/compat.py``: each fails, naming it, when an upgrade breaks it."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from recipes.run import compat


def test_system_metrics_monitor_is_mlflows_sampler() -> None:
    monitor = compat.system_metrics_monitor("0" * 32, sampling_interval=10, samples_before_logging=1,
                                            resume_logging=True)
    assert monitor is not None and type(monitor).__name__ == "SystemMetricsMonitor", \
        "compat.system_metrics_monitor: mlflow.system_metrics.system_metrics_monitor moved"
    assert callable(monitor.start) and callable(monitor.finish)


def test_the_private_methods_the_recipes_override_keep_their_signatures() -> None:
    from lightning.pytorch.cli import LightningCLI

    assert list(inspect.signature(LightningCLI._instantiate_trainer).parameters) == ["self", "config", "callbacks"], \
        "recipes/run/cli.py overrides LightningCLI._instantiate_trainer(config, callbacks): its signature changed"


def test_mlflow_schema_head_is_the_revision_a_client_leaves_a_new_store_at(tmp_path: Path) -> None:
    import mlflow

    from recipes.soak.observe import Store

    store = Store(tmp_path / "mlflow.db")
    assert store.client() is None and not store.db.exists(), "the observer must not create the store"
    mlflow.MlflowClient(store.uri).search_experiments()  # creates and migrates it, as a launch does
    head = compat.mlflow_schema_head()
    assert isinstance(head, str) and store.schema()["version"] == head, \
        "compat.mlflow_schema_head: mlflow.store.db.utils._get_latest_schema_revision moved or changed"
    assert store.client() is not None


def test_model_checkpoint_state_keeps_its_path_keys(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    state = ModelCheckpoint(dirpath=str(tmp_path), monitor="val/acc", save_top_k=2).state_dict()
    missing = [k for k in (*compat.MODEL_CHECKPOINT_PATH_KEYS, compat.MODEL_CHECKPOINT_BEST_K_KEY) if k not in state]
    assert not missing, f"compat.MODEL_CHECKPOINT_PATH_KEYS: ModelCheckpoint.state_dict() no longer has {missing}"
    assert state["dirpath"] == str(tmp_path) and isinstance(state[compat.MODEL_CHECKPOINT_BEST_K_KEY], dict)


def test_help_formatter_says_an_options_default_only_when_it_says_something() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="tool", formatter_class=compat.HelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="steps")
    for name, default in (("--name", None), ("--json", False), ("--ignore", [])):
        parser.add_argument(name, default=default, help=name.strip("-"))
    text = " ".join(parser.format_help().split())
    assert "steps (default: 30)" in text, \
        "compat.HelpFormatter: argparse.HelpFormatter._get_help_string no longer adds the default"
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: [])" not in text, \
        "compat.HelpFormatter: argparse no longer asks HelpFormatter._get_help_string for an option's help"


def test_async_write_state_reads_mlflows_run_operations(tmp_path: Path) -> None:
    from concurrent.futures import Future

    from mlflow.utils.async_logging.run_operations import RunOperations

    pending, done, failed = Future(), Future(), Future()
    done.set_result(None)
    failed.set_exception(RuntimeError("database or disk is full"))
    assert compat.async_write_state(RunOperations([done, pending])) == (False, None)
    assert compat.async_write_state(RunOperations([done])) == (True, None)
    finished, error = compat.async_write_state(RunOperations([done, failed]))
    assert finished and isinstance(error, RuntimeError), \
        "compat.async_write_state: mlflow's RunOperations no longer keeps its futures in _operation_futures"


class Data:
    """A class a jsonargparse key names by its class_path (the data module of a config)."""

    def __init__(self, batch_size: int = 1) -> None:
        self.batch_size = batch_size


def _jsonargparse_error(argv: list[str]) -> str:
    from jsonargparse import ArgumentError, ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--trainer.max_epochs", type=int | None)  # a Union with None, as Lightning's signatures
    parser.add_argument("--data", type=Data | None)
    try:
        parser.parse_args(argv)
    except ArgumentError as err:
        return str(err)
    raise AssertionError(f"jsonargparse took {argv}")


def test_jsonargparse_error_line_reads_jsonargparses_words() -> None:
    data = f"{Data.__module__}.Data"
    for argv, line in ((["--trainer.max_epochs", "many"], "trainer.max_epochs: expected int, got 'many'"),
                       (["--data", data, "--data.batch_size", "x"],
                        "data.init_args.batch_size: expected int, got 'x'")):
        message = _jsonargparse_error(argv)
        assert compat.jsonargparse_error_line(message) == line, \
            f"compat.jsonargparse_error_line: jsonargparse's words changed:\n{message}"


_PEER = '''
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=60))
dist.all_reduce(torch.ones(4))
if rank == 1:
    os._exit(9)  # the peer is gone
time.sleep(0.5)
try:
    dist.all_reduce(torch.ones(4))
except Exception as err:
    print(type(err).__module__ + "." + type(err).__qualname__)
    print(err)
os._exit(0)
'''


@pytest.mark.e2e
def test_a_lost_gloo_peer_is_a_plain_runtime_error_in_gloos_words(tmp_path: Path) -> None:
    """Two real gloo ranks, one ends: the other's collective fails as ``gloo_lost_peer`` reads it. When torch raises a
    type for it (``DistNetworkError``), this fails: tell the lost peer by the type then."""
    import subprocess
    import sys

    from tests.conftest import free_port

    script = tmp_path / "peer.py"
    script.write_text(_PEER)
    port = str(free_port())
    gone = subprocess.Popen([sys.executable, str(script), "1", port])
    survivor = subprocess.run([sys.executable, str(script), "0", port], capture_output=True, text=True, timeout=120)
    gone.wait(timeout=60)
    kind, _, message = survivor.stdout.partition("\n")
    assert kind == "builtins.RuntimeError", \
        f"compat.gloo_lost_peer: torch now raises gloo's lost peer as {kind}: tell it by that type\n{survivor.stderr}"
    found = compat.gloo_lost_peer(RuntimeError(message))
    assert found is not None and found.startswith("Connection closed by peer at 127.0.0.1:"), \
        f"compat.gloo_lost_peer: gloo's words changed: {message!r}"


def test_the_cpython_exit_hooks_shutdown_calls_are_there() -> None:
    import atexit
    import threading

    for name, hook in (("threading._shutdown", getattr(threading, "_shutdown", None)),
                       ("atexit._run_exitfuncs", getattr(atexit, "_run_exitfuncs", None))):
        assert callable(hook), f"recipes/run/shutdown.py calls {name}(): it is gone"
    assert not inspect.signature(threading._shutdown).parameters, \
        "recipes/run/shutdown.py calls threading._shutdown() with no arguments: it takes some now"


def test_mlflow_tracking_client_logger_is_the_one_that_module_logs_to() -> None:
    import importlib
    import logging

    module = importlib.import_module(compat.MLFLOW_TRACKING_CLIENT_LOGGER)
    loggers = [v for v in vars(module).values() if isinstance(v, logging.Logger)]
    assert [lg.name for lg in loggers] == [compat.MLFLOW_TRACKING_CLIENT_LOGGER], \
        "compat.MLFLOW_TRACKING_CLIENT_LOGGER: MLflow's tracking client moved or logs elsewhere"


@pytest.mark.parametrize("kwargs", [
    {},  # Lightning's defaults (MLflow refuses a client on the file store: a database store is given)
    {"experiment_name": "e", "run_name": "r", "tags": {"k": "v"}, "log_model": True, "prefix": "p",
     "artifact_location": "s3://b/a", "run_id": "0" * 32, "synchronous": False},
])
def test_an_mlflow_logger_without_client_holds_what_lightnings_init_sets(tmp_path: Path, kwargs: dict) -> None:
    from lightning.pytorch.loggers import MLFlowLogger

    kwargs = {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", **kwargs}
    lightnings = MLFlowLogger(**kwargs)
    ours = MLFlowLogger.__new__(MLFlowLogger)
    compat.init_mlflow_logger_without_client(ours, **kwargs)
    assert list(inspect.signature(MLFlowLogger.__init__).parameters)[1:] == \
        list(inspect.signature(compat.init_mlflow_logger_without_client).parameters)[1:], \
        "compat.init_mlflow_logger_without_client: MLFlowLogger.__init__'s arguments changed"
    expected = {k: v for k, v in vars(lightnings).items() if k != "_mlflow_client"}
    assert {k: v for k, v in vars(ours).items() if k != "_mlflow_client"} == expected, \
        "compat.init_mlflow_logger_without_client: MLFlowLogger.__init__ sets other attributes now"
    assert ours._mlflow_client is None and ours.save_dir == lightnings.save_dir


def test_set_model_parallel_sizes_sets_what_model_parallel_strategy_resolves() -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(data_parallel_size="auto", tensor_parallel_size=1)
    before = dict(vars(strategy))
    compat.set_model_parallel_sizes(strategy, 4, 1)
    changed = {k: v for k, v in vars(strategy).items() if before.get(k) != v}
    assert changed == {"_data_parallel_size": 4}, \
        "compat.set_model_parallel_sizes: ModelParallelStrategy keeps its sizes elsewhere now"
    source = inspect.getsource(ModelParallelStrategy.setup_environment)
    assert "self._data_parallel_size" in source and "self._tensor_parallel_size" in source, \
        "compat.set_model_parallel_sizes: ModelParallelStrategy.setup_environment no longer reads them"


def test_stale_heartbeat_trial_ids_finds_silent_running_trials_without_failing_them(tmp_path: Path) -> None:
    import time
    import warnings

    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'study.db'}", heartbeat_interval=60,
                                             grace_period=1)
    study = optuna.create_study(storage=storage, study_name="s")
    silent, alive = study.ask(), study.ask()
    storage.record_heartbeat(silent._trial_id)
    time.sleep(2.2)
    storage.record_heartbeat(alive._trial_id)
    study_id = storage.get_study_id_from_name("s")
    assert compat.stale_heartbeat_trial_ids(storage, study_id) == {silent._trial_id}, \
        "compat.stale_heartbeat_trial_ids: Optuna's RDBStorage._get_stale_trial_ids changed"
    assert storage.get_trial(silent._trial_id).state == optuna.trial.TrialState.RUNNING  # found, not failed
