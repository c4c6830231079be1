"""Measure speedup over device counts, fit scaling laws, and say what more devices would buy.

Train the recipe at each device count, as real ``python -m recipes.fit`` processes, then fit
Amdahl, Gustafson and the Universal Scalability Law (:mod:`callbacks.analysis.scaling`) to the
measured speedups::

    python -m recipes.scale --config configs/digits.yaml --devices 1,2 --steps 40
    python -m recipes.scale --config configs/digits.yaml --devices 1,2,4,8 --mode weak   # on a GPU node
    python -m recipes.scale --from-csv my_measurements.csv --json    # columns: devices,throughput

Strong scaling (default) keeps the global batch fixed (per-device batch = global / N, the global
batch being the config's ``data.init_args.batch_size`` or ``--batch-size``); weak scaling keeps the
per-device batch fixed. Throughput is ``time/mean/samples_per_s`` of each child run: the
:class:`callbacks.timing.StepTiming` mean over the steps after its warm-up (``--warmup``),
checkpoints and validation excluded. N > 1 runs use ``--strategy`` (``ddp``). On CPUs a device is
one process on one core (``OMP_NUM_THREADS=1`` unless set), so N counts cores. Arguments this
command does not know are passed to every child (``--trainer.precision bf16-mixed`` ...).

Outputs, in ``--out`` (default ``<runs_root>/<experiment>/scale-<time>``; for ``--from-csv FILE``,
``<runs_root>/<experiment>/scale-<FILE's stem>`` with experiment ``scale`` unless given) and logged to
one MLflow parent run whose children are the per-N training runs (tag ``mlflow.parentRunId``):
``scaling.csv`` (one row per N), ``scaling.png`` (measured points, ideal, Amdahl, Gustafson and
USL curves, USL's peak N* marked), ``scaling.json`` (the fit, as ``--json`` prints it) and a
table. The prediction check compares, for each N > 1 run, the speedup that StepTiming's own serial
fraction of that run predicts (``amdahl/serial_fraction``) with the speedup the sweep measured.

Only device counts this machine really has are run (CPU processes up to its cores, GPUs up to
its GPUs); larger N are predictions of the fitted laws and are labelled so. Exit codes: 0 done,
2 bad input, 1 a child run failed (its log is in ``--out``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

from callbacks.analysis.scaling import (
    FitComparison,
    amdahl_speedup,
    compare_fits,
    gustafson_speedup,
    karp_flatt,
    speedup_from_throughput,
    usl_speedup,
)
from callbacks.storage.remote_store import StoreError, check_writable, is_remote
from recipes.run.common import (
    ENV_PARENT_RUN_ID,
    SERIAL_KEY,
    STEP_KEY,
    THROUGHPUT_KEY,
    USAGE_EXIT_CODE,
    ArgumentParser,
    UsageError,
    check_tracking_server,
    find_run,
    positive_ints,
    tracking_uri,
)

PROG = "python -m recipes.scale"


class ChildFailed(Exception):
    """A training run of the sweep failed."""


class _RunsRoot(argparse.Action):
    """Store ``--runs_root`` and remember how the user spelled it (``--runs-root`` is an alias), for messages."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.runs_root_flag = option_string or "--runs_root"


@dataclass
class Point:
    """One measured device count."""

    devices: int
    throughput: float
    per_device_batch: int | None = None
    global_batch: int | None = None
    step_s: float | None = None
    serial_fraction: float | None = None
    run_id: str | None = None
    speedup: float = math.nan
    efficiency: float = math.nan
    karp_flatt: float = math.nan


