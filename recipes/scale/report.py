"""What a scaling sweep leaves: ``scaling.csv``, ``scaling.json``, ``scaling.png`` (the measured speedups
and the fitted laws), the fit logged to the sweep's MLflow parent run, and the tables on the terminal.
"""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
from rich.console import Console
from rich.table import Table

from callbacks.analysis import keys
from callbacks.analysis.scaling import amdahl_speedup, gustafson_speedup, usl_speedup
from recipes.scale.points import ScaleResult, no_speedup


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
        for key, value in ((keys.SCALE_THROUGHPUT_KEY, p.throughput), (keys.SCALE_SPEEDUP_KEY, p.speedup),
                           (keys.SCALE_EFFICIENCY_KEY, p.efficiency)):
            metrics.append(mlflow.entities.Metric(key, value, now, p.devices))
    usl_a, usl_b = keys.SCALE_USL_KEYS
    summary = {keys.SCALE_SERIAL_KEY: fits.amdahl.serial_fraction, keys.SCALE_AMDAHL_R2_KEY: fits.amdahl.r_squared,
               keys.SCALE_GUSTAFSON_KEY: fits.gustafson.serial_fraction, usl_a: fits.usl.a, usl_b: fits.usl.b,
               keys.SCALE_USL_PEAK_KEY: fits.usl.peak_n}
    for check in result.prediction_checks():
        summary[keys.scale_predicted_speedup_key(check["devices"])] = check["predicted_speedup"]
    metrics += [mlflow.entities.Metric(k, v, now, 0) for k, v in summary.items() if math.isfinite(v)]
    client.log_batch(run_id, metrics=metrics)
    client.set_tag(run_id, keys.BEST_LAW_TAG, fits.best)
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
