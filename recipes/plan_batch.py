"""Which batch size, on how many devices, reaches the same loss soonest or cheapest: ``recipes.plan batch``.

From the gradient noise scale ``B_noise`` (McCandlish et al. 2018; ``GradientNoiseScale`` logs it as
``noise_scale/b_simple``), the steps one run took to a target at its batch, and step times measured at a
few batch sizes, this predicts for each global batch ``B`` and device count ``N``: the steps to the same
loss ``S(B) = S_min (1 + B_noise / B)``, the step time ``t(B/N) + comm(N)``, the wall time and the
dollars; it picks the fastest and the cheapest and marks batches past diminishing returns
(``B > 4 B_noise``: doubling the batch saves under 10 % of the steps). The math is in
:mod:`callbacks.analysis.batch_size`.

::

    # all by hand: B_noise 200, a run took 900 steps at batch 32, step times at 3 per-device batches
    python -m recipes.plan batch --b-noise 200 --ref-steps 900 --ref-batch 32 \\
        --step-times 32:0.011,64:0.015,128:0.024 --batches 32,64,128,256,512,1024 --devices 1,2,4,8 \\
        --params 1.2e6 --bandwidth-gbps 100 --instance a3-highgpu-8g --plot batch.png

    # from runs: B_noise and the steps to val/acc 0.97 from a run with GradientNoiseScale, step times from
    # other runs (each run's time/mean/step_s at its data.init_args.batch_size)
    python -m recipes.plan batch --run RUN_ID --target val/acc=0.97 --step-time-runs ID1,ID2,ID3

    # step times from a short sweep this command runs (recipes.fit, --sweep-steps steps per batch size)
    python -m recipes.plan batch --run RUN_ID --sweep configs/digits.yaml --batches 16,32,64,128

    # validate the prediction on a recipe: train to the target at each batch and compare (trains; minutes)
    python -m recipes.plan batch --validate configs/digits.yaml --batches 16,32,64,128 --ref-batch 32 \\
        --target val/acc=0.97

``--validate`` runs (1) the short step-time sweep at each batch, (2) a reference run at ``--ref-batch`` to
the target with ``GradientNoiseScale`` (two micro-batches of half the batch per step, so one process sees
two batch sizes: the same optimization), which gives ``B_noise`` and ``S_ref``, then (3) a run to the
target at every other batch, validating every ``--val-every-examples`` examples and stopping at the target
(Lightning's ``EarlyStopping(stopping_threshold=...)``). Measured steps are the first validation at or
past the target; measured time is those steps x the run's own mean step time (StepTiming's
``time/mean/step_s``: data, forward, backward, optimizer; validation and checkpoints excluded, as in the
prediction). Runs go to the experiment ``<recipe experiment>-batch`` so ``recipes.compare``/``promote``
do not weigh them against the recipe's own runs.

Only ``--sweep``/``--validate`` train (in ``python -m recipes.fit`` subprocesses); the planner itself imports
neither torch nor Lightning. Exit status: 0; 1 when ``--validate`` finds the predicted ranking differs from
the measured one or a run missed the target; 2 on bad input (one line on stderr naming the value).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from callbacks.analysis.batch_size import (
    DIMINISHING_FACTOR,
    BatchPlan,
    StepTimeModel,
    fit_step_time,
    plan_batches,
    s_min_from_reference,
    steps_to_target,
)
from callbacks.analysis.comm import gbps_to_bytes_per_s, ring_allreduce_time
from callbacks.analysis.prices import MARKETS, get_instance, load_catalog, price_for, with_overrides
from recipes.common import STEP_KEY, ArgumentParser, UsageError, human_duration, positive_ints, tracking_uri

if TYPE_CHECKING:
    from mlflow import MlflowClient

__all__ = ["main", "print_plan", "validate", "write_plot"]

PROG = "python -m recipes.plan batch"
B_NOISE_KEY = "noise_scale/b_simple"
BATCH_USED_KEY = "noise_scale/batch_used"
STEP_MEAN_KEY = STEP_KEY
BATCH_PARAM = "data.init_args.batch_size"
ACCUMULATE_PARAM = "trainer.accumulate_grad_batches"
DEFAULT_BATCHES = (16, 32, 64, 128, 256, 512, 1024, 2048)


# ------------------------------------------------------------------------------------------- parsing


def _step_times(text: str) -> tuple[list[int], list[float]]:
    """``"32:0.011,64:0.015"`` -> per-device batches and seconds."""
    batches, seconds = [], []
    for part in text.split(","):
        b, sep, t = part.strip().partition(":")
        try:
            bb, tt = int(b), float(t)
        except ValueError:
            raise UsageError(f"--step-times: {part.strip()!r} is not BATCH:SECONDS (e.g. 32:0.011).") from None
        if not sep or bb < 1 or not (math.isfinite(tt) and tt > 0):
            raise UsageError(f"--step-times: {part.strip()!r} needs a batch >= 1 and a positive time in seconds.")
        batches.append(bb)
        seconds.append(tt)
    return batches, seconds


def _target(text: str) -> tuple[str, float]:
    """``"val/acc=0.97"`` -> (metric, value); a metric reaches it when at least it (``val/loss<=0.1`` for at most)."""
    for sep in ("<=", ">=", "="):
        if sep in text:
            key, _, value = text.partition(sep)
            try:
                return key.strip() + ("<=" if sep == "<=" else ""), float(value)
            except ValueError:
                break
    raise UsageError(f"--target: {text!r} is not METRIC=VALUE (e.g. val/acc=0.97, or val/loss<=0.1).")


def _reached(key: str, value: float, target: float) -> bool:
    return value <= target if key.endswith("<=") else value >= target


# ------------------------------------------------------------------------------------------- MLflow


def _client() -> tuple[MlflowClient, str]:
    import mlflow

    uri = tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        raise UsageError(f"no MLflow store at {uri}: set MLFLOW_TRACKING_URI to the store that tracked the runs.")
    return mlflow.MlflowClient(tracking_uri=uri), uri


def _run(client: MlflowClient, run_id: str, uri: str) -> Any:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException:
        raise UsageError(f"unknown run {run_id!r}: no such MLflow run in {uri}.") from None


def _global_batch(run: Any) -> int | None:
    """The run's global batch: GradientNoiseScale's ``batch_used``, else batch_size x accumulation (one process)."""
    if BATCH_USED_KEY in run.data.metrics and run.data.metrics[BATCH_USED_KEY] > 0:
        return int(run.data.metrics[BATCH_USED_KEY])
    params = run.data.params
    try:
        return int(params[BATCH_PARAM]) * int(params.get(ACCUMULATE_PARAM, "1") or 1)
    except (KeyError, ValueError):
        return None


def _steps_to(client: MlflowClient, run_id: str, target: tuple[str, float] | None) -> int | None:
    """First logged step at which the target metric reached its value; without a target, the last step."""
    if target is None:
        run = client.get_run(run_id)
        return max((m.step for k in run.data.metrics if not k.startswith("system/")
                    for m in client.get_metric_history(run_id, k)), default=None)
    key, value = target
    for m in sorted(client.get_metric_history(run_id, key.removesuffix("<=")), key=lambda m: m.step):
        if _reached(key, m.value, value):
            return int(m.step)
    return None


@dataclass(frozen=True)
class Reference:
    """What one run says: its noise scale, global batch, steps to the target and step time."""

    run_id: str
    b_noise: float | None
    batch: int | None
    steps: int | None
    step_s: float | None
    per_device_batch: int | None


def read_run(client: MlflowClient, run_id: str, uri: str, target: tuple[str, float] | None) -> Reference:
    run = _run(client, run_id, uri)
    metrics = run.data.metrics
    try:
        per_device = int(run.data.params[BATCH_PARAM])
    except (KeyError, ValueError):
        per_device = None
    return Reference(run_id=run_id, b_noise=metrics.get(B_NOISE_KEY), batch=_global_batch(run),
                     steps=_steps_to(client, run_id, target), step_s=metrics.get(STEP_MEAN_KEY),
                     per_device_batch=per_device)


# ------------------------------------------------------------------------------------------- training


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
    exp = client.get_experiment_by_name(experiment)
    runs = [] if exp is None else client.search_runs(
        [exp.experiment_id], filter_string=f"attributes.run_name = '{run_name}'")
    if not runs:
        raise RuntimeError(f"training run {run_name} left no MLflow run in experiment {experiment!r}.")
    return runs[0].info.run_id


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
            raise RuntimeError(f"sweep run {name} logged no {STEP_MEAN_KEY}: run more --sweep-steps.")
        times.append(ref.step_s)
        ids.append(ref.run_id)
    return list(batches), times, ids


def _client_for_training() -> tuple[MlflowClient, str]:
    """Like :func:`_client`, but the store may not exist yet: the first training run creates it."""
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
    done = [] if exp is None else client.search_runs(
        [exp.experiment_id], filter_string=f"attributes.run_name = '{name}' and attributes.status = 'FINISHED'")
    if done:
        print(f"{name}: reusing run {done[0].info.run_id}", flush=True)
    else:
        print(f"{name}: training ...", flush=True)
        _fit(config, name, experiment, args, log_dir / f"{name}.log")
    return read_run(client, _run_id(client, experiment, name), uri, target)


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
        raise RuntimeError(f"a sweep run logged no {STEP_MEAN_KEY}: run more --sweep-steps.")
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
        steps_to = {b: _steps_to(client, r.run_id, target) for b, r in runs.items()}
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


def _ranking(values: dict[int, float]) -> list[int]:
    return [b for b, _ in sorted(values.items(), key=lambda kv: kv[1])]


def print_validation(rows: list[ValidationRow], info: dict[str, Any]) -> bool:
    """Print the predicted-vs-measured table (Markdown); True when the rankings by time and by steps agree."""
    print(f"\ntarget {info['target']}; B_noise {info['b_noise']:.1f} (noise-scale run {info['noise_run']}); "
          f"reference: batch {info['ref_batch']} took {info['ref_steps']} steps -> S_min {info['s_min']:.1f}; "
          "step time t(b) = "
          f"{info['step_time_model']['t0'] * 1e3:.2f} ms + {info['step_time_model']['per_example_s'] * 1e6:.1f} us x b "
          f"(fit within {info['step_time_model']['max_rel_error']:.0%} of the sweep)\n")
    print("| batch | steps predicted | steps measured | error | step predicted | step measured "
          "| time predicted | time measured | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def pct(x: float | None) -> str:
            return "-" if x is None else f"{x:+.0%}"
        ms = "not reached" if r.measured_steps is None else str(r.measured_steps)
        mt = "-" if r.measured_s is None else f"{r.measured_s:.2f} s"
        mss = "-" if r.measured_step_s is None else f"{r.measured_step_s * 1e3:.1f} ms"
        print(f"| {r.batch}{' (ref)' if r.reference else ''} | {r.predicted_steps:.0f} | {ms} | "
              f"{'(fitted)' if r.reference else pct(r.steps_error)} | {r.predicted_step_s * 1e3:.1f} ms | {mss} | "
              f"{r.predicted_s:.2f} s | {mt} | {pct(r.time_error)} |")
    done = [r for r in rows if r.measured_s is not None and r.measured_steps is not None]
    agree = len(done) == len(rows)
    if not agree:
        print("\nsome runs did not reach the target: no ranking.")
        return False
    for what, pred, meas in (("time", {r.batch: r.predicted_s for r in rows}, {r.batch: r.measured_s for r in rows}),
                             ("steps", {r.batch: r.predicted_steps for r in rows},
                              {r.batch: float(r.measured_steps) for r in rows})):
        p, m = _ranking(pred), _ranking(meas)
        errs = [abs(pred[b] / meas[b] - 1) for b in pred]
        print(f"ranking by {what}: predicted {p}, measured {m} -> {'agree' if p == m else 'DIFFER'}; "
              f"mean |error| {sum(errs) / len(errs):.0%}, max {max(errs):.0%}")
        agree = agree and p == m
    return agree


# ------------------------------------------------------------------------------------------- output


def _fmt_s(seconds: float) -> str:
    return human_duration(seconds)


def print_plan(plan: BatchPlan, model: StepTimeModel, caption: str) -> None:
    """The plan as a table (one row per batch and device count), the picks and the caveats."""
    measured_max = max((b for b, _ in model.points), default=0.0)
    print(f"B_noise {plan.b_noise:,.1f}, S_min {plan.s_min:,.1f} steps; step time t(b) = {model.t0 * 1e3:.3g} ms + "
          f"{model.per_example_s * 1e6:.3g} us x b per device (fit within {model.max_rel_error:.0%} of "
          f"{len(model.points)} measured points). {caption}")
    header = ("batch", "N", "steps", "S/S_min", "E/E_min", "x2 saves", "step", "wall", "cost $", "")
    lines = [header]
    for r in plan.rows:
        marks = []
        if r is plan.fastest:
            marks.append("fastest")
        if r is plan.cheapest:
            marks.append("cheapest")
        if r.diminishing:
            marks.append(f"diminishing (B > {DIMINISHING_FACTOR:g} B_noise)")
        if r.batch / r.devices > measured_max:
            marks.append("step time extrapolated")
        lines.append((str(r.batch), str(r.devices), f"{r.steps:,.0f}", f"{r.steps_over_min:.2f}",
                      f"{r.examples_over_min:.2f}", f"{r.doubling_saves:.0%}", _fmt_s(r.step_s), _fmt_s(r.wall_s),
                      f"{r.cost_usd:.4g}", ", ".join(marks)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(cell.rjust(w) if i < len(header) - 1 else cell for i, (cell, w) in
                        enumerate(zip(line, widths, strict=True))).rstrip())
    for key, r in (("fastest", plan.fastest), ("cheapest", plan.cheapest)):
        print(f"{key}: batch {r.batch} on {r.devices} device(s): {r.steps:,.0f} steps x {_fmt_s(r.step_s)} = "
              f"{_fmt_s(r.wall_s)}, ${r.cost_usd:.4g}")
    past = sorted({r.batch for r in plan.rows if r.diminishing})
    if past:
        print(f"past diminishing returns: batch {', '.join(map(str, past))} (> {DIMINISHING_FACTOR:g} x B_noise = "
              f"{DIMINISHING_FACTOR * plan.b_noise:,.0f}): doubling them saves under 10 % of the steps for twice "
              "the examples.")
    for b, n, why in plan.skipped:
        print(f"skipped batch {b} on {n} devices: {why}.")


def write_plot(plan: BatchPlan, path: str, measured: dict[int, float] | None = None) -> str:
    """Time and cost against the global batch, one line per device count (log-log); measured times as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_c) = plt.subplots(1, 2, figsize=(11, 4.2))
    for n in sorted({r.devices for r in plan.rows}):
        rows = [r for r in plan.rows if r.devices == n]
        ax_t.plot([r.batch for r in rows], [r.wall_s for r in rows], marker="o", label=f"N={n}")
        ax_c.plot([r.batch for r in rows], [r.cost_usd for r in rows], marker="o", label=f"N={n}")
    if measured:
        ax_t.scatter(list(measured), list(measured.values()), marker="x", s=80, color="black", zorder=5,
                     label="measured (N=1)")
    for ax, label in ((ax_t, "wall time to target, s"), (ax_c, "cost to target, USD")):
        ax.axvline(plan.b_noise, color="grey", ls="--", lw=1)
        ax.axvspan(DIMINISHING_FACTOR * plan.b_noise, max(r.batch for r in plan.rows) * 1.5, color="grey",
                   alpha=0.12, label=f"B > {DIMINISHING_FACTOR:g} B_noise")
        ax.set_xscale("log", base=2)
        if ax is ax_t or any(r.cost_usd > 0 for r in plan.rows):
            ax.set_yscale("log")
        ax.set_xlabel("global batch B")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    ax_t.set_title(f"B_noise = {plan.b_noise:,.0f} (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Steps, wall time and cost to the same loss per batch size and "
                                              "device count (McCandlish et al. 2018).")
    src = p.add_argument_group("noise scale and reference (by hand, or from --run)")
    src.add_argument("--b-noise", type=float, help="gradient noise scale B_noise, examples")
    src.add_argument("--ref-steps", type=float, help="steps a run took to the target at --ref-batch")
    src.add_argument("--ref-batch", type=int, help="that run's global batch (with --validate: the reference batch)")
    src.add_argument("--s-min", type=float, help="S_min directly, instead of --ref-steps/--ref-batch")
    src.add_argument("--run", help="MLflow run with GradientNoiseScale: B_noise, its batch and steps (to --target)")
    src.add_argument("--target", help="METRIC=VALUE the steps are counted to (val/acc=0.97; val/loss<=0.1); "
                                      "default: the run's last step. --validate: several, comma-separated, "
                                      "ascending (the runs stop at the last)")
    st = p.add_argument_group("step times (one of)")
    st.add_argument("--step-times", help="per-device BATCH:SECONDS pairs, e.g. 32:0.011,64:0.015")
    st.add_argument("--step-time-runs", help="comma-separated MLflow run ids: each one's time/mean/step_s at its batch")
    st.add_argument("--sweep", metavar="CONFIG", help="run short recipes.fit runs of CONFIG at each of --batches")
    st.add_argument("--sweep-steps", type=int, default=60, help="steps per sweep run (default 60)")
    p.add_argument("--validate", metavar="CONFIG", help="train CONFIG to --target at each of --batches and compare")
    p.add_argument("--val-every-examples", type=int, default=320, help="--validate: validate every this many examples")
    p.add_argument("--max-epochs", type=int, default=20, help="--validate: give up after this many epochs")
    p.add_argument("--stamp", help="--validate: reuse the finished runs of this stamp (printed at the end)")
    p.add_argument("--batches", help=f"global batch sizes (default {','.join(map(str, DEFAULT_BATCHES))})")
    p.add_argument("--devices", default="1", help="data-parallel device counts, e.g. 1,2,4,8 (default 1)")
    comm = p.add_argument_group("gradient communication per step on N > 1 devices (ring all-reduce)")
    comm.add_argument("--params", type=float, help="model parameters")
    comm.add_argument("--bytes-per-param", type=float, default=4.0, help="bytes per gradient element (default 4)")
    comm.add_argument("--bandwidth-gbps", type=float, help="link bandwidth, Gbit/s")
    comm.add_argument("--latency-us", type=float, default=5.0, help="per-hop latency, microseconds (default 5)")
    p.add_argument("--instance", default="cpu-local", help="instance from the price catalog (default cpu-local)")
    p.add_argument("--catalog", help="price catalog YAML (default callbacks/analysis/prices.yaml)")
    p.add_argument("--market", default="on_demand", choices=MARKETS, help="which price (default on_demand)")
    p.add_argument("--price-per-h", type=float, help="override the instance's price per hour, USD")
    p.add_argument("--json", action="store_true", help="print the rows and picks as JSON")
    p.add_argument("--plot", help="write time and cost vs batch size to this PNG")
    return p