@dataclass
class ScaleResult:
    """The sweep (or the user's CSV) and the fitted laws."""

    mode: str
    points: list[Point]
    fits: FitComparison
    real_devices: int
    out_dir: Path
    parent_run_id: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def fit_note(self) -> str:
        """The caveat about the fits, checked against the numbers (see :func:`fit_note`)."""
        return fit_note(self.points, self.fits)

    def prediction_checks(self) -> list[dict[str, float]]:
        """For each N > 1 with a StepTiming serial fraction: the speedup it predicts vs the one measured."""
        return [{"devices": p.devices, "serial_fraction": p.serial_fraction,
                 "predicted_speedup": float(amdahl_speedup(p.devices, p.serial_fraction)),
                 "measured_speedup": p.speedup}
                for p in self.points if p.devices > 1 and p.serial_fraction is not None]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (infinite values as ``null``)."""
        f = self.fits
        return _finite({
            "mode": self.mode,
            "points": [asdict(p) for p in self.points],
            "fits": {
                "amdahl": {"serial_fraction": f.amdahl.serial_fraction, "ceiling": f.amdahl.ceiling,
                           "r_squared": f.amdahl.r_squared},
                "gustafson": {"serial_fraction": f.gustafson.serial_fraction, "r_squared": f.gustafson.r_squared},
                "usl": {"a": f.usl.a, "b": f.usl.b, "peak_n": f.usl.peak_n, "peak_speedup": f.usl.peak_speedup,
                        "r_squared": f.usl.r_squared},
                "best": f.best,
                "underdetermined": f.underdetermined,
                "note": self.fit_note,
            },
            "prediction_check": self.prediction_checks(),
            "measured_devices_max": self.real_devices,
            "notes": self.notes,
            "parent_run_id": self.parent_run_id,
            "out_dir": str(self.out_dir),
        })


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isinf(value) or math.isnan(value) else value
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


# ------------------------------------------------------------------------------ input
def parse_devices(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; each an integer >= 1, no repeats, must include 1."""
    out = positive_ints("--devices", text)
    for item in out:
        if out.count(item) > 1:
            raise UsageError(f"--devices: {item} is listed twice")
    if 1 not in out:
        raise UsageError(f"--devices {text}: include 1 (speedups are relative to one device)")
    return sorted(out)


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


def per_device_batch(mode: str, batch: int, devices: int) -> int:
    """Strong: ``batch`` is global, split over devices (must divide); weak: ``batch`` per device."""
    if mode == "weak":
        return batch
    if batch % devices:
        raise UsageError(f"--mode strong: global batch {batch} does not split evenly over {devices} devices; "
                         "pass --batch-size with a multiple of every device count")
    return batch // devices


def read_csv(path: str) -> list[Point]:
    """A user's measurements: columns ``devices,throughput`` (others ignored)."""
    try:
        with open(path, newline="") as handle:
            rows = list(csv.DictReader(handle))
    except OSError as err:
        raise UsageError(f"--from-csv {path}: {err.strerror or err}") from None
    if not rows or not {"devices", "throughput"} <= set(rows[0]):
        raise UsageError(f"--from-csv {path}: needs a header with columns devices,throughput")
    points = []
    for number, row in enumerate(rows, start=2):
        try:
            devices, throughput = float(row["devices"]), float(row["throughput"])
        except (TypeError, ValueError):
            raise UsageError(f"--from-csv {path} line {number}: devices={row['devices']!r}, "
                             f"throughput={row['throughput']!r} are not numbers") from None
        if not devices.is_integer() or devices < 1 or not math.isfinite(throughput) or throughput <= 0:
            raise UsageError(f"--from-csv {path} line {number}: devices must be an integer >= 1 and "
                             f"throughput > 0 (got {row['devices']}, {row['throughput']})")
        points.append(Point(devices=int(devices), throughput=throughput))
    return points


# ----------------------------------------------------------------------------- maths
def fit_points(points: list[Point]) -> FitComparison:
    """Speedup, efficiency and Karp-Flatt per point (in place), then the three laws."""
    devices = [p.devices for p in points]
    try:
        speedups = speedup_from_throughput(devices, [p.throughput for p in points])
        fits = compare_fits(devices, speedups)
    except ValueError as err:
        raise UsageError(str(err).replace("`", "")) from None
    for point, c in zip(points, speedups, strict=True):
        point.speedup = float(c)
        point.efficiency = float(c) / point.devices
        point.karp_flatt = float(karp_flatt(point.devices, c)) if point.devices > 1 else math.nan
    return fits


def _exact(r_squared: float) -> bool:
    return math.isfinite(r_squared) and r_squared > 1 - 1e-6


def no_speedup(points: Sequence[Point]) -> bool:
    """Whether every ``N > 1`` ran at most as fast as ``N = 1`` (a loaded machine, or too little work)."""
    multi = [p for p in points if p.devices > 1]
    return bool(multi) and all(p.speedup <= 1.0 for p in multi)


