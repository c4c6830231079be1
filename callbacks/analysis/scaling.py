"""Scaling laws for data-parallel speedup: Amdahl, Gustafson and the Universal Scalability Law.

Given measured speedups ``C(N)`` (throughput on ``N`` devices over throughput on one), these
fits say what more devices would buy:

- Amdahl: ``C(N) = 1/(s + (1-s)/N)``; a serial fraction ``s`` caps speedup at ``1/s``.
  Fitted by least squares through the origin of ``1/C - 1/N = s (1 - 1/N)``; per point the
  Karp-Flatt metric ``e = (1/C - 1/N)/(1 - 1/N)`` is the experimentally determined serial
  fraction (a rising ``e`` means overhead grows with ``N``, not a fixed serial part).
- Gustafson: ``C(N) = N - s(N-1)``, scaled speedup when the work grows with ``N``.
- Universal Scalability Law (Gunther): ``C(N) = N/(1 + a(N-1) + b N(N-1))``; contention
  ``a`` and coherency ``b`` (e.g. all-reduce cost growing with ``N``) give a peak at
  ``N* = sqrt((1-a)/b)``, past which adding devices makes training slower. Fitted by
  non-negative least squares on ``N/C - 1 = a(N-1) + b N(N-1)``.

Pure numpy/scipy (no torch, no Lightning) so a callback and the ``recipes.scale`` CLI share it.
Each fit reports R² on the speedup values themselves, not on the linearized form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import nnls

__all__ = [
    "AmdahlFit",
    "FitComparison",
    "GustafsonFit",
    "USLFit",
    "amdahl_speedup",
    "compare_fits",
    "fit_amdahl",
    "fit_gustafson",
    "fit_usl",
    "gustafson_speedup",
    "karp_flatt",
    "speedup_from_throughput",
    "usl_peak",
    "usl_speedup",
]

FloatOrArray = float | np.ndarray

_R2_TIE = 1e-9  # R² differences below this count as ties


def _out(values: np.ndarray) -> FloatOrArray:
    """Return a 0-d result as a Python float, anything else as an array."""
    return float(values) if np.ndim(values) == 0 else values


def _check_n(n: ArrayLike, name: str = "n") -> np.ndarray:
    """Validate device counts: finite, integral, >= 1."""
    arr = np.asarray(n, dtype=float)
    bad = ~np.isfinite(arr) | (arr < 1) | (arr != np.round(arr))
    if bad.any():
        first = float(arr[bad].ravel()[0])
        raise ValueError(f"`{name}` holds {first!r}; device counts must be integers >= 1.")
    return arr


def _check_speedup(speedup: ArrayLike, name: str = "speedup") -> np.ndarray:
    """Validate speedups: finite and > 0."""
    arr = np.asarray(speedup, dtype=float)
    bad = ~np.isfinite(arr) | (arr <= 0)
    if bad.any():
        raise ValueError(f"`{name}` holds {float(arr[bad].ravel()[0])!r}; speedups must be finite and > 0.")
    return arr


def _check_fraction(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"`{name}={value!r}` must be in [0, 1].")
    return value


def _check_nonneg(name: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"`{name}={value!r}` must be a finite number >= 0.")
    return value


def _pair(n: ArrayLike, speedup: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Validate a (device counts, speedups) pair of 1-d sequences of equal, non-zero length."""
    n_arr = _check_n(np.ravel(n))
    c_arr = _check_speedup(np.ravel(speedup))
    if n_arr.size != c_arr.size:
        raise ValueError(f"`n` has {n_arr.size} values but `speedup` has {c_arr.size}; they must match.")
    if n_arr.size == 0:
        raise ValueError("`n` and `speedup` are empty; give at least one N > 1 measurement.")
    if not (n_arr > 1).any():
        raise ValueError("`n` has no value > 1; a scaling fit needs at least one multi-device measurement.")
    return n_arr, c_arr


def _r_squared(observed: np.ndarray, predicted: np.ndarray) -> float:
    """R² of ``predicted`` against ``observed``; nan when ``observed`` has no variance."""
    ss_res = float(np.sum((observed - predicted) ** 2))
    ss_tot = float(np.sum((observed - observed.mean()) ** 2))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else math.nan