def _main(args: argparse.Namespace) -> int:
    targets = [_target(t) for t in args.target.split(",")] if args.target else []
    target = targets[-1] if targets else None
    batches = positive_ints("--batches", args.batches, "16,32,64") if args.batches else None
    devices = positive_ints("--devices", args.devices)
    for flag in ("sweep_steps", "val_every_examples", "max_epochs"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be >= 1.")
    if args.validate:
        if target is None or batches is None or args.ref_batch is None:
            raise UsageError("--validate needs --target, --batches and --ref-batch.")
        tables = validate(args.validate, batches, args.ref_batch, targets, sweep_steps=args.sweep_steps,
                          val_every_examples=args.val_every_examples, max_epochs=args.max_epochs, stamp=args.stamp)
        agree = all([print_validation(rows, info) for rows, info in tables])
        print(f"\nruns: experiment {tables[0][1]['experiment']!r}, --stamp {tables[0][1]['stamp']} (re-print without "
              "training: the same command with --stamp)")
        rows, info = tables[-1]
        if args.plot:
            model = StepTimeModel(info["step_time_model"]["t0"], info["step_time_model"]["per_example_s"])
            plan = plan_batches(info["b_noise"], info["s_min"], batches, model)
            measured = {r.batch: r.measured_s for r in rows if r.measured_s is not None}
            print(f"wrote {write_plot(plan, args.plot, measured)}")
        return 0 if agree else 1
    # the noise scale and S_min
    b_noise, s_min, ref_batch, ref_steps = args.b_noise, args.s_min, args.ref_batch, args.ref_steps
    client = uri = None
    if args.run or args.step_time_runs:
        client, uri = _client()
    if args.run:
        ref = read_run(client, args.run, uri, target)
        b_noise = b_noise if b_noise is not None else ref.b_noise
        ref_batch = ref_batch if ref_batch is not None else ref.batch
        ref_steps = ref_steps if ref_steps is not None else ref.steps
        if b_noise is None:
            raise UsageError(f"run {args.run} logged no {B_NOISE_KEY} (add callbacks.noise_scale.GradientNoiseScale "
                             "to the run) and no --b-noise was given.")
        if ref_steps is None:
            raise UsageError(f"run {args.run} never reached {args.target}: give another --target or --ref-steps.")
    if b_noise is None:
        raise UsageError("give --b-noise B (or --run RUN_ID of a run with GradientNoiseScale).")
    if not (math.isfinite(b_noise) and b_noise > 0):
        raise UsageError(f"--b-noise {b_noise!r} must be a positive number of examples.")
    if s_min is None:
        if ref_steps is None or ref_batch is None:
            raise UsageError("give --ref-steps S --ref-batch B (a run's steps to the target at its batch), or --s-min.")
        try:
            s_min = s_min_from_reference(ref_steps, ref_batch, b_noise)
        except ValueError as err:
            raise UsageError(f"--ref-steps/--ref-batch: {err}") from None
    # step times
    given = [f for f in ("step_times", "step_time_runs", "sweep") if getattr(args, f)]
    if len(given) != 1:
        raise UsageError("give exactly one source of step times: --step-times, --step-time-runs or --sweep "
                         f"(got {', '.join('--' + g.replace('_', '-') for g in given) or 'none'}).")
    if args.step_times:
        sb, stimes = _step_times(args.step_times)
    elif args.step_time_runs:
        sb, stimes = [], []
        for rid in [r.strip() for r in args.step_time_runs.split(",") if r.strip()]:
            ref = read_run(client, rid, uri, None)
            if not ref.step_s or not ref.per_device_batch:
                raise UsageError(f"--step-time-runs: run {rid} has no {STEP_MEAN_KEY} or no {BATCH_PARAM} param.")
            sb.append(ref.per_device_batch)
            stimes.append(ref.step_s)
    else:
        sweep = batches or list(DEFAULT_BATCHES[:4])
        sb, stimes, _ = sweep_step_times(args.sweep, sweep, args.sweep_steps, time.strftime("%Y%m%d-%H%M%S"),
                                         Path("runs/plan-batch"))
    model = fit_step_time(sb, stimes)
    # communication and price
    comm_s = None
    if (args.params is None) != (args.bandwidth_gbps is None):
        raise UsageError("give both --params and --bandwidth-gbps for the communication per step, or neither.")
    if args.params is not None:
        if not (args.params > 0 and args.bandwidth_gbps > 0 and args.bytes_per_param > 0 and args.latency_us >= 0):
            raise UsageError(f"--params {args.params:g}, --bandwidth-gbps {args.bandwidth_gbps:g}, --bytes-per-param "
                             f"{args.bytes_per_param:g} must be positive and --latency-us {args.latency_us:g} >= 0.")
        size, bw = args.params * args.bytes_per_param, gbps_to_bytes_per_s(args.bandwidth_gbps)
        lat = args.latency_us * 1e-6

        def comm_s(n: int) -> float:
            return ring_allreduce_time(size, n, bw, lat)
    elif max(devices) > 1:
        print("note: no --params/--bandwidth-gbps: communication on N > 1 devices is taken as free.")
    catalog = load_catalog(args.catalog)
    instance = get_instance(catalog, args.instance)
    if args.price_per_h is not None:
        instance = with_overrides(instance, **{"on_demand" if args.market == "on_demand" else "spot": args.price_per_h})
    price = price_for(instance, args.market)
    plan = plan_batches(b_noise, s_min, batches or list(DEFAULT_BATCHES), model, devices, comm_s, price,
                        instance.devices_per_instance)
    caption = f"{instance.name} {args.market} ${price:g}/h per instance ({instance.source}, {instance.date})."
    if args.json:
        print(json.dumps({"b_noise": plan.b_noise, "s_min": plan.s_min, "price_per_instance_h": price,
                          "step_time_model": {"t0": model.t0, "per_example_s": model.per_example_s},
                          "rows": [r.as_dict() for r in plan.rows], "fastest": plan.fastest.as_dict(),
                          "cheapest": plan.cheapest.as_dict(),
                          "skipped": [list(s) for s in plan.skipped]}, indent=2))
    else:
        print_plan(plan, model, caption)
    if args.plot:
        written = write_plot(plan, args.plot)
        if not args.json:
            print(f"wrote {written}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m recipes.plan batch ...``: 0 with a plan; 1 (``--validate``) when rankings differ; 2 on bad input."""
    try:
        args = _parser().parse_args(argv)
        return _main(args)
    except (UsageError, ValueError, KeyError, FileNotFoundError) as err:
        message = err.args[0] if err.args else str(err)
        print(f"error: {message}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
