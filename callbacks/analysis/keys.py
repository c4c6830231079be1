"""The names of the metrics and tags a run is recorded under: each defined here once, imported by the code that
logs it and by every tool that reads it.

The tracking store's contract is these strings: a key logged as one literal and read as another is a column that
stays empty, a run that is never found, without an error anywhere. So no module writes one as a literal; a test
(``tests/unit/callbacks/analysis/test_keys.py``) fails when one does, and checks that each writer logs the keys
its readers ask for.

Why here, not beside each callback: the readers (``recipes.compare``, ``promote``, ``plan``, ``scale``, the
sweep's report, the soak's observer) import no torch and no Lightning, so that they start fast and run where no
training stack is installed, and a callback's own module imports both. ``callbacks/analysis/`` is the torch-free
layer both sides already import, and it imports nothing of ours, so its own modules (the goodput ledger) can take
their names from here too. This module imports nothing at all.

The values are stored in every run recorded so far and written in the docs: never change one; add a new name.
"""

from __future__ import annotations

# ----------------------------------------------------------------------------------------- the task's metrics
# Logged by the LightningModules (recipes/classifier.py, recipes/gpt.py) with ``self.log``.
#: Prefix of the validation metrics.
VAL_PREFIX = "val/"
#: Prefix of the training metrics (logged every step: :mod:`recipes.run.tracking` counts its lost points).
TRAIN_PREFIX = "train/"
#: Prefix of the test metrics.
TEST_PREFIX = "test/"
#: Prefix of the per-device training figures of TokenThroughput (callbacks/throughput.py).
TRAIN_DEVICE_PREFIX = f"{TRAIN_PREFIX}device/"
#: TokenThroughput's tokens per second, all devices (Lightning's ``items_per_sec``, renamed).
TOKENS_PER_SEC_KEY = f"{TRAIN_PREFIX}tokens_per_sec"
#: The same per device.
DEVICE_TOKENS_PER_SEC_KEY = f"{TRAIN_DEVICE_PREFIX}tokens_per_sec"
#: Model FLOPs utilisation per device (logged where the device's peak FLOP/s is known).
MFU_KEY = f"{TRAIN_DEVICE_PREFIX}mfu"
#: The training loss of each step.
TRAIN_LOSS_KEY = f"{TRAIN_PREFIX}loss"
#: A classifier's training accuracy.
TRAIN_ACC_KEY = f"{TRAIN_PREFIX}acc"
#: A classifier's validation accuracy: the metric ``compare``, ``promote`` and ``sweep`` rank by unless told.
VAL_ACC_KEY = f"{VAL_PREFIX}acc"
#: The validation loss.
VAL_LOSS_KEY = f"{VAL_PREFIX}loss"
#: The language model's validation bits per byte.
VAL_BPB_KEY = f"{VAL_PREFIX}bpb"
#: A classifier's mean misclassification cost of its argmax decisions (with a cost matrix).
VAL_COST_KEY = f"{VAL_PREFIX}expected_cost"
#: The same for its Bayes decisions (least expected cost).
VAL_BAYES_COST_KEY = f"{VAL_PREFIX}bayes_expected_cost"
#: The default metric of the tools that rank runs.
DEFAULT_METRIC = VAL_ACC_KEY

