"""The measured points of a scaling sweep (or a user's CSV) and the scaling laws fitted to them.

What :mod:`recipes.scale` measures and reports: one :class:`Point` per device count, the speedups,
efficiencies and Karp-Flatt metrics derived from their throughputs, the Amdahl, Gustafson and USL fits
(:mod:`callbacks.analysis.scaling`), and a note on what the fits are worth (:func:`fit_note`).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from callbacks.analysis.scaling import (
    FitComparison,
    amdahl_speedup,
    compare_fits,
    karp_flatt,
    speedup_from_throughput,
)
from recipes.run.common import UsageError, positive_ints


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
