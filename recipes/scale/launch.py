"""The launches of a scaling sweep: ``python -m recipes.fit`` at each device count, nested under one MLflow
parent run, their throughputs read back as :class:`~recipes.scale.points.Point` s; or a user's CSV instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlflow
import yaml
from rich.console import Console

from callbacks.analysis.keys import (
    KIND_TAG,
    MODE_TAG,
    PARENT_RUN_TAG,
    SERIAL_KEY,
    STEP_KEY,
    THROUGHPUT_KEY,
)
from callbacks.storage.remote_store import StoreError, check_writable, is_remote
from recipes.run.common import (
    ENV_PARENT_RUN_ID,
    UsageError,
    check_name,
    check_tracking_server,
    find_run,
    tracking_uri,
)
from recipes.run.tracking import ensure_experiment
from recipes.scale.points import Point, ScaleResult, fit_points, parse_devices, per_device_batch, read_csv
from recipes.scale.report import log_parent, write_outputs


class ChildFailed(Exception):
    """A training run of the sweep failed."""



def available_devices() -> tuple[int, str]:
    """How many devices this machine really has: GPUs if any, else CPU cores."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count(), "GPUs"
    except ImportError:  # pragma: no cover
        pass
    return os.cpu_count() or 1, "CPU cores"



def read_config_value(configs: Sequence[str], *keys: str) -> Any:
    """The value at ``keys`` in the last of ``configs`` (YAML) that sets it, else None."""
    value = None
    for path in configs:
        try:
            node: Any = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as err:
            raise UsageError(f"--config {path}: {err.strerror or err}") from None
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            value = node
    return value



def configs_have_step_timing(configs: Sequence[str]) -> bool:
    """Whether a config already adds StepTiming to ``trainer.callbacks`` (then the sweep adds none)."""
    for path in configs:
        node = yaml.safe_load(Path(path).read_text()) or {}
        for cb in (node.get("trainer") or {}).get("callbacks") or []:
            name = cb.get("class_path", "") if isinstance(cb, dict) else str(cb)
            if name.split(".")[-1] == "StepTiming":
                return True
    return False