# --------------------------------------------------------------------------- StepTiming (callbacks/timing.py)
#: Prefix of a logging window's per-step means (``time/<part>_s``, ``time/step_s``, ...).
TIME_PREFIX = "time/"
#: Prefix of the whole run's means, logged at train end (``time/mean/<part>_s``, ...).
TIME_MEAN_PREFIX = f"{TIME_PREFIX}mean/"
#: Prefix of a window's communication figures.
COMM_PREFIX = "comm/"
#: Prefix of the whole run's communication means, at train end.
COMM_MEAN_PREFIX = f"{COMM_PREFIX}mean/"
#: Seconds per optimizer step, a window's mean.
STEP_WINDOW_KEY = f"{TIME_PREFIX}step_s"
#: Seconds per optimizer step, the run's mean.
STEP_KEY = f"{TIME_MEAN_PREFIX}step_s"
#: Global samples per second, the run's mean.
THROUGHPUT_KEY = f"{TIME_MEAN_PREFIX}samples_per_s"
#: Seconds per step waiting for data, the run's mean.
DATA_WAIT_KEY = f"{TIME_MEAN_PREFIX}data_s"
#: Bytes all-reduced per step (as sent), the run's mean.
COMM_BYTES_KEY = f"{COMM_MEAN_PREFIX}bytes_per_step"
#: Seconds per step of measured communication, the run's mean.
COMM_MEASURED_KEY = f"{COMM_MEAN_PREFIX}measured_s"
#: The calibrated link's latency in microseconds, once (CommTimer, callbacks/utils/comm_timer.py).
COMM_LATENCY_KEY = f"{COMM_PREFIX}latency_us"
#: The calibrated link's bandwidth in Gbit/s, once (not logged when the fit gives none).
COMM_BANDWIDTH_KEY = f"{COMM_PREFIX}bandwidth_gbps"
#: Seconds the link calibration took.
COMM_CALIBRATION_KEY = f"{COMM_PREFIX}calibration_s"
#: R^2 of the calibration's linear fit.
COMM_CALIBRATION_R2_KEY = f"{COMM_PREFIX}calibration_r2"
#: The loop's stall for the checkpoints of one step (a point per step that saved).
CHECKPOINT_STALL_KEY = f"{TIME_PREFIX}checkpoint_s"
#: One validation run (a point per validation).
VALIDATION_TIME_KEY = f"{TIME_PREFIX}validation_s"
#: Prefix of the Amdahl figures.
AMDAHL_PREFIX = "amdahl/"
#: Amdahl's serial fraction of the whole run, at train end.
SERIAL_KEY = f"{AMDAHL_PREFIX}serial_fraction"


def serial_key_at(world_size: int) -> str:
    """:data:`SERIAL_KEY` as measured on ``world_size`` devices (kept per size across elastic resumes)."""
    return f"{SERIAL_KEY}/world_{world_size}"


def predicted_speedup_key(devices: int) -> str:
    """Amdahl's predicted speedup on ``devices`` devices, at train end."""
    return f"{AMDAHL_PREFIX}predicted_speedup_{devices}"


# ----------------------------------------------------------------- GradientNoiseScale (callbacks/noise_scale.py)
#: Prefix of the gradient noise scale's figures.
NOISE_SCALE_PREFIX = "noise_scale/"
#: The simple noise scale B_simple in examples (what ``plan --batch`` reads).
B_NOISE_KEY = f"{NOISE_SCALE_PREFIX}b_simple"
#: The global batch per optimizer step the estimate saw.
NOISE_BATCH_USED_KEY = f"{NOISE_SCALE_PREFIX}batch_used"

# ---------------------------------------------------------------------------- CostTracker (callbacks/cost.py)
#: Prefix of the bill's figures.
COST_PREFIX = "cost/"
#: Dollars the run cost so far, on its market.
COST_KEY = f"{COST_PREFIX}usd"
#: The same billed time at the on-demand price.
COST_ON_DEMAND_KEY = f"{COST_PREFIX}usd_on_demand"
#: The same billed time at the spot price.
COST_SPOT_KEY = f"{COST_PREFIX}usd_spot"
#: Percent spot saves over on-demand.
SAVINGS_KEY = f"{COST_PREFIX}savings_pct"
#: Dollars of the work redone after interruptions.
LOST_WORK_KEY = f"{COST_PREFIX}lost_work_usd"
#: The projected cost at the end, at the current progress and speed.
PROJECTED_COST_KEY = f"{COST_PREFIX}projected_usd"
#: Job wall seconds billed so far (per instance).
BILLED_KEY = f"{COST_PREFIX}billed_s"
#: Instances billed now.
INSTANCES_KEY = f"{COST_PREFIX}instances"
#: Optimizer steps run more than once.
LOST_STEPS_KEY = f"{COST_PREFIX}lost_steps"
#: Seconds of restart gaps billed (a point per resume).
RESTART_KEY = f"{COST_PREFIX}restart_s"
#: Prefix of the goodput ledger's figures (logged by CostTracker, built by :mod:`callbacks.analysis.goodput`).
GOODPUT_PREFIX = "goodput/"
#: Productive seconds / billed seconds.
GOODPUT_SHARE_KEY = f"{GOODPUT_PREFIX}share"


def goodput_seconds_key(category: str) -> str:
    """The billed seconds of one goodput category (``productive``, ``checkpoint``, ``redone``, ...)."""
    return f"{GOODPUT_PREFIX}{category}_s"


def goodput_usd_key(category: str) -> str:
    """The dollars of one goodput category, on the run's market."""
    return f"{GOODPUT_PREFIX}{category}_usd"


