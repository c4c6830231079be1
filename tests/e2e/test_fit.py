"""The default recipe end to end, as a user runs it: one device, DDP and FSDP on 2 CPU processes.

One full run per strategy, each the README's command (``digits_recipe_runs``, made once a session and
shared with tests/e2e/test_readme_commands.py: they are the slowest runs), then many assertions on
what each left behind: exit code, the single MLflow run, its params, metrics, artifacts and
model, the checkpoint, and accuracy parity between strategies.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
import yaml

from callbacks.storage import ckpt_store
from datamodules.digits import DigitsDataModule
from recipes.classifier import ImageClassifier
from tests.conftest import CONFIGS, DIGITS_STRATEGIES, FAST, client_for, runs_of

# The session fixture runs the slow part before the first test, each run under its own subprocess timeout;
# pytest-timeout times the test functions alone, so a slow machine does not fail the first test.
pytestmark = pytest.mark.timeout(600, func_only=True)

STRATEGIES = list(DIGITS_STRATEGIES)


@pytest.fixture(scope="module")
def fitted(digits_recipe_runs: dict[str, tuple[Path, object]]) -> dict[str, tuple[Path, object]]:
    """The digits recipe run once per strategy, each in its own folder (``--run_name`` = the strategy)."""
    return digits_recipe_runs


def _val_acc(workdir: Path) -> float:
    (run,) = runs_of(workdir, "digits")
    return run.data.metrics["val/acc"]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_exit_zero_and_one_finished_run(fitted: dict, strategy: str) -> None:
    workdir, result = fitted[strategy]
    assert result.returncode == 0, result.stderr[-4000:]
    runs = runs_of(workdir, "digits")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.info.run_name == strategy
    # the summary table names the run
    assert run.info.run_id in result.stdout


def test_single_device_reaches_target_accuracy(fitted: dict) -> None:
    workdir, _ = fitted["single"]
    (run,) = runs_of(workdir, "digits")
    assert run.data.metrics["val/acc"] >= 0.975
    assert run.data.metrics["baseline/linear_acc"] == pytest.approx(0.9667, abs=0.01)
    assert run.data.metrics["baseline/majority_acc"] == pytest.approx(0.1, abs=0.005)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_distributed_accuracy_within_one_point_of_single(fitted: dict, strategy: str) -> None:
    single = _val_acc(fitted["single"][0])
    assert abs(_val_acc(fitted[strategy][0]) - single) <= 0.01


def test_params_are_the_flattened_resolved_config(fitted: dict) -> None:
    workdir, _ = fitted["single"]
    (run,) = runs_of(workdir, "digits")
    params = run.data.params
    assert params["trainer.max_epochs"] == "20"
    assert params["model.init_args.optimizer.init_args.lr"] == "0.003"
    assert params["data.class_path"] == "datamodules.digits.DigitsDataModule"
    assert params["seed_everything"] == "42"
    assert params["experiment"] == "digits"


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_artifacts_config_manifest_and_model(fitted: dict, strategy: str) -> None:
    workdir, _ = fitted[strategy]
    (run,) = runs_of(workdir, "digits")
    client = client_for(workdir)
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "manifest.json"} <= names
    run_dir = workdir / "runs" / "digits" / strategy
    # drawn and logged after trainer.fit returned (issue 16), still in the run dir and in MLflow
    assert "time_breakdown.png" in names and (run_dir / "time_breakdown.png").is_file()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["world_size"] == (1 if strategy == "single" else 2)
    assert manifest["seed"] == 42
    assert manifest["data_fingerprint"] == DigitsDataModule().fingerprint()
    assert manifest["versions"]["torch"] == torch.__version__
    assert any(p.startswith("torch==") for p in manifest["packages"])
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["trainer"]["max_epochs"] == 20
    mlflow.set_tracking_uri(f"sqlite:///{workdir / 'mlflow.db'}")
    models = mlflow.search_logged_models(experiment_ids=[run.info.experiment_id], output_format="list")
    assert [m.source_run_id for m in models] == [run.info.run_id]


def _accuracy(model: torch.nn.Module) -> float:
    dm = DigitsDataModule()
    dm.setup("fit")
    correct = 0
    with torch.no_grad():
        for x, y in dm.val_dataloader():
            out = model(x)
            out = out if isinstance(out, torch.Tensor) else torch.as_tensor(np.asarray(out))
            correct += int((out.argmax(-1) == y).sum())
    return correct / len(dm.val_set)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_logged_model_reproduces_val_accuracy(fitted: dict, strategy: str) -> None:
    workdir, _ = fitted[strategy]
    (run,) = runs_of(workdir, "digits")
    mlflow.set_tracking_uri(f"sqlite:///{workdir / 'mlflow.db'}")
    (logged,) = mlflow.search_logged_models(experiment_ids=[run.info.experiment_id], output_format="list")
    model = mlflow.pyfunc.load_model(logged.model_uri).unwrap_python_model().network  # the served classifier's
    assert _accuracy(model) == pytest.approx(run.data.metrics["val/acc"], abs=1e-6)


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_best_checkpoint_loads(fitted: dict, strategy: str) -> None:
    workdir, _ = fitted[strategy]
    ckpt_dir = workdir / "runs" / "digits" / strategy / "checkpoints"
    best = ckpt_store.newest_good(ckpt_dir, "best-*")
    assert best is not None
    model = ImageClassifier.load_from_checkpoint(best.path, map_location="cpu", weights_only=False)
    (run,) = runs_of(workdir, "digits")
    history = client_for(workdir).get_metric_history(run.info.run_id, "val/acc")
    assert _accuracy(model.eval()) == pytest.approx(max(m.value for m in history), abs=1e-6)


def test_fsdp_checkpoint_is_a_sharded_directory_that_verifies(fitted: dict) -> None:
    workdir, _ = fitted["fsdp"]
    ckpt_dir = workdir / "runs" / "digits" / "fsdp" / "checkpoints"
    latest = ckpt_store.newest_good(ckpt_dir, "step=*")
    assert latest is not None and latest.path.is_dir()
    assert latest.global_step == 20 * 23  # 20 epochs of ceil(1437 / 2 / 32) batches per rank
    assert sorted(p.suffix for p in latest.path.glob("*.distcp")) == [".distcp", ".distcp"]
    # ModelCheckpoint's best directory is published too (callbacks/model_checkpoint.py), naming the run
    (best,) = [p for p in ckpt_store.candidates(ckpt_dir, "best-*")]
    record = ckpt_store.read_record(best)
    assert record is not None and record.path.is_dir() and record.size > 0
    assert record.global_step == 23 * (record.epoch + 1)  # saved at the end of a validated epoch
    assert record.extra["mlflow_run_id"] == latest.extra["mlflow_run_id"]


def test_objects_made_before_fit_are_frozen_for_its_duration_only(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI exempts its setup from garbage collection during ``fit`` (a full collection walking the import
    heap paused the digits fit ~0.4 s) and hands it back afterwards; cost is logged every 100 steps."""
    import gc

    from lightning.pytorch.callbacks import Callback

    from callbacks.cost import CostTracker
    from recipes.run.cli import AtscaleCLI
    from recipes.run.common import ENV_CKPT_PATH, ENV_MLFLOW_RUN_ID, ENV_RUN_NAME

    for key in (ENV_CKPT_PATH, ENV_MLFLOW_RUN_ID, ENV_RUN_NAME):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)

    class FreezeProbe(Callback):
        frozen: list[int] = []

        def on_train_batch_start(self, *args: object) -> None:
            self.frozen.append(gc.get_freeze_count())

    assert gc.get_freeze_count() == 0
    cli = AtscaleCLI(args=["--config", str(CONFIGS / "digits.yaml"), *FAST, "--trainer.max_steps", "3",
                           "--trainer.logger", "false", "--runs_root", str(tmp_path / "runs"), "--run_name", "gc"])
    (cost,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, CostTracker)]
    assert cost.log_every_n_steps == 100
    cli.trainer.callbacks.append(probe := FreezeProbe())
    assert cli.fit() == 0
    assert len(probe.frozen) == 3 and min(probe.frozen) > 10_000  # at least the imported modules' objects
    assert gc.get_freeze_count() == 0
