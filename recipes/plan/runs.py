"""A finished run's measurements, read from MLflow, for ``python -m recipes.plan --run``.

What replaces ``--step-time``, ``--steps`` and the scaling law when a plan starts from a run: the measured
step time and where it comes from, the world size it was measured on, the steps, the run's own serial
fraction, the device that measured it (and a caveat when that is not the device priced), and the fit of a
``recipes.scale`` parent run. The order of preference is in :mod:`recipes.plan`'s docstring. mlflow is
imported only when a client is made, so the planner without ``--run`` never loads it.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from callbacks.analysis.ckpt_interval import OverheadCheck, overhead_check
from callbacks.analysis.keys import (
    BEST_LAW_TAG,
    BILLED_KEY,
    CHECKPOINT_STALL_KEY,
    RESTART_KEY,
    SCALE_SERIAL_KEY,
    SCALE_USL_KEYS,
    SERIAL_KEY,
    STEP_KEY,
    STEP_WINDOW_KEY,
    goodput_seconds_key,
    serial_key_at,
)
from callbacks.analysis.prices import Instance
from callbacks.storage import ckpt_store
from recipes.run.common import tracking_uri

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

__all__ = [
    "RunMeasurement",
    "device_caveat",
    "interruption_record",
    "law_from_scale_run",
    "measure_run",
    "resolve_run",
    "tracking_client",
]


@dataclass(frozen=True)
class RunMeasurement:
    """What a finished run's record says about its speed, as the planner uses it.

    Args:
        run_id: The MLflow run.
        run_dir: The run directory, when one was given.
        measured_step_s: Seconds per step as measured, on ``world_size`` devices.
        step_time_source: Where ``measured_step_s`` comes from, in words.
        world_size: Devices the run trained on.
        world_size_source: Where ``world_size`` comes from.
        steps: The run's total optimizer steps.
        steps_source: Where ``steps`` comes from.
        serial_fraction: The run's own ``amdahl/serial_fraction`` measured at ``world_size`` (its
            ``.../world_N`` record, which a run resumed on another device count keeps per world size), else
            the run's latest; None when it logged none.
        serial_fraction_key: The metric ``serial_fraction`` was read from.
        measured_device: What measured the step time: ``"CPU"``, the GPU model(s) in ``manifest.json``,
            or None when unknown.
        device_source: Where ``measured_device`` comes from.
    """

    run_id: str
    run_dir: str | None
    measured_step_s: float
    step_time_source: str
    world_size: int
    world_size_source: str
    steps: int
    steps_source: str
    serial_fraction: float | None
    measured_device: str | None = None
    device_source: str = "no manifest.json"
    serial_fraction_key: str = SERIAL_KEY


def tracking_client() -> tuple[MlflowClient, str]:
    """A client on ``MLFLOW_TRACKING_URI`` (else the CLI's default); mlflow is imported only here."""
    import mlflow

    uri = tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).is_file():
        raise ValueError(f"no MLflow store at {uri}: set MLFLOW_TRACKING_URI to the store that tracked the run.")
    return mlflow.MlflowClient(tracking_uri=uri), uri


def _get_run(client: MlflowClient, run_id: str, what: str, uri: str) -> Run:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException:
        raise ValueError(f"unknown {what} {run_id!r}: no such MLflow run in {uri}.") from None


def _newest_record(run_dir: Path) -> ckpt_store.CheckpointRecord | None:
    """The run directory's newest checkpoint record (not hashed: records only are read)."""
    directory = run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else run_dir
    for path in ckpt_store.candidates(directory):
        record = ckpt_store.read_record(path, verify_hash=False)
        if record is not None:
            return record
    return None


def _manifest(client: MlflowClient, run: Run, run_dir: Path | None) -> dict | None:
    """The run's ``manifest.json``: from the run directory, else its MLflow artifacts."""
    places = [run_dir / "manifest.json"] if run_dir is not None else []
    artifacts = run.info.artifact_uri or ""
    local = "://" not in artifacts or artifacts.startswith("file://")
    if local:
        places.append(Path(artifacts.removeprefix("file://")) / "manifest.json")
    for path in places:
        if path.is_file():
            return json.loads(path.read_text())
    if local:
        return None
    try:  # a remote artifact store
        with tempfile.TemporaryDirectory() as tmp:
            return json.loads(Path(client.download_artifacts(run.info.run_id, "manifest.json", tmp)).read_text())
    except Exception:  # no manifest logged: the caller says so
        return None