# -------------------------------------------- FixedCpuThreads, AdaptiveCpuThreads (callbacks/cpu_threads.py)
#: The intra-op thread count each process trains with.
CPU_THREADS_KEY = "cpu/threads"

# -------------------------------------------------------- Baselines, LMBaselines (callbacks/{,lm_}baselines.py)
#: Prefix of the baselines' figures.
BASELINE_PREFIX = "baseline/"
#: Validation accuracy of always predicting the most common class.
MAJORITY_BASELINE_KEY = f"{BASELINE_PREFIX}majority_acc"
#: Validation accuracy of a logistic regression (what ``promote``'s candidate must beat by default).
LINEAR_BASELINE_KEY = f"{BASELINE_PREFIX}linear_acc"
#: Mean cost of always predicting the most common class (with a cost matrix).
MAJORITY_COST_BASELINE_KEY = f"{BASELINE_PREFIX}majority_expected_cost"
#: Mean cost of the logistic regression's argmax decisions.
LINEAR_COST_BASELINE_KEY = f"{BASELINE_PREFIX}linear_expected_cost"
#: Mean cost of the logistic regression's Bayes decisions.
LINEAR_BAYES_COST_BASELINE_KEY = f"{BASELINE_PREFIX}linear_bayes_expected_cost"


def bpb_baseline_key(name: str) -> str:
    """A language-model baseline's validation bits per byte (``unigram`` -> ``baseline/unigram_bpb``)."""
    return f"{BASELINE_PREFIX}{name}_bpb"


# -------------------------------------------------------------------- SpotCheckpoint (callbacks/spot.py)
#: Prefix of the interruption events (a launch's own: always logged, never deduplicated on resume).
SPOT_PREFIX = "spot/"
#: Interruptions seen by this launch.
INTERRUPTIONS_KEY = f"{SPOT_PREFIX}interruptions"
#: Seconds from the notice to the checkpoint saved.
NOTICE_TO_SAVED_KEY = f"{SPOT_PREFIX}notice_to_saved_s"
#: Steps redone after the last interruption.
SPOT_LOST_STEPS_KEY = f"{SPOT_PREFIX}lost_steps"
#: Seconds the checkpoint's upload to object storage took.
UPLOAD_KEY = f"{SPOT_PREFIX}upload_s"
#: Seconds between saves in use, once it is chosen (SaveSchedule, callbacks/utils/save_schedule.py).
SAVE_INTERVAL_KEY = f"{SPOT_PREFIX}interval_s"
#: Daly's optimal seconds between saves, for the measured save cost and the interruption rate.
OPTIMAL_INTERVAL_KEY = f"{SPOT_PREFIX}optimal_interval_s"
#: Seconds one save stalls the loop, as measured.
SAVE_COST_KEY = f"{SPOT_PREFIX}save_cost_s"
#: The expected share of time lost to saves and redone work at the interval in use.
EXPECTED_OVERHEAD_KEY = f"{SPOT_PREFIX}expected_overhead"

# ------------------------------------------------------------- recipes.scale's parent run (recipes/scale/)
#: Prefix of the scale sweep's figures.
SCALE_PREFIX = "scale/"
#: Throughput at each device count (a point per count, its step the count).
SCALE_THROUGHPUT_KEY = f"{SCALE_PREFIX}throughput"
#: Speedup over the smallest count, per count.
SCALE_SPEEDUP_KEY = f"{SCALE_PREFIX}speedup"
#: Parallel efficiency (speedup / devices), per count.
SCALE_EFFICIENCY_KEY = f"{SCALE_PREFIX}efficiency"
#: The sweep's Amdahl fit.
SCALE_SERIAL_KEY = f"{SCALE_PREFIX}amdahl_serial_fraction"
#: R^2 of the Amdahl fit.
SCALE_AMDAHL_R2_KEY = f"{SCALE_PREFIX}amdahl_r2"
#: The sweep's Gustafson fit.
SCALE_GUSTAFSON_KEY = f"{SCALE_PREFIX}gustafson_serial_fraction"
#: The sweep's USL fit (a, b).
SCALE_USL_KEYS = (f"{SCALE_PREFIX}usl_a", f"{SCALE_PREFIX}usl_b")
#: The device count at which the USL fit's throughput peaks.
SCALE_USL_PEAK_KEY = f"{SCALE_PREFIX}usl_peak_n"


def scale_predicted_speedup_key(devices: int) -> str:
    """The better law's predicted speedup at a held-out device count ``devices``."""
    return f"{SCALE_PREFIX}predicted_speedup_{devices}"