def amdahl_speedup(n: ArrayLike, s: float) -> FloatOrArray:
    """Amdahl's law: ``C(N) = 1/(s + (1-s)/N)``.

    Args:
        n: Device count(s) ``N`` (> 0); scalar or array.
        s: Serial fraction in [0, 1].

    Returns:
        Speedup(s), a float for scalar ``n``, else an array of ``n``'s shape.

    Raises:
        ValueError: If ``s`` is outside [0, 1] or any ``n <= 0``.
    """
    s = _check_fraction("s", s)
    arr = np.asarray(n, dtype=float)
    if (~(arr > 0)).any():
        raise ValueError(f"`n` holds {float(arr[~(arr > 0)].ravel()[0])!r}; device counts must be > 0.")
    return _out(1.0 / (s + (1.0 - s) / arr))


def gustafson_speedup(n: ArrayLike, s: float) -> FloatOrArray:
    """Gustafson's law (scaled speedup): ``C(N) = N - s(N-1)``.

    Args:
        n: Device count(s) ``N``; scalar or array.
        s: Serial fraction in [0, 1].

    Returns:
        Speedup(s), a float for scalar ``n``, else an array.

    Raises:
        ValueError: If ``s`` is outside [0, 1].
    """
    s = _check_fraction("s", s)
    arr = np.asarray(n, dtype=float)
    return _out(arr - s * (arr - 1.0))


def usl_speedup(n: ArrayLike, a: float, b: float) -> FloatOrArray:
    """Universal Scalability Law: ``C(N) = N/(1 + a(N-1) + b N(N-1))``.

    Args:
        n: Device count(s) ``N`` (>= 1); scalar or array.
        a: Contention coefficient (>= 0).
        b: Coherency coefficient (>= 0).

    Returns:
        Speedup(s), a float for scalar ``n``, else an array.

    Raises:
        ValueError: If ``a`` or ``b`` is negative or not finite.
    """
    a = _check_nonneg("a", a)
    b = _check_nonneg("b", b)
    arr = np.asarray(n, dtype=float)
    return _out(arr / (1.0 + a * (arr - 1.0) + b * arr * (arr - 1.0)))


def karp_flatt(n: ArrayLike, speedup: ArrayLike) -> FloatOrArray:
    """Karp-Flatt metric, the experimentally determined serial fraction.

    ``e = (1/C - 1/N)/(1 - 1/N)``; undefined (``nan``) at ``N = 1``. For data that follow
    Amdahl's law exactly, ``e`` equals ``s`` at every ``N``.

    Args:
        n: Device count(s) ``N`` (integers >= 1).
        speedup: Measured speedup(s) ``C`` (> 0), same shape as ``n``.

    Returns:
        The serial fraction per point; a float for scalar input, else an array.

    Raises:
        ValueError: If shapes differ, an ``N`` is not an integer >= 1, or a speedup <= 0.
    """
    n_arr = _check_n(n)
    c_arr = _check_speedup(speedup)
    if n_arr.shape != c_arr.shape:
        raise ValueError(f"`n` has shape {n_arr.shape} but `speedup` has {c_arr.shape}; they must match.")
    with np.errstate(divide="ignore", invalid="ignore"):
        e = (1.0 / c_arr - 1.0 / n_arr) / (1.0 - 1.0 / n_arr)
    e = np.where(n_arr == 1, np.nan, e)
    return _out(e)


@dataclass(frozen=True)
class AmdahlFit:
    """Amdahl's law fitted to measured speedups.

    Attributes:
        serial_fraction: Fitted ``s`` in [0, 1].
        ceiling: Speedup limit ``1/s`` (``inf`` when ``s == 0``).
        r_squared: R² on the speedups (``nan`` if they have no variance).
        n: Device counts fitted.
        speedup: Measured speedups fitted.
        residuals: Measured minus predicted speedup, per point.
        karp_flatt: Karp-Flatt serial fraction per point (``nan`` at ``N = 1``).
    """

    serial_fraction: float
    ceiling: float
    r_squared: float
    n: tuple[float, ...]
    speedup: tuple[float, ...]
    residuals: tuple[float, ...]
    karp_flatt: tuple[float, ...]
    name: str = field(default="amdahl", init=False)

    def predict(self, n: ArrayLike) -> FloatOrArray:
        """Speedup at ``n`` devices under the fitted law.

        Args:
            n: Device count(s) (> 0).

        Returns:
            Predicted speedup(s).
        """
        return amdahl_speedup(n, self.serial_fraction)


