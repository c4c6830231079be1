"""One test per private coupling in ``recipes/run/compat.py``: each fails, naming it, when an upgrade breaks it."""

from __future__ import annotations

import inspect
from pathlib import Path

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