# ----------------------------------------------------------- recipes.sweep's parent run (recipes/sweep/runner.py)
#: Prefix of the sweep's figures, logged on its parent run at the end.
SWEEP_PREFIX = "sweep/"
#: Dollars the trials cost.
SWEEP_SPENT_KEY = f"{SWEEP_PREFIX}spent_usd"
#: Dollars pruning saved (the pruned trials' projected rest).
SWEEP_SAVED_BY_PRUNING_KEY = f"{SWEEP_PREFIX}saved_by_pruning_usd"
#: The ``--budget-usd`` given (absent without one).
SWEEP_BUDGET_KEY = f"{SWEEP_PREFIX}budget_usd"
#: The best trial's value of the sweep's metric.
SWEEP_BEST_VALUE_KEY = f"{SWEEP_PREFIX}best_value"


def sweep_trials_key(state: str) -> str:
    """How many trials ended in ``state`` (optuna's TrialState, lower case: ``complete``, ``pruned``, ...)."""
    return f"{SWEEP_PREFIX}trials_{state}"


def sweep_importance_key(param: str) -> str:
    """A hyperparameter's importance to the sweep's metric (optuna's fANOVA)."""
    return f"{SWEEP_PREFIX}importance/{param}"


# ------------------------------------------------------------------------------------------------------ tags
#: MLflow's own tag of a nested run: its parent run's id (a sweep's trials, a scale sweep's runs).
PARENT_RUN_TAG = "mlflow.parentRunId"
#: What a run stands for when it is no plain training run: ``scale``, ``scale-fit`` (recipes.scale), ``sweep``
#: (recipes.sweep's parent).
KIND_TAG = "atscale.kind"
#: A recipes.scale parent's scaling mode (``strong`` or ``weak``: its ``--mode``).
MODE_TAG = "atscale.mode"
#: A sweep parent's sweep name.
SWEEP_NAME_TAG = "atscale.sweep"
#: A sweep trial's sweep name.
TRIAL_SWEEP_TAG = "sweep"
#: A sweep trial's number.
TRIAL_TAG = "trial"
#: A sweep trial's end state, as optuna names it (``COMPLETE``, ``PRUNED``, ``FAIL``).
TRIAL_STATE_TAG = "sweep.state"
#: Why a sweep parent stopped: ``finished``, ``stopped`` or ``budget``.
SWEEP_STOPPED_BY_TAG = "sweep.stopped_by"
#: A sweep parent's best trial number.
SWEEP_BEST_TRIAL_TAG = "sweep.best_trial"
#: A sweep parent's best trial's run id.
SWEEP_BEST_RUN_TAG = "sweep.best_run_id"
#: ``"true"`` on a trial the sweep pruned (absent otherwise).
PRUNED_TAG = "pruned"
#: The epoch after which the sweep pruned the trial.
PRUNED_AT_TAG = "pruned_at_epoch"
#: A recipes.scale parent's better-fitting law (``amdahl`` or ``usl``).
BEST_LAW_TAG = "atscale.best_law"
#: Set by CostTracker when a run's launches ran on more than one instance, market or count: JSON, a list of
#: ``{"instance", "market", "instances", "billed_s", "usd"}`` in launch order (each at its own rate).
COST_SEGMENTS_TAG = "atscale.cost_segments"
#: Set by ``recipes.reproduce`` on a rerun: the id of the run it reproduces.
REPRODUCES_TAG = "reproduces"
#: The search tags of every training run (recipes/run/context.py): its config files, LightningModule and
#: datamodule classes, strategy, ``<devices> x <nodes>``, precision, market and the repository's commit.
RECIPE_TAG = "atscale.recipe"
MODEL_TAG = "atscale.model"
DATA_TAG = "atscale.data"
STRATEGY_TAG = "atscale.strategy"
DEVICES_TAG = "atscale.devices"
PRECISION_TAG = "atscale.precision"
MARKET_TAG = "atscale.market"
GIT_SHA_TAG = "atscale.git_sha"
#: Where the run's files live (``recipes.run.tracking`` sets it; ``find_run`` reads it).
RUN_DIR_TAG = "atscale.run_dir"
#: A run resumed on another world size: ``"2->1@12"`` (saved ranks -> ranks, at step), ``; ``-joined.
ELASTIC_TAG = "atscale.elastic"
#: Set by ``recipes.promote`` on the run it registered: ``<model>/<version>@<alias>``.
REGISTERED_AS_TAG = "registered_as"