@dataclass(frozen=True)
class GustafsonFit:
    """Gustafson's law fitted to measured speedups.

    Attributes:
        serial_fraction: Fitted ``s`` in [0, 1].
        r_squared: R² on the speedups.
        n: Device counts fitted.
        speedup: Measured speedups fitted.
        residuals: Measured minus predicted speedup, per point.
    """

    serial_fraction: float
    r_squared: float
    n: tuple[float, ...]
    speedup: tuple[float, ...]
    residuals: tuple[float, ...]
    name: str = field(default="gustafson", init=False)

    def predict(self, n: ArrayLike) -> FloatOrArray:
        """Speedup at ``n`` devices under the fitted law.

        Args:
            n: Device count(s).

        Returns:
            Predicted speedup(s).
        """
        return gustafson_speedup(n, self.serial_fraction)


@dataclass(frozen=True)
class USLFit:
    """The Universal Scalability Law fitted to measured speedups.

    Attributes:
        a: Contention coefficient (>= 0).
        b: Coherency coefficient (>= 0).
        peak_n: Real-valued ``N`` maximizing speedup on ``N >= 1``: ``sqrt((1-a)/b)``
            (``inf`` when ``b == 0`` and ``a < 1``: speedup rises forever towards ``1/a``;
            ``1.0`` when ``a >= 1`` or the formula gives less than 1: one device is best).
        peak_speedup: Speedup at ``peak_n`` (its limit ``1/a`` when ``peak_n`` is inf).
        r_squared: R² on the speedups.
        n: Device counts fitted.
        speedup: Measured speedups fitted.
        residuals: Measured minus predicted speedup, per point.
    """

    a: float
    b: float
    peak_n: float
    peak_speedup: float
    r_squared: float
    n: tuple[float, ...]
    speedup: tuple[float, ...]
    residuals: tuple[float, ...]
    name: str = field(default="usl", init=False)

    def predict(self, n: ArrayLike) -> FloatOrArray:
        """Speedup at ``n`` devices under the fitted law.

        Args:
            n: Device count(s).

        Returns:
            Predicted speedup(s).
        """
        return usl_speedup(n, self.a, self.b)

    @property
    def best_integer_n(self) -> float:
        """The whole number of devices with the highest predicted speedup (``inf`` if unbounded)."""
        if math.isinf(self.peak_n):
            return math.inf
        lo = max(1.0, math.floor(self.peak_n))
        hi = math.ceil(self.peak_n)
        return hi if self.predict(hi) > self.predict(lo) else lo


def usl_peak(a: float, b: float) -> tuple[float, float]:
    """Peak of the USL curve on ``N >= 1``.

    Args:
        a: Contention coefficient (>= 0).
        b: Coherency coefficient (>= 0).

    Returns:
        ``(peak_n, peak_speedup)``: ``N* = sqrt((1-a)/b)`` and ``C(N*)``; ``(inf, 1/a)`` when
        ``b == 0`` and ``a < 1`` (``1/0 = inf``); ``(1.0, 1.0)`` when ``a >= 1`` or
        ``N* < 1``.

    Raises:
        ValueError: If ``a`` or ``b`` is negative or not finite.
    """
    a = _check_nonneg("a", a)
    b = _check_nonneg("b", b)
    if a >= 1.0:
        return 1.0, 1.0
    if b == 0.0:
        return math.inf, (math.inf if a == 0.0 else 1.0 / a)
    peak = math.sqrt((1.0 - a) / b)
    if peak < 1.0:
        return 1.0, 1.0
    return peak, float(usl_speedup(peak, a, b))


