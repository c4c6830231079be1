"""The tracking contract: every metric and tag name is defined once, in ``callbacks/analysis/keys.py``.

Three checks. No module of ``recipes/`` or ``callbacks/`` writes a metric or tag name as a string literal (a key
typed again drifts from the one logged, and the reader's column stays empty without an error); the names keep the
values stored runs and the docs hold; and a real fit logs every key the tools read.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks.analysis import keys
from callbacks.baselines import fit_baselines
from callbacks.cost import CostTracker
from callbacks.timing import StepTiming
from tests.conftest import RecordingLogger

REPO = Path(__file__).resolve().parents[4]
#: What a metric or tag name looks like: a group of ours and a slash, or our tag namespace.
KEY = re.compile(r"^(time|cost|goodput|train|val|test|baseline|amdahl|comm|spot|scale|sweep)/|^atscale\.")

#: Literals not migrated yet, by file: each is a change its owner makes (import the name from keys.py), then
#: removes here. A literal not listed fails the test, in any file; so does a listed one that is gone.
PENDING: dict[str, set[str]] = {}
#: Strings that look like keys and are none.
NOT_KEYS: dict[str, set[str]] = {
    "callbacks/timing.py": {"time/step"},  # the end table's row label
    "callbacks/utils/notices.py": {"spot/instance-action at "},  # AWS's metadata path, in a message
    "recipes/soak/dataset.py": {"atscale.json"},  # a prepared dataset's description file, not a tag
    # optuna study attributes, not MLflow tags
    "recipes/sweep/study.py": {"atscale.mlflow_parent_run_id", "atscale.owner", "atscale.settings", "atscale.trials"},
}


def key_literals(path: Path) -> set[str]:
    """The string constants of ``path`` that look like keys (f-string parts included; docstrings left out)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings and KEY.match(node.value)}


def found_literals() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in sorted([*REPO.glob("recipes/**/*.py"), *REPO.glob("callbacks/**/*.py")]):
        rel = path.relative_to(REPO).as_posix()
        if rel != "callbacks/analysis/keys.py" and (literals := key_literals(path)):
            out[rel] = literals
    return out


def test_no_module_writes_a_key_as_a_literal() -> None:
    found = found_literals()
    new = {f: sorted(lits - PENDING.get(f, set()) - NOT_KEYS.get(f, set())) for f, lits in found.items()}
    new = {f: lits for f, lits in new.items() if lits}
    assert not new, ("metric or tag names written as literals: import them from callbacks/analysis/keys.py "
                     f"(add a name there if it is new): {new}")
    gone = {f: sorted(lits - found.get(f, set())) for f, lits in (PENDING | NOT_KEYS).items()}
    gone = {f: lits for f, lits in gone.items() if lits}
    assert not gone, f"no longer written as literals (remove them from PENDING/NOT_KEYS here): {gone}"