def fit_note(points: Sequence[Point], fits: FitComparison) -> str:
    """What the fits are worth, in words that agree with their numbers.

    :func:`callbacks.analysis.scaling.compare_fits` says when too few device counts make a law fit "exactly";
    that only holds when the law can reach the measured speedups. This keeps its note where the R² bears
    it out and replaces it where not: no speedup at all (every ``N > 1`` at most as fast as ``N = 1``),
    a superlinear point no one-parameter law reaches, or two ``N > 1`` that even USL does not pass through.
    """
    multi = [p for p in points if p.devices > 1]
    measured = ", ".join(f"x{p.speedup:.2f} at N={p.devices}" for p in multi)
    if no_speedup(points):
        return (f"No speedup measured ({measured}): more devices were no faster than one. The machine was "
                "loaded or the work per step is too small to split; the fitted laws describe no scaling "
                "and predict nothing. Measure again on an idle machine or with more work per step.")
    if fits.informative_n == 1 and not (_exact(fits.amdahl.r_squared) and _exact(fits.gustafson.r_squared)):
        return (f"Only one device count N > 1 was measured ({measured}), a speedup above N that Amdahl and "
                f"Gustafson cannot reach (their s is clipped to {fits.amdahl.serial_fraction:g}; R² "
                f"{fits.amdahl.r_squared:.3f}), and USL's two parameters are not determined. A superlinear "
                "point usually means a noisy N = 1 measurement or a cache effect: measure again, and more N.")
    if fits.informative_n == 2 and not _exact(fits.usl.r_squared):
        return (f"Only two device counts N > 1 were measured ({measured}), and not even USL's two parameters "
                f"pass through them (R² {fits.usl.r_squared:.3f}): the points are not consistent with any of "
                "these laws (noise or a loaded machine?). Measure each N more than once, and at least three N > 1.")
    return fits.note


# ------------------------------------------------------------------------------ sweep
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
    experiment = args.experiment or read_config_value(configs, "experiment") or "default"
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
    exp = client.get_experiment_by_name(experiment)
    experiment_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
    parent = client.create_run(experiment_id, run_name=out_dir.name,
                               tags={"atscale.kind": "scale", "atscale.mode": args.mode})
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
            client.set_tag(run.info.run_id, "mlflow.parentRunId", parent_id)
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
        exp = client.get_experiment_by_name(experiment)
        experiment_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
        run = client.create_run(experiment_id, run_name=out_dir.name, tags={"atscale.kind": "scale-fit"})
        result.parent_run_id = run.info.run_id
        client.log_param(run.info.run_id, "from_csv", str(args.from_csv))
        try:
            log_parent(client, result)
        finally:
            client.set_terminated(run.info.run_id, "FINISHED")
    return result


# ----------------------------------------------------------------------------- output
def write_outputs(result: ScaleResult) -> None:
    """``scaling.csv``, ``scaling.json`` and ``scaling.png`` in the output directory."""
    with open(result.out_dir / "scaling.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        columns = ["devices", "throughput", "speedup", "efficiency", "karp_flatt", "per_device_batch",
                   "global_batch", "step_s", "serial_fraction", "predicted_speedup_from_serial_fraction", "run_id"]
        writer.writerow(columns)
        for p in result.points:
            predicted = "" if p.serial_fraction is None else f"{amdahl_speedup(p.devices, p.serial_fraction):.6g}"
            writer.writerow([p.devices, f"{p.throughput:.6g}", f"{p.speedup:.6g}", f"{p.efficiency:.6g}",
                             "" if math.isnan(p.karp_flatt) else f"{p.karp_flatt:.6g}",
                             p.per_device_batch or "", p.global_batch or "",
                             "" if p.step_s is None else f"{p.step_s:.6g}",
                             "" if p.serial_fraction is None else f"{p.serial_fraction:.6g}", predicted,
                             p.run_id or ""])
    (result.out_dir / "scaling.json").write_text(json.dumps(result.as_dict(), indent=2))
    plot_scaling(result, result.out_dir / "scaling.png")


def plot_scaling(result: ScaleResult, path: Path) -> Path:
    """Write :func:`scaling_figure` as a PNG."""
    scaling_figure(result).savefig(path, dpi=100)
    return path