def _world_size(manifest: dict | None, run: Run) -> tuple[int, str]:
    if manifest and isinstance(manifest.get("world_size"), int) and manifest["world_size"] >= 1:
        return manifest["world_size"], "manifest.json"
    params = run.data.params
    devices, nodes = params.get("trainer.devices", ""), params.get("trainer.num_nodes", "1")
    if devices.isdigit() and nodes.isdigit() and int(devices) >= 1:
        return int(devices) * int(nodes), "params trainer.devices x trainer.num_nodes"
    return 1, f"assumed: no manifest.json and trainer.devices={devices or None!r}"


def _measured_device(manifest: dict | None, run: Run) -> tuple[str | None, str]:
    """``("CPU" | GPU model(s) | None, where that comes from)``: the manifest's GPUs, unless the run chose the CPU."""
    if run.data.params.get("trainer.accelerator") == "cpu":
        return "CPU", "params trainer.accelerator=cpu"
    gpus = manifest.get("gpus") if manifest else None
    if not isinstance(gpus, list):
        return None, "no manifest.json" if manifest is None else "manifest.json names no devices"
    if not gpus:
        return "CPU", "manifest.json lists no GPU"
    return " + ".join(dict.fromkeys(map(str, gpus))), "manifest.json"


def device_caveat(device: str | None, device_source: str, instance: Instance) -> str | None:
    """Why a step time measured on ``device`` may not hold on ``instance``, or None when they match.

    Args:
        device: ``"CPU"``, a GPU model as ``torch.cuda.get_device_name`` gives it, or None (unknown).
        device_source: Where ``device`` comes from, for the reader.
        instance: The catalog row the plan prices.

    Returns:
        One sentence, or None when the run measured on the instance's kind of device (a CPU for a
        machine without GPUs; a GPU whose name contains the catalog's model, e.g. ``H100``).
    """
    target = instance.gpu or "CPU"
    if device is not None:
        if instance.gpu is None and device == "CPU":
            return None
        model = (instance.gpu or "").split()[0].lower() if instance.gpu else None
        if model and device != "CPU" and model in device.lower():
            return None
    measured = device or "an unknown device"
    kind = "device" if device is None else "CPU" if device == "CPU" else "GPU"
    return (f"step time measured on {measured} ({device_source}), priced as {instance.name} ({instance.gpus}x "
            f"{target}): the rows assume one {target} steps as fast as that {kind} did. Measure on the target "
            "device, or pass --step-time.") if instance.gpu else (
            f"step time measured on {measured} ({device_source}), priced as {instance.name} (no GPU): the rows "
            f"assume that machine steps as fast as that {kind} did. Measure on the target device, or pass "
            "--step-time.")