def child_command(configs: Sequence[str], devices: int, batch: int | None, args: argparse.Namespace,
                  run_name: str, experiment: str, add_timing: bool, extra: Sequence[str]) -> list[str]:
    """The ``python -m recipes.fit`` command line of one point of the sweep."""
    cmd = [sys.executable, "-m", "recipes.fit"]
    for config in configs:
        cmd += ["--config", config]
    cmd += ["--experiment", experiment, "--run_name", run_name, "--runs_root", args.runs_root,
            "--trainer.devices", str(devices), "--trainer.num_nodes", "1",
            "--trainer.strategy", args.strategy if devices > 1 else "auto",
            "--trainer.max_steps", str(args.steps), "--trainer.max_epochs", "-1",
            "--trainer.log_every_n_steps", str(max(1, (args.steps - args.warmup) // 4)),
            "--trainer.enable_progress_bar", "false", "--log_model", "false"]
    if batch is not None:
        cmd += ["--data.init_args.batch_size", str(batch)]
    if add_timing:
        spec = {"class_path": "callbacks.timing.StepTiming", "init_args": {"warmup_steps": args.warmup}}
        cmd += [f"--trainer.callbacks+={json.dumps(spec)}"]
    return [*cmd, *extra]


def run_sweep(args: argparse.Namespace, extra: Sequence[str], console: Console) -> ScaleResult:
    """Train at each device count, tag the children under a parent run, fit and report."""
    devices = parse_devices(args.devices)
    have, kind = available_devices()
    too_many = [n for n in devices if n > have]
    if too_many:
        raise UsageError(f"--devices {args.devices}: this machine has {have} {kind}; N = "
                         f"{', '.join(map(str, too_many))} cannot be real processes here (fit a CSV of "
                         "measurements from a bigger machine with --from-csv)")
    if args.steps <= args.warmup:
        raise UsageError(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    configs = args.config or []
    if not configs:
        raise UsageError("--config is required (or --from-csv FILE)")
    for path in configs:
        if not Path(path).is_file():
            raise UsageError(f"--config {path}: no such file")
    experiment = check_name("the config's experiment", args.experiment or read_config_value(configs, "experiment")
                            or "default")  # a folder under the runs root, like every run's
    batch = args.batch_size or read_config_value(configs, "data", "init_args", "batch_size")
    if batch is not None:
        batch = int(batch)
        for n in devices:
            per_device_batch(args.mode, batch, n)  # fail before training anything
    uri = tracking_uri()
    check_tracking_server(uri)
    try:
        if is_remote(args.runs_root):  # before the sweep's parent run exists
            check_writable(args.runs_root)
    except StoreError as err:
        raise UsageError(f"{args.runs_root_flag} {err}") from None
    # the sweep's own outputs stay local when the runs live in object storage (they are logged to MLflow)
    out_root = Path("runs") if is_remote(args.runs_root) else Path(args.runs_root)
    out_dir = Path(args.out or out_root / experiment / f"scale-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment_id = ensure_experiment(client, experiment)
    parent = client.create_run(experiment_id, run_name=out_dir.name,
                               tags={KIND_TAG: "scale", MODE_TAG: args.mode})
    parent_id = parent.info.run_id
    client.log_batch(parent_id, params=[mlflow.entities.Param(k, str(v)) for k, v in {
        "mode": args.mode, "devices": ",".join(map(str, devices)), "steps": args.steps, "warmup": args.warmup,
        "strategy": args.strategy, "global_batch" if args.mode == "strong" else "per_device_batch": batch,
        "configs": ",".join(configs), "extra_args": " ".join(extra)}.items()])
    add_timing = not configs_have_step_timing(configs)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATSCALE_")}
    env.update({"MLFLOW_TRACKING_URI": uri, ENV_PARENT_RUN_ID: parent_id, "PYTHONUNBUFFERED": "1"})
    if kind == "CPU cores":  # a CPU "device" is one process on one core
        env.setdefault("OMP_NUM_THREADS", "1")
    points: list[Point] = []
    status = "FAILED"
    try:
        for n in devices:
            b = per_device_batch(args.mode, batch, n) if batch is not None else None
            name = f"{out_dir.name}-n{n}-{parent_id[:6]}"
            cmd = child_command(configs, n, b, args, name, experiment, add_timing, extra)
            log_path = out_dir / f"fit-n{n}.log"
            console.print(f"[cyan]N={n}[/]: {' '.join(cmd[1:])}", highlight=False)
            started = time.monotonic()
            with open(log_path, "w") as log_file:
                code = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                      timeout=args.timeout).returncode
            if code != 0:
                tail = "".join(log_path.read_text().splitlines(keepends=True)[-25:])
                raise ChildFailed(f"N={n}: recipes.fit exited with {code} (log {log_path}):\n{tail}")
            run = find_run(client, [experiment_id], name)
            if run is None:
                raise ChildFailed(f"N={n}: no MLflow run named {name!r} in experiment {experiment!r}")
            client.set_tag(run.info.run_id, PARENT_RUN_TAG, parent_id)
            metrics = run.data.metrics
            if THROUGHPUT_KEY not in metrics:
                raise ChildFailed(f"N={n}: the run logged no {THROUGHPUT_KEY} (StepTiming missing, or fewer "
                                  f"than --warmup {args.warmup} steps?)")
            points.append(Point(devices=n, throughput=metrics[THROUGHPUT_KEY], per_device_batch=b,
                                global_batch=None if b is None else b * n, step_s=metrics.get(STEP_KEY),
                                serial_fraction=metrics.get(SERIAL_KEY), run_id=run.info.run_id))
            console.print(f"      {metrics[THROUGHPUT_KEY]:,.1f} samples/s after warm-up "
                          f"({time.monotonic() - started:.0f} s)", highlight=False)
        fits = fit_points(points)
        result = ScaleResult(args.mode, points, fits, have, out_dir, parent_id)
        result.notes.append(real_note(devices, have, kind))
        write_outputs(result)
        log_parent(client, result)
        status = "FINISHED"
        return result
    finally:
        client.set_terminated(parent_id, status)


def real_note(devices: Sequence[int], have: int, kind: str) -> str:
    measured = ", ".join(map(str, devices))
    return (f"Measured N = {measured}: real processes on this machine's {have} {kind}. Any larger N below is "
            "a prediction of the fitted laws, not a measurement.")


def run_from_csv(args: argparse.Namespace, console: Console) -> ScaleResult:
    """Fit a user's ``devices,throughput`` measurements; no training."""
    points = read_csv(args.from_csv)
    fits = fit_points(points)
    experiment = args.experiment or "scale"
    # beside the runs, never beside the CSV (often the repository): local even for a remote --runs_root
    out_root = Path("runs") if is_remote(args.runs_root) else Path(args.runs_root)
    out_dir = Path(args.out or out_root / experiment / f"scale-{Path(args.from_csv).stem}")
    out_dir.mkdir(parents=True, exist_ok=True)
    result = ScaleResult(args.mode, points, fits, max(p.devices for p in points), out_dir)
    result.notes.append(f"Fitted to the measurements in {args.from_csv} (no training here).")
    write_outputs(result)
    if not args.no_mlflow:
        client = mlflow.MlflowClient(tracking_uri=tracking_uri())
        experiment_id = ensure_experiment(client, experiment)
        run = client.create_run(experiment_id, run_name=out_dir.name, tags={KIND_TAG: "scale-fit"})
        result.parent_run_id = run.info.run_id
        client.log_param(run.info.run_id, "from_csv", str(args.from_csv))
        try:
            log_parent(client, result)
        finally:
            client.set_terminated(run.info.run_id, "FINISHED")
    return result