def scaling_figure(result: ScaleResult) -> Any:
    """Measured speedups, ideal, the fitted Amdahl, Gustafson and USL curves, and USL's N*.

    Both axes are logarithmic (base 2) with plain numbers as tick labels: 1, 2, 4, 8, 16, not 2⁰ ... 2⁴.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fits = result.fits
    n_max_measured = max(p.devices for p in result.points)
    peak = fits.usl.peak_n
    top = max(16, 4 * n_max_measured, int(min(peak, 1024) * 1.5) if math.isfinite(peak) else 0)
    grid = np.unique(np.round(np.geomspace(1, top, 200)))
    fig = Figure(figsize=(8, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.plot(grid, grid, color="0.6", linestyle=":", label="ideal (C = N)")
    ax.plot(grid, amdahl_speedup(grid, fits.amdahl.serial_fraction), color="#4c72b0",
            label=f"Amdahl, s = {fits.amdahl.serial_fraction:.3f} (R² {fits.amdahl.r_squared:.3f})")
    ax.plot(grid, gustafson_speedup(grid, fits.gustafson.serial_fraction), color="#55a868", linestyle="--",
            label=f"Gustafson, s = {fits.gustafson.serial_fraction:.3f}")
    ax.plot(grid, usl_speedup(grid, fits.usl.a, fits.usl.b), color="#c44e52",
            label=f"USL, a = {fits.usl.a:.3g}, b = {fits.usl.b:.3g}")
    if math.isfinite(peak) and peak > 1:
        ax.axvline(peak, color="#c44e52", linestyle="-.", linewidth=1)
        ax.plot([peak], [fits.usl.peak_speedup], marker="D", color="#c44e52", linestyle="none")
        ax.annotate(f"USL peak N* = {peak:.1f}\n(x{fits.usl.peak_speedup:.2f})", (peak, fits.usl.peak_speedup),
                    textcoords="offset points", xytext=(6, 6), color="#c44e52")
    for check in result.prediction_checks():
        ax.plot([check["devices"]], [check["predicted_speedup"]], marker="x", color="#8172b3", linestyle="none",
                markersize=9, label=f"predicted by StepTiming's s at N={check['devices']}")
    ax.plot([p.devices for p in result.points], [p.speedup for p in result.points], "o", color="black",
            markersize=7, label="measured", zorder=5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("devices N")
    ax.set_ylabel("speedup C(N) = throughput(N) / throughput(1)")
    ax.set_title(f"{result.mode} scaling — measured up to N = {n_max_measured}; "
                 + ("no speedup measured" if no_speedup(result.points) else "beyond is prediction"))
    ax.legend(fontsize="small", loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    return fig


def log_parent(client: mlflow.MlflowClient, result: ScaleResult) -> None:
    """The fit as metrics (speedup and throughput stepped by N) and the outputs as artifacts."""
    run_id = result.parent_run_id
    assert run_id is not None
    fits = result.fits
    now = int(time.time() * 1000)
    metrics = []
    for p in result.points:
        for key, value in (("scale/throughput", p.throughput), ("scale/speedup", p.speedup),
                           ("scale/efficiency", p.efficiency)):
            metrics.append(mlflow.entities.Metric(key, value, now, p.devices))
    summary = {"scale/amdahl_serial_fraction": fits.amdahl.serial_fraction, "scale/amdahl_r2": fits.amdahl.r_squared,
               "scale/gustafson_serial_fraction": fits.gustafson.serial_fraction, "scale/usl_a": fits.usl.a,
               "scale/usl_b": fits.usl.b, "scale/usl_peak_n": fits.usl.peak_n}
    for check in result.prediction_checks():
        summary[f"scale/predicted_speedup_{check['devices']}"] = check["predicted_speedup"]
    metrics += [mlflow.entities.Metric(k, v, now, 0) for k, v in summary.items() if math.isfinite(v)]
    client.log_batch(run_id, metrics=metrics)
    client.set_tag(run_id, "atscale.best_law", fits.best)
    for name in ("scaling.csv", "scaling.png", "scaling.json"):
        client.log_artifact(run_id, str(result.out_dir / name))


def print_report(result: ScaleResult, console: Console) -> None:
    """The measured points, the fits and the prediction check as rich tables."""
    fits = result.fits
    batches = any(p.per_device_batch for p in result.points)
    table = Table(title=f"{result.mode} scaling", caption="* predicted by the fits, not measured")
    columns = ["N", *(["batch/dev", "global"] if batches else []), "samples/s", "speedup", "effic.", "K-F e",
               "Amdahl", "USL"]
    for column in columns:
        table.add_column(column, justify="right")
    for p in result.points:
        table.add_row(str(p.devices), *([str(p.per_device_batch), str(p.global_batch)] if batches else []),
                      f"{p.throughput:,.1f}", f"x{p.speedup:.3f}", f"{p.efficiency:.1%}",
                      "-" if math.isnan(p.karp_flatt) else f"{p.karp_flatt:.3f}",
                      f"x{fits.amdahl.predict(p.devices):.3f}", f"x{fits.usl.predict(p.devices):.3f}")
    n_max = max(p.devices for p in result.points)
    for n in (2 * n_max, 4 * n_max, 8 * n_max):
        blanks = [""] * (len(columns) - 3)
        table.add_row(f"{n}*", *blanks, f"x{fits.amdahl.predict(n):.3f}", f"x{fits.usl.predict(n):.3f}", style="dim")
    console.print(table)
    laws = Table(title="fitted laws", show_header=False)
    laws.add_column("law", style="cyan")
    laws.add_column("fit")
    ceiling = "inf" if math.isinf(fits.amdahl.ceiling) else f"x{fits.amdahl.ceiling:.2f}"
    laws.add_row("Amdahl", f"s = {fits.amdahl.serial_fraction:.4f}, ceiling {ceiling}, R² {fits.amdahl.r_squared:.4f}")
    laws.add_row("Gustafson", f"s = {fits.gustafson.serial_fraction:.4f}, R² {fits.gustafson.r_squared:.4f}")
    peak = "none (keeps rising)" if math.isinf(fits.usl.peak_n) else \
        f"N* = {fits.usl.peak_n:.1f} (x{fits.usl.peak_speedup:.2f})"
    laws.add_row("USL", f"a = {fits.usl.a:.4g}, b = {fits.usl.b:.4g}, peak {peak}, R² {fits.usl.r_squared:.4f}")
    laws.add_row("best", fits.best + (" (underdetermined: see note)" if fits.underdetermined else ""))
    if result.fit_note:
        laws.add_row("note", result.fit_note)
    for note in result.notes:
        laws.add_row("measured", note)
    for check in result.prediction_checks():
        laws.add_row(f"check N={check['devices']}",
                     f"StepTiming's serial fraction of the N={check['devices']} run, s = "
                     f"{check['serial_fraction']:.3f}, predicts x{check['predicted_speedup']:.3f}; "
                     f"the sweep measured x{check['measured_speedup']:.3f}")
    laws.add_row("outputs", f"{result.out_dir}/scaling.csv, scaling.png, scaling.json")
    if result.parent_run_id:
        laws.add_row("mlflow", f"parent run {result.parent_run_id}")
    console.print(laws)


# -------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", action="append", help="recipe YAML (repeatable, as for recipes.fit)")
    parser.add_argument("--devices", default="1,2", help="device counts to run, comma-separated, incl. 1")
    parser.add_argument("--mode", choices=("strong", "weak"), default="strong",
                        help="strong: fixed global batch; weak: fixed per-device batch")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps not counted in throughput")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="global (strong) or per-device (weak) batch; default: the config's")
    parser.add_argument("--strategy", default="ddp", help="trainer.strategy for N > 1")
    parser.add_argument("--experiment", default=None,
                        help="MLflow experiment (default: the config's; 'scale' with --from-csv)")
    parser.add_argument("--runs_root", "--runs-root", dest="runs_root", default="runs", action=_RunsRoot,
                        help="root of the run directories; the sweep's outputs go to <runs_root>/<experiment>/scale-*")
    parser.set_defaults(runs_root_flag="--runs_root")
    parser.add_argument("--out", default=None, help="output directory (default: under --runs_root)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds allowed per training run")
    parser.add_argument("--from-csv", dest="from_csv", default=None,
                        help="fit these measurements (columns devices,throughput) instead of training")
    parser.add_argument("--no-mlflow", dest="no_mlflow", action="store_true", help="--from-csv: log no run")
    parser.add_argument("--json", action="store_true", help="print the fit as JSON (only JSON on stdout)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    console = Console(stderr=False)
    try:
        args, extra = build_parser().parse_known_args(argv)
        if args.steps < 1 or args.warmup < 0 or (args.batch_size is not None and args.batch_size < 1):
            raise UsageError("--steps and --batch-size must be >= 1 and --warmup >= 0")
        if args.from_csv and extra:
            raise UsageError(f"--from-csv trains nothing; unexpected arguments {' '.join(extra)}")
        quiet = Console(stderr=True) if args.json else console
        if args.json:  # only JSON on stdout: MLflow writes "View run ... at: URL" there when a server's run ends
            os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        result = run_from_csv(args, quiet) if args.from_csv else run_sweep(args, extra, quiet)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except (ChildFailed, subprocess.TimeoutExpired) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print_report(result, console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