def test_the_check_sees_a_literal_in_a_call_a_dict_and_an_f_string(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text('"""val/acc in a docstring is prose."""\n'
                      'x = {"cost/usd": 1}\nlog("train/loss")\ny = f"goodput/{c}_s"\nz = "plain/text"\n')
    assert key_literals(module) == {"cost/usd", "train/loss", "goodput/"}


#: The stored values: runs recorded so far and the docs hold them, so a name may move but never change.
STORED = {
    "TRAIN_LOSS_KEY": "train/loss", "VAL_ACC_KEY": "val/acc", "VAL_LOSS_KEY": "val/loss", "VAL_BPB_KEY": "val/bpb",
    "VAL_COST_KEY": "val/expected_cost", "VAL_BAYES_COST_KEY": "val/bayes_expected_cost", "DEFAULT_METRIC": "val/acc",
    "STEP_WINDOW_KEY": "time/step_s", "STEP_KEY": "time/mean/step_s", "THROUGHPUT_KEY": "time/mean/samples_per_s",
    "CHECKPOINT_STALL_KEY": "time/checkpoint_s", "VALIDATION_TIME_KEY": "time/validation_s",
    "SERIAL_KEY": "amdahl/serial_fraction", "COST_KEY": "cost/usd", "COST_ON_DEMAND_KEY": "cost/usd_on_demand",
    "COST_SPOT_KEY": "cost/usd_spot", "SAVINGS_KEY": "cost/savings_pct", "LOST_WORK_KEY": "cost/lost_work_usd",
    "PROJECTED_COST_KEY": "cost/projected_usd", "BILLED_KEY": "cost/billed_s", "INSTANCES_KEY": "cost/instances",
    "LOST_STEPS_KEY": "cost/lost_steps", "RESTART_KEY": "cost/restart_s", "GOODPUT_SHARE_KEY": "goodput/share",
    "MAJORITY_BASELINE_KEY": "baseline/majority_acc", "LINEAR_BASELINE_KEY": "baseline/linear_acc",
    "MAJORITY_COST_BASELINE_KEY": "baseline/majority_expected_cost",
    "LINEAR_COST_BASELINE_KEY": "baseline/linear_expected_cost",
    "LINEAR_BAYES_COST_BASELINE_KEY": "baseline/linear_bayes_expected_cost",
    "INTERRUPTIONS_KEY": "spot/interruptions", "NOTICE_TO_SAVED_KEY": "spot/notice_to_saved_s",
    "SPOT_LOST_STEPS_KEY": "spot/lost_steps", "UPLOAD_KEY": "spot/upload_s",
    "SCALE_SERIAL_KEY": "scale/amdahl_serial_fraction", "SCALE_USL_KEYS": ("scale/usl_a", "scale/usl_b"),
    "KIND_TAG": "atscale.kind", "SWEEP_NAME_TAG": "atscale.sweep", "TRIAL_SWEEP_TAG": "sweep", "TRIAL_TAG": "trial",
    "PRUNED_TAG": "pruned", "BEST_LAW_TAG": "atscale.best_law",
    "COST_SEGMENTS_TAG": "atscale.cost_segments", "REPRODUCES_TAG": "reproduces",
    "REGISTERED_AS_TAG": "registered_as",
    "TRAIN_PREFIX": "train/", "VAL_PREFIX": "val/", "TEST_PREFIX": "test/", "TRAIN_DEVICE_PREFIX": "train/device/",
    "TRAIN_ACC_KEY": "train/acc", "TIME_PREFIX": "time/", "TIME_MEAN_PREFIX": "time/mean/", "COMM_PREFIX": "comm/",
    "COMM_MEAN_PREFIX": "comm/mean/", "AMDAHL_PREFIX": "amdahl/", "COST_PREFIX": "cost/", "GOODPUT_PREFIX": "goodput/",
    "BASELINE_PREFIX": "baseline/", "SPOT_PREFIX": "spot/", "SCALE_PREFIX": "scale/",
    "DATA_WAIT_KEY": "time/mean/data_s", "COMM_BYTES_KEY": "comm/mean/bytes_per_step",
    "COMM_MEASURED_KEY": "comm/mean/measured_s", "COMM_LATENCY_KEY": "comm/latency_us",
    "COMM_BANDWIDTH_KEY": "comm/bandwidth_gbps", "COMM_CALIBRATION_KEY": "comm/calibration_s",
    "COMM_CALIBRATION_R2_KEY": "comm/calibration_r2", "SAVE_INTERVAL_KEY": "spot/interval_s",
    "OPTIMAL_INTERVAL_KEY": "spot/optimal_interval_s", "SAVE_COST_KEY": "spot/save_cost_s",
    "EXPECTED_OVERHEAD_KEY": "spot/expected_overhead", "SCALE_THROUGHPUT_KEY": "scale/throughput",
    "SCALE_SPEEDUP_KEY": "scale/speedup", "SCALE_EFFICIENCY_KEY": "scale/efficiency",
    "SCALE_AMDAHL_R2_KEY": "scale/amdahl_r2", "SCALE_GUSTAFSON_KEY": "scale/gustafson_serial_fraction",
    "SCALE_USL_PEAK_KEY": "scale/usl_peak_n", "MODE_TAG": "atscale.mode", "PRUNED_AT_TAG": "pruned_at_epoch",
    "RUN_DIR_TAG": "atscale.run_dir", "ELASTIC_TAG": "atscale.elastic", "NOISE_SCALE_PREFIX": "noise_scale/",
    "B_NOISE_KEY": "noise_scale/b_simple", "NOISE_BATCH_USED_KEY": "noise_scale/batch_used",
    "CPU_THREADS_KEY": "cpu/threads", "SWEEP_PREFIX": "sweep/", "SWEEP_SPENT_KEY": "sweep/spent_usd",
    "SWEEP_SAVED_BY_PRUNING_KEY": "sweep/saved_by_pruning_usd", "SWEEP_BUDGET_KEY": "sweep/budget_usd",
    "SWEEP_BEST_VALUE_KEY": "sweep/best_value", "TRIAL_STATE_TAG": "sweep.state",
    "SWEEP_STOPPED_BY_TAG": "sweep.stopped_by", "SWEEP_BEST_TRIAL_TAG": "sweep.best_trial",
    "SWEEP_BEST_RUN_TAG": "sweep.best_run_id", "TOKENS_PER_SEC_KEY": "train/tokens_per_sec",
    "DEVICE_TOKENS_PER_SEC_KEY": "train/device/tokens_per_sec", "MFU_KEY": "train/device/mfu",
    "RECIPE_TAG": "atscale.recipe", "MODEL_TAG": "atscale.model", "DATA_TAG": "atscale.data",
    "STRATEGY_TAG": "atscale.strategy", "DEVICES_TAG": "atscale.devices", "PRECISION_TAG": "atscale.precision",
    "MARKET_TAG": "atscale.market", "GIT_SHA_TAG": "atscale.git_sha", "PARENT_RUN_TAG": "mlflow.parentRunId",
}


def test_the_names_keep_their_stored_values() -> None:
    assert {name: getattr(keys, name) for name in STORED} == STORED
    assert not [n for n in vars(keys) if n.isupper() and n not in STORED], "a new name: pin its value in STORED"
    assert keys.serial_key_at(2) == "amdahl/serial_fraction/world_2"
    assert keys.goodput_seconds_key("redone") == "goodput/redone_s"
    assert keys.goodput_usd_key("redone") == "goodput/redone_usd"
    assert keys.bpb_baseline_key("unigram") == "baseline/unigram_bpb"
    assert keys.predicted_speedup_key(8) == "amdahl/predicted_speedup_8"
    assert keys.scale_predicted_speedup_key(16) == "scale/predicted_speedup_16"
    assert keys.sweep_trials_key("pruned") == "sweep/trials_pruned"
    assert keys.sweep_importance_key("lr") == "sweep/importance/lr"


class _Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=4)