def measure_run(client: MlflowClient, run: Run, run_dir: Path | None = None) -> RunMeasurement:
    """Read a finished run's step time, steps and world size from its MLflow record (and run directory).

    Args:
        client: An ``mlflow.MlflowClient`` on the store that tracked the run.
        run: The ``mlflow.entities.Run``.
        run_dir: Its run directory, if known (its newest checkpoint record also gives the steps).

    Returns:
        The :class:`RunMeasurement` (see the module docstring for the order of preference).

    Raises:
        ValueError: If the run logged no steps, or has neither timing metrics nor an end time.
    """
    run_id = run.info.run_id
    metrics = run.data.metrics
    logged = 0
    for key in metrics:
        if not key.startswith("system/"):  # MLflow's system metrics count samples, not steps
            logged = max([logged, *(m.step for m in client.get_metric_history(run_id, key))])
    record = _newest_record(run_dir) if run_dir is not None else None
    steps, steps_source = logged, "furthest step the run logged"
    if record is not None and record.global_step >= steps:
        steps_source = "newest checkpoint record" if record.global_step > steps else f"{steps_source} and checkpoint"
        steps = record.global_step
    if steps < 1:
        raise ValueError(f"run {run_id} logged no training steps: give --steps and --step-time.")
    if metrics.get(STEP_KEY, 0) > 0:
        measured, source = metrics[STEP_KEY], f"{STEP_KEY} (StepTiming's run mean)"
    elif STEP_WINDOW_KEY in metrics:
        values = [m.value for m in client.get_metric_history(run_id, STEP_WINDOW_KEY)]
        measured, source = sum(values) / len(values), f"mean of {len(values)} {STEP_WINDOW_KEY} windows"
    else:
        if run.info.end_time is None:
            raise ValueError(f"run {run_id} has not finished (status {run.info.status}) and logged no "
                             f"{STEP_KEY}: give --step-time.")
        wall = (run.info.end_time - run.info.start_time) / 1000.0
        measured, source = wall / steps, f"wall duration {wall:g} s / {steps} steps (MLflow run start to end)"
    if not measured > 0:
        raise ValueError(f"run {run_id}: measured step time {measured!r} s is not positive: give --step-time.")
    manifest = _manifest(client, run, run_dir)
    world, world_source = _world_size(manifest, run)
    device, device_source = _measured_device(manifest, run)
    serial_key = serial_key_at(world) if serial_key_at(world) in metrics else SERIAL_KEY
    serial = metrics.get(serial_key)
    return RunMeasurement(run_id=run_id, run_dir=None if run_dir is None else str(run_dir),
                          measured_step_s=float(measured), step_time_source=source, world_size=world,
                          world_size_source=world_source, steps=int(steps), steps_source=steps_source,
                          serial_fraction=None if serial is None else float(serial), measured_device=device,
                          device_source=device_source, serial_fraction_key=serial_key)


def resolve_run(client: MlflowClient, ref: str, uri: str) -> tuple[Run, Path | None]:
    """``ref`` as a run directory (its checkpoint records name the MLflow run) or an MLflow run id."""
    path = Path(ref)
    if not path.is_dir():
        return _get_run(client, ref, "run", uri), None
    record = _newest_record(path)
    run_id = record.extra.get("mlflow_run_id") if record is not None else None
    if not run_id:
        raise ValueError(f"run directory {ref!r} has no checkpoint record naming its MLflow run "
                         "(checkpoints/*.meta.json): pass the MLflow run id instead.")
    return _get_run(client, run_id, f"run (from {ref})", uri), path


def law_from_scale_run(client: MlflowClient, run_id: str, uri: str) -> tuple[dict[str, float], str]:
    run = _get_run(client, run_id, "--scale-run", uri)
    metrics, best = run.data.metrics, run.data.tags.get(BEST_LAW_TAG)
    if best == "usl" and SCALE_USL_KEYS[0] in metrics:
        law = {"usl_a": metrics[SCALE_USL_KEYS[0]], "usl_b": metrics.get(SCALE_USL_KEYS[1], 0.0)}
        return law, f"USL fit of recipes.scale run {run_id} (best R²)"
    if SCALE_SERIAL_KEY in metrics:
        return {"serial_fraction": metrics[SCALE_SERIAL_KEY]}, f"Amdahl fit of recipes.scale run {run_id}"
    raise ValueError(f"--scale-run {run_id} logged no {SCALE_SERIAL_KEY}: is it a recipes.scale parent run?")



def interruption_record(client: MlflowClient, run: Run) -> OverheadCheck | None:
    """The run's realized checkpoint and interruption overhead (its goodput ledger) beside Young/Daly's.

    Saves are the points of ``time/checkpoint_s`` (one per step that saved), interruptions the resumes (each
    adds its gap to ``cost/restart_s``). None for a run without a ledger (``goodput/*``, from before issue 47)
    or without a productive second.
    """
    metrics = run.data.metrics
    keys = (*(goodput_seconds_key(c) for c in ("productive", "checkpoint", "redone", "restart")), BILLED_KEY)
    if any(k not in metrics for k in keys) or metrics[keys[0]] <= 0:
        return None
    saves = len(client.get_metric_history(run.info.run_id, CHECKPOINT_STALL_KEY))
    gaps = {m.value for m in client.get_metric_history(run.info.run_id, RESTART_KEY) if m.value > 0}
    productive, checkpoint, redone, restart, billed = (float(metrics[k]) for k in keys)
    return overhead_check(productive, checkpoint, redone, restart, saves, len(gaps), billed)