def fit_amdahl(n: ArrayLike, speedup: ArrayLike) -> AmdahlFit:
    """Fit Amdahl's serial fraction by least squares through the origin.

    Minimizes ``sum((1/C - 1/N) - s (1 - 1/N))^2``, i.e.
    ``s = sum(x y)/sum(x^2)`` with ``x = 1 - 1/N``, ``y = 1/C - 1/N``; ``s`` is clipped to
    [0, 1] (superlinear data give ``s = 0``).

    Args:
        n: Device counts (integers >= 1, at least one > 1).
        speedup: Measured speedups (> 0), same length.

    Returns:
        An :class:`AmdahlFit`.

    Raises:
        ValueError: On mismatched lengths, a bad ``N`` or speedup, or no ``N > 1``.
    """
    n_arr, c_arr = _pair(n, speedup)
    x = 1.0 - 1.0 / n_arr
    y = 1.0 / c_arr - 1.0 / n_arr
    s = float(np.clip(np.dot(x, y) / np.dot(x, x), 0.0, 1.0))
    predicted = np.asarray(amdahl_speedup(n_arr, s))
    return AmdahlFit(
        serial_fraction=s,
        ceiling=math.inf if s == 0.0 else 1.0 / s,
        r_squared=_r_squared(c_arr, predicted),
        n=tuple(n_arr.tolist()),
        speedup=tuple(c_arr.tolist()),
        residuals=tuple((c_arr - predicted).tolist()),
        karp_flatt=tuple(np.atleast_1d(karp_flatt(n_arr, c_arr)).tolist()),
    )


def fit_gustafson(n: ArrayLike, speedup: ArrayLike) -> GustafsonFit:
    """Fit Gustafson's serial fraction by least squares on ``C = N - s(N-1)``.

    ``N - C = s (N-1)`` is linear through the origin: ``s = sum((N-1)(N-C))/sum((N-1)^2)``,
    clipped to [0, 1].

    Args:
        n: Device counts (integers >= 1, at least one > 1).
        speedup: Measured speedups (> 0), same length.

    Returns:
        A :class:`GustafsonFit`.

    Raises:
        ValueError: On mismatched lengths, a bad ``N`` or speedup, or no ``N > 1``.
    """
    n_arr, c_arr = _pair(n, speedup)
    x = n_arr - 1.0
    s = float(np.clip(np.dot(x, n_arr - c_arr) / np.dot(x, x), 0.0, 1.0))
    predicted = np.asarray(gustafson_speedup(n_arr, s))
    return GustafsonFit(
        serial_fraction=s,
        r_squared=_r_squared(c_arr, predicted),
        n=tuple(n_arr.tolist()),
        speedup=tuple(c_arr.tolist()),
        residuals=tuple((c_arr - predicted).tolist()),
    )


def fit_usl(n: ArrayLike, speedup: ArrayLike) -> USLFit:
    """Fit the Universal Scalability Law by non-negative least squares.

    Solves ``N/C - 1 = a (N-1) + b N(N-1)`` for ``a, b >= 0`` with ``scipy.optimize.nnls``.
    With fewer than two distinct ``N > 1`` the two parameters are underdetermined (nnls
    returns one of many exact solutions); with exactly two they interpolate the data
    exactly. :func:`compare_fits` reports both cases.

    Args:
        n: Device counts (integers >= 1, at least one > 1).
        speedup: Measured speedups (> 0), same length.

    Returns:
        A :class:`USLFit` with the peak ``N* = sqrt((1-a)/b)``.

    Raises:
        ValueError: On mismatched lengths, a bad ``N`` or speedup, or no ``N > 1``.
    """
    n_arr, c_arr = _pair(n, speedup)
    design = np.column_stack([n_arr - 1.0, n_arr * (n_arr - 1.0)])
    (a, b), _ = nnls(design, n_arr / c_arr - 1.0)
    a, b = float(a), float(b)
    peak_n, peak_speedup = usl_peak(a, b)
    predicted = np.asarray(usl_speedup(n_arr, a, b))
    return USLFit(
        a=a,
        b=b,
        peak_n=peak_n,
        peak_speedup=peak_speedup,
        r_squared=_r_squared(c_arr, predicted),
        n=tuple(n_arr.tolist()),
        speedup=tuple(c_arr.tolist()),
        residuals=tuple((c_arr - predicted).tolist()),
    )


