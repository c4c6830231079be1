"""The batch-size planner's training: the step-time sweep (``--sweep``) and the validation (``--validate``).

``--validate`` runs (1) the short step-time sweep at each batch, (2) a reference run at ``--ref-batch`` to
the target with ``GradientNoiseScale`` (two micro-batches of half the batch per step, so one process sees
two batch sizes: the same optimization), which gives ``B_noise`` and ``S_ref``, then (3) a run to the
target at every other batch, validating every ``--val-every-examples`` examples and stopping at the target
(Lightning's ``EarlyStopping(stopping_threshold=...)``). Measured steps are the first validation at or
past the target; measured time is those steps x the run's own mean step time (StepTiming's
``time/mean/step_s``: data, forward, backward, optimizer; validation and checkpoints excluded, as in the
prediction). Runs go to the experiment ``<recipe experiment>-batch`` so ``recipes.compare``/``promote``
do not weigh them against the recipe's own runs.

Every run is a ``python -m recipes.fit`` subprocess, so this module (and the planner) imports neither torch
nor Lightning. The predicted-vs-measured table is printed by :mod:`recipes.plan.batch_report`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from callbacks.analysis.batch_size import fit_step_time, s_min_from_reference, steps_to_target
from callbacks.analysis.keys import B_NOISE_KEY, STEP_KEY
from recipes.plan.batch_runs import Reference, measured_steps_to, read_run
from recipes.run.common import UsageError, all_runs, find_run, quoted, tracking_uri

if TYPE_CHECKING:
    from mlflow import MlflowClient

__all__ = ["ValidationRow", "sweep_step_times", "validate"]


def _experiment(config: str) -> str:
    import yaml

    try:
        data = yaml.safe_load(Path(config).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise UsageError(f"--sweep/--validate: cannot read config {config!r}: {err}") from None
    return f"{data.get('experiment', 'default')}-batch"


def _fit(config: str, run_name: str, experiment: str, args: list[str], log: Path) -> None:
    """One ``python -m recipes.fit`` run in a subprocess (output to ``log``); raises on failure."""
    cmd = [sys.executable, "-m", "recipes.fit", "--config", config, "--experiment", experiment,
           "--run_name", run_name, *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, check=False).returncode
    if rc != 0:
        raise RuntimeError(f"training run {run_name} failed (exit {rc}); its output is in {log}")


def _run_id(client: MlflowClient, experiment: str, run_name: str) -> str:
    """The id of the newest run named ``run_name``: the one just trained."""
    exp = client.get_experiment_by_name(experiment)
    run = None if exp is None else find_run(client, [exp.experiment_id], run_name)
    if run is None:
        raise RuntimeError(f"training run {run_name} left no MLflow run in experiment {experiment!r}.")
    return run.info.run_id


def sweep_step_times(config: str, batches: Sequence[int], steps: int, stamp: str, log_dir: Path,
                     extra: Sequence[str] = ()) -> tuple[list[int], list[float], list[str]]:
    """Short runs (``steps`` steps) at each per-device batch: their ``time/mean/step_s`` and run ids."""
    client, uri = _client_for_training()
    experiment = _experiment(config)
    times, ids = [], []
    for b in batches:
        name = f"sweep-b{b}-{stamp}"
        print(f"sweep: batch {b}, {steps} steps ...", flush=True)
        _fit(config, name, experiment, [f"--data.init_args.batch_size={b}", f"--trainer.max_steps={steps}",
                                        "--trainer.limit_val_batches=0", *extra], log_dir / f"{name}.log")
        ref = read_run(client, _run_id(client, experiment, name), uri, None)
        if not ref.step_s:
            raise RuntimeError(f"sweep run {name} logged no {STEP_KEY}: run more --sweep-steps.")
        times.append(ref.step_s)
        ids.append(ref.run_id)
    return list(batches), times, ids


def _client_for_training() -> tuple[MlflowClient, str]:
    """Like :func:`recipes.plan.batch_runs.store_client`, but the store may not exist yet: the first training
    run creates it."""
    import mlflow

    uri = tracking_uri()
    return mlflow.MlflowClient(tracking_uri=uri), uri


def _to_target_args(batch: int, target: tuple[str, float], val_every_examples: int, max_epochs: int,
                    accumulate: int = 1) -> list[str]:
    key, value = target
    mode = "min" if key.endswith("<=") else "max"
    micro = batch // accumulate
    early = {"class_path": "lightning.pytorch.callbacks.EarlyStopping",
             "init_args": {"monitor": key.removesuffix("<="), "mode": mode, "stopping_threshold": value,
                           "patience": 10**6, "check_on_train_epoch_end": False}}
    args = [f"--data.init_args.batch_size={micro}", f"--trainer.accumulate_grad_batches={accumulate}",
            f"--trainer.max_epochs={max_epochs}", "--trainer.check_val_every_n_epoch=null",
            f"--trainer.val_check_interval={max(1, round(val_every_examples / micro))}",
            f"--trainer.callbacks+={json.dumps(early)}"]
    if accumulate > 1:
        args.append("--trainer.callbacks+=callbacks.noise_scale.GradientNoiseScale")
    return args


@dataclass
class ValidationRow:
    """Predicted against measured at one batch size."""

    batch: int
    predicted_steps: float
    measured_steps: int | None
    predicted_step_s: float
    measured_step_s: float | None
    predicted_s: float
    measured_s: float | None
    run_id: str
    reference: bool = False

    @property
    def steps_error(self) -> float | None:
        return None if self.measured_steps is None else self.predicted_steps / self.measured_steps - 1.0

    @property
    def time_error(self) -> float | None:
        return None if self.measured_s is None else self.predicted_s / self.measured_s - 1.0


def _train_or_reuse(client: MlflowClient, uri: str, config: str, experiment: str, name: str, args: list[str],
                    log_dir: Path, target: tuple[str, float] | None) -> Reference:
    """Train run ``name`` unless a FINISHED run of that name exists in ``experiment`` (``--stamp`` reuses runs)."""
    exp = client.get_experiment_by_name(experiment)
    done = [] if exp is None else all_runs(
        client, [exp.experiment_id], f"attributes.run_name = {quoted(name)} and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"])
    if done:  # the newest finished one, not a newer failed attempt of the same name
        run_id = done[0].info.run_id
        print(f"{name}: reusing run {run_id}", flush=True)
    else:
        print(f"{name}: training ...", flush=True)
        _fit(config, name, experiment, args, log_dir / f"{name}.log")
        run_id = _run_id(client, experiment, name)
    return read_run(client, run_id, uri, target)


def validate(config: str, batches: Sequence[int], ref_batch: int, targets: Sequence[tuple[str, float]], *,
             sweep_steps: int = 60, val_every_examples: int = 320, max_epochs: int = 20, stamp: str | None = None,
             log_dir: Path = Path("runs/plan-batch")) -> list[tuple[list[ValidationRow], dict[str, Any]]]:
    """Train to the target at each batch and compare with the prediction (see the module docstring).

    The runs stop at the last of ``targets`` (the hardest); each target gets its own table from the same runs.
    """
    if ref_batch not in batches:
        raise UsageError(f"--ref-batch {ref_batch} must be one of --batches {','.join(map(str, batches))}.")
    if ref_batch % 2:
        raise UsageError(f"--ref-batch {ref_batch} must be even: its run takes two micro-batches of half of it.")
    if len({key for key, _ in targets}) != 1:
        raise UsageError(f"--target: {', '.join(k for k, _ in targets)}: give one metric (several values of it).")
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    experiment = _experiment(config)
    client, uri = _client_for_training()
    sweep = [_train_or_reuse(client, uri, config, experiment, f"sweep-b{b}-{stamp}",
                             [f"--data.init_args.batch_size={b}", f"--trainer.max_steps={sweep_steps}",
                              "--trainer.limit_val_batches=0"], log_dir, None) for b in batches]
    if not all(r.step_s for r in sweep):
        raise RuntimeError(f"a sweep run logged no {STEP_KEY}: run more --sweep-steps.")
    model = fit_step_time(list(batches), [r.step_s for r in sweep])
    stop = targets[-1]
    noise = _train_or_reuse(client, uri, config, experiment, f"noise-b{ref_batch}-{stamp}",
                            _to_target_args(ref_batch, stop, val_every_examples, max_epochs, 2), log_dir, None)
    if not noise.b_noise or noise.b_noise <= 0:
        raise RuntimeError(f"the noise-scale run {noise.run_id} logged no positive {B_NOISE_KEY}.")
    runs = {b: _train_or_reuse(client, uri, config, experiment, f"target-b{b}-{stamp}",
                               _to_target_args(b, stop, val_every_examples, max_epochs), log_dir, None)
            for b in [ref_batch, *[b for b in batches if b != ref_batch]]}
    out = []
    for target in targets:
        steps_to = {b: measured_steps_to(client, r.run_id, target) for b, r in runs.items()}
        if steps_to[ref_batch] is None:
            raise RuntimeError(f"the reference run at batch {ref_batch} did not reach {target[0]} {target[1]:g}: "
                               "raise --max-epochs or lower the target.")
        s_min = s_min_from_reference(steps_to[ref_batch], ref_batch, noise.b_noise)
        rows = []
        for b in batches:
            m, steps = runs[b], steps_to_target(b, noise.b_noise, s_min)
            rows.append(ValidationRow(
                batch=b, predicted_steps=steps, measured_steps=steps_to[b], predicted_step_s=model(b),
                measured_step_s=m.step_s, predicted_s=steps * model(b),
                measured_s=None if steps_to[b] is None or not m.step_s else steps_to[b] * m.step_s,
                run_id=m.run_id, reference=b == ref_batch))
        out.append((rows, {"b_noise": noise.b_noise, "s_min": s_min, "ref_batch": ref_batch,
                           "ref_steps": steps_to[ref_batch], "noise_run": noise.run_id, "stamp": stamp,
                           "step_time_model": {"t0": model.t0, "per_example_s": model.per_example_s,
                                               "max_rel_error": model.max_rel_error},
                           "target": f"{target[0]} {target[1]:g}", "experiment": experiment}))
    return out