class _SaveAt(Callback):
    def on_train_batch_end(self, trainer: Trainer, *args: object) -> None:
        if trainer.global_step == 3:
            trainer.save_checkpoint(trainer.default_root_dir + "/step3.ckpt")


def test_a_fit_logs_every_key_the_tools_read(tmp_path: Path) -> None:
    """What ``plan --run``, ``scale``, ``compare``, ``promote`` and the sweep's report read, from a real fit."""
    logger = RecordingLogger()
    callbacks = [StepTiming(warmup_steps=1, plot=False), CostTracker(instance="cpu-local", plot=False), _SaveAt()]
    Trainer(default_root_dir=str(tmp_path), max_steps=6, accelerator="cpu", devices=1, logger=logger,
            callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            log_every_n_steps=2).fit(_Tiny())
    logged = {key for _, metrics in logger.calls for key in metrics}
    read = {keys.STEP_KEY, keys.STEP_WINDOW_KEY, keys.THROUGHPUT_KEY, keys.SERIAL_KEY, keys.serial_key_at(1),
            keys.CHECKPOINT_STALL_KEY, keys.COST_KEY, keys.PROJECTED_COST_KEY, keys.BILLED_KEY, keys.RESTART_KEY,
            keys.LOST_STEPS_KEY, keys.LOST_WORK_KEY, keys.GOODPUT_SHARE_KEY,
            *(keys.goodput_seconds_key(c) for c in ("productive", "checkpoint", "redone", "restart"))}
    assert read <= logged, sorted(read - logged)

    x = np.random.default_rng(0).normal(size=(40, 3))
    y = np.arange(40) % 2
    baselines = fit_baselines(x[:30], y[:30], x[30:], y[30:], cost_matrix=np.array([[0.0, 1.0], [5.0, 0.0]]))
    assert {keys.LINEAR_BASELINE_KEY, keys.MAJORITY_BASELINE_KEY, keys.LINEAR_COST_BASELINE_KEY,
            keys.MAJORITY_COST_BASELINE_KEY, keys.LINEAR_BAYES_COST_BASELINE_KEY} == set(baselines)


#: Callbacks that write their own group's names as literals (groups ``KEY`` leaves out: three of these work copied
#: alone, importing nothing of ours), by group.
OWN_GROUPS = {"cpu/": "callbacks/cpu_threads.py", "elastic/": "callbacks/elastic.py", "lr/": "callbacks/lr_scaling.py",
              "noise_scale/": "callbacks/noise_scale.py"}


def string_constants(path: Path) -> set[str]:
    """Every string constant of ``path``, f-string parts included."""
    return {node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_callbacks_that_own_a_group_write_the_names_readers_take_from_keys() -> None:
    """A name keys.py gives readers in such a group is a literal its callback writes: a renamed literal fails."""
    for prefix, rel in OWN_GROUPS.items():
        read = {value for value in vars(keys).values() if isinstance(value, str) and value.startswith(prefix)
                and value != prefix}
        written = {value for value in string_constants(REPO / rel) if value.startswith(prefix)}
        assert read <= written, f"{rel} no longer writes {sorted(read - written)}, which readers ask for"
    # the names readers take today, so the check above is not empty
    assert {keys.CPU_THREADS_KEY, keys.B_NOISE_KEY, keys.NOISE_BATCH_USED_KEY} <= set().union(
        *(string_constants(REPO / rel) for rel in OWN_GROUPS.values()))