def speedup_from_throughput(devices: ArrayLike, throughput: ArrayLike) -> np.ndarray:
    """Speedups ``C(N) = X(N)/X(1)`` from measured throughputs.

    Args:
        devices: Device count of each measurement (integers >= 1); must include ``N = 1``
            (several ``N = 1`` runs are averaged).
        throughput: Throughput of each measurement (samples/s or tokens/s, > 0).

    Returns:
        Speedup per measurement, in input order.

    Raises:
        ValueError: On mismatched lengths, a bad value, or no ``N = 1`` measurement.
    """
    n_arr = _check_n(np.ravel(devices), "devices")
    x_arr = _check_speedup(np.ravel(throughput), "throughput")
    if n_arr.size != x_arr.size:
        raise ValueError(
            f"`devices` has {n_arr.size} values but `throughput` has {x_arr.size}; they must match."
        )
    base = x_arr[n_arr == 1]
    if base.size == 0:
        raise ValueError(
            f"`devices` {sorted(set(n_arr.astype(int).tolist()))} has no N=1 measurement; speedup is "
            "relative to one device, so measure N=1 too."
        )
    return x_arr / base.mean()


@dataclass(frozen=True)
class FitComparison:
    """Amdahl, Gustafson and USL fitted to the same speedups, and which fits best.

    Attributes:
        amdahl: The Amdahl fit.
        gustafson: The Gustafson fit.
        usl: The USL fit.
        best: Name of the fit with the highest R² (``"amdahl"``, ``"gustafson"`` or ``"usl"``;
            ties, within 1e-9, go to the simpler law, in that order).
        r_squared: R² per fit name.
        distinct_n: Number of distinct device counts measured (including ``N = 1``).
        informative_n: Distinct ``N > 1`` (``N = 1`` carries no information: ``C(1) = 1``).
        underdetermined: True when ``informative_n < 3``: USL's two parameters then fit the
            data exactly (or not uniquely), so its R² is not evidence that it is the right law.
        note: Plain-language caveat about the comparison; empty when there is none.
    """

    amdahl: AmdahlFit
    gustafson: GustafsonFit
    usl: USLFit
    best: str
    r_squared: dict[str, float]
    distinct_n: int
    informative_n: int
    underdetermined: bool
    note: str

    @property
    def best_fit(self) -> AmdahlFit | GustafsonFit | USLFit:
        """The fit object named by :attr:`best`."""
        return getattr(self, self.best)


def compare_fits(n: ArrayLike, speedup: ArrayLike) -> FitComparison:
    """Fit all three laws and say which describes the data best.

    Args:
        n: Device counts (integers >= 1, at least one > 1).
        speedup: Measured speedups (> 0), same length.

    Returns:
        A :class:`FitComparison`. ``best`` is the highest R² (a ``nan`` R² ranks last); the
        ``note`` says when too few distinct ``N`` make the comparison meaningless.

    Raises:
        ValueError: On mismatched lengths, a bad ``N`` or speedup, or no ``N > 1``.
    """
    n_arr, c_arr = _pair(n, speedup)
    fits = {
        "amdahl": fit_amdahl(n_arr, c_arr),
        "gustafson": fit_gustafson(n_arr, c_arr),
        "usl": fit_usl(n_arr, c_arr),
    }
    r2 = {name: fit.r_squared for name, fit in fits.items()}
    ranked = {name: -math.inf if math.isnan(value) else value for name, value in r2.items()}
    top = max(ranked.values())
    # the first (simplest) law within rounding of the top R² wins: a tie is no evidence for USL
    best = next(name for name, value in ranked.items() if value >= top - _R2_TIE)
    distinct = int(np.unique(n_arr).size)
    informative = int(np.unique(n_arr[n_arr > 1]).size)
    if informative == 1:
        note = (
            "Only one device count N > 1 was measured: Amdahl and Gustafson (one parameter each) "
            "fit it exactly and USL's two parameters are not determined. Measure more N before "
            "trusting any extrapolation."
        )
    elif informative == 2:
        note = (
            "Only two device counts N > 1 were measured: USL's two parameters can pass through both "
            "exactly, so its R² says nothing about whether it is the right law. Measure at least "
            "three N > 1."
        )
    else:
        note = ""
    return FitComparison(
        amdahl=fits["amdahl"],
        gustafson=fits["gustafson"],
        usl=fits["usl"],
        best=best,
        r_squared=r2,
        distinct_n=distinct,
        informative_n=informative,
        underdetermined=informative < 3,
        note=note,
    )
