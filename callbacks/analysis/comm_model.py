"""Ring all-reduce cost model: predict, calibrate and measure gradient communication time.

Data-parallel training spends part of every step all-reducing gradients. With the ring
algorithm (NCCL's default for large messages, and gloo's) each of ``N`` workers sends and
receives ``2(N-1)/N * S`` bytes for an ``S``-byte buffer, in ``2(N-1)`` sequential steps, so
over links of bandwidth ``B`` bytes/s and per-step latency ``a`` seconds::

    T(S, N) = 2(N-1)/N * S/B + 2(N-1) * a

(NCCL tests, ``doc/PERFORMANCE.md``: "bus bandwidth" is ``2(N-1)/N * S / T``.) The bandwidth
term approaches ``2 S/B`` as ``N`` grows: 6 GB over 100 Gbit/s (12.5 GB/s) takes 480 ms at
``N = 2``, 840 ms at ``N = 8`` and tends to 960 ms. This module answers "how long will the
gradient sync take, and what would fp16 or PowerSGD compression save?" both for a CLI
(``python -m recipes.comm``) and for a callback that calibrates ``B`` and ``a`` on the real
process group with :func:`measure_allreduce` and :func:`calibrate`.

It is pure numpy/scipy; torch is imported only inside :func:`measure_allreduce`, so the model
can be used (and copied) without torch or Lightning.

The model counts one all-reduce per step. Real DDP all-reduces gradients in buckets (25 MB
by default), each paying the latency term, and PowerSGD issues two all-reduces (P, then Q)
per bucket; with non-zero latency the estimates here are therefore optimistic by
``(buckets - 1) * 2(N-1) * a``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

__all__ = [
    "CompressionRow",
    "LinkModel",
    "bytes_per_element",
    "bytes_sent_per_worker",
    "calibrate",
    "compression_table",
    "gbps_to_bytes_per_s",
    "measure_allreduce",
    "ring_allreduce_time",
]

_BYTES_PER_ELEMENT: dict[str, int] = {
    "fp64": 8,
    "float64": 8,
    "fp32": 4,
    "float32": 4,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "bf16": 2,
    "bfloat16": 2,
}

FP16_BYTES_PER_PARAM = 2


def _check_workers(workers: int) -> int:
    """Return ``workers`` as an int, or raise ValueError naming it unless it is an integer >= 1."""
    try:
        ok = not isinstance(workers, bool) and float(workers).is_integer() and workers >= 1
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"`workers={workers!r}` must be an integer >= 1.")
    return int(workers)


def _check_finite(name: str, value: float, *, minimum: float = 0.0, strict: bool = False) -> float:
    """Return ``value`` as a float, or raise ValueError naming it if below ``minimum`` or NaN."""
    op = ">" if strict else ">="
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"`{name}={value!r}` must be a number {op} {minimum:g}.") from None
    if math.isnan(number) or (strict and number <= minimum) or (not strict and number < minimum):
        raise ValueError(f"`{name}={value!r}` must be a number {op} {minimum:g}.")
    return number


def bytes_sent_per_worker(size_bytes: float, workers: int) -> float:
    """Bytes each worker sends (and receives) in one ring all-reduce: ``2(N-1)/N * S``.

    Args:
        size_bytes: Size ``S`` of the buffer being reduced, in bytes.
        workers: Number of workers ``N`` in the ring.

    Returns:
        ``2(N-1)/N * S`` bytes; ``0.0`` for a single worker.

    Raises:
        ValueError: If ``size_bytes < 0`` or ``workers`` is not an integer >= 1.
    """
    n = _check_workers(workers)
    s = _check_finite("size_bytes", size_bytes)
    return 2.0 * (n - 1) / n * s


def ring_allreduce_time(
    size_bytes: float, workers: int, bandwidth_bytes_per_s: float, latency_s: float = 0.0
) -> float:
    """Predicted time of a ring all-reduce: ``T = 2(N-1)/N * S/B + 2(N-1)*a``.

    Args:
        size_bytes: Buffer size ``S`` in bytes (parameters x bytes per element).
        workers: Number of workers ``N``; ``N = 1`` costs nothing.
        bandwidth_bytes_per_s: Per-link bandwidth ``B`` in bytes/s (``inf`` allowed: no
            bandwidth cost).
        latency_s: Per-step latency ``a`` in seconds.

    Returns:
        Predicted seconds; ``0.0`` when ``workers == 1``.

    Raises:
        ValueError: If ``workers`` is not an integer >= 1, ``size_bytes < 0``,
            ``bandwidth_bytes_per_s <= 0`` or ``latency_s < 0`` (the message names the value).

    Example::

        >>> round(ring_allreduce_time(6e9, 8, gbps_to_bytes_per_s(100)), 6)
        0.84
    """
    n = _check_workers(workers)
    s = _check_finite("size_bytes", size_bytes)
    b = _check_finite("bandwidth_bytes_per_s", bandwidth_bytes_per_s, strict=True)
    a = _check_finite("latency_s", latency_s)
    if n == 1:
        return 0.0
    return 2.0 * (n - 1) / n * s / b + 2.0 * (n - 1) * a


def gbps_to_bytes_per_s(gbps: float) -> float:
    """Convert a link speed in Gbit/s (decimal, as NICs are sold) to bytes/s.

    Args:
        gbps: Link speed in gigabits per second, e.g. ``100`` for 100 GbE.

    Returns:
        Bytes per second: ``gbps * 1e9 / 8`` (100 Gbit/s -> 12.5e9 B/s).

    Raises:
        ValueError: If ``gbps`` is not a number > 0.
    """
    return _check_finite("gbps", gbps, strict=True) * 1e9 / 8.0


def bytes_per_element(dtype_name: str) -> int:
    """Bytes per element of a floating-point dtype name.

    Args:
        dtype_name: ``"fp32"``/``"float32"`` (4), ``"fp16"``/``"float16"``/``"half"``,
            ``"bf16"``/``"bfloat16"`` (2) or ``"fp64"``/``"float64"`` (8); case-insensitive,
            a ``"torch."`` prefix is accepted.

    Returns:
        The element size in bytes.

    Raises:
        ValueError: If the name is not a known dtype.
    """
    key = str(dtype_name).strip().lower().removeprefix("torch.")
    if key not in _BYTES_PER_ELEMENT:
        known = ", ".join(sorted(_BYTES_PER_ELEMENT))
        raise ValueError(f"`dtype_name={dtype_name!r}` is not a known dtype. Expected one of: {known}.")
    return _BYTES_PER_ELEMENT[key]


@dataclass(frozen=True)
class LinkModel:
    """A link described by bandwidth and latency, predicting ring all-reduce times.

    Args:
        bandwidth_bytes_per_s: Per-link bandwidth ``B`` in bytes/s (> 0; ``inf`` allowed).
        latency_s: Per-step latency ``a`` in seconds (>= 0).
        r_squared: Coefficient of determination of the calibration that produced the model
            (on the times); ``nan`` when the model was not fitted.
        workers: Number of workers the calibration was measured at, if any.

    Raises:
        ValueError: If bandwidth or latency is out of range.

    Example::

        >>> link = LinkModel(gbps_to_bytes_per_s(100), 5e-6)
        >>> round(link.predict(6e9, 2), 5)
        0.48001
    """

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    r_squared: float = math.nan
    workers: int | None = None

    def __post_init__(self) -> None:
        _check_finite("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, strict=True)
        _check_finite("latency_s", self.latency_s)

    def predict(self, size_bytes: float, workers: int) -> float:
        """Predicted all-reduce time of ``size_bytes`` over ``workers`` workers.

        Args:
            size_bytes: Buffer size in bytes.
            workers: Number of workers.

        Returns:
            Seconds, from :func:`ring_allreduce_time`.

        Raises:
            ValueError: As :func:`ring_allreduce_time`.
        """
        return ring_allreduce_time(size_bytes, workers, self.bandwidth_bytes_per_s, self.latency_s)


def calibrate(
    sizes_bytes: Sequence[float], times_s: Sequence[float], workers: int, relative: bool = False
) -> LinkModel:
    """Fit bandwidth and latency to measured all-reduce timings at a fixed ``N``.

    Solves ``T = x1 * (2(N-1)/N * S) + x2 * 2(N-1)`` for ``x1, x2 >= 0`` by non-negative
    least squares (``scipy.optimize.nnls``); ``B = 1/x1`` (``inf`` if ``x1 == 0``) and
    ``a = x2``.

    Timings over sizes that span decades have roughly constant *relative* noise, so plain
    least squares lets the largest sizes decide the latency too. ``relative=True`` divides
    each equation by its measured time (minimizing relative residuals), which recovers the
    latency of small messages much better; R² is reported on the times either way.

    Args:
        sizes_bytes: Buffer sizes that were all-reduced, in bytes.
        times_s: Measured seconds for each size (e.g. medians from :func:`measure_allreduce`).
        workers: The number of workers ``N`` the timings were taken at (>= 2).
        relative: Weight each timing by ``1/T`` (fit relative instead of absolute residuals);
            every time must then be > 0.

    Returns:
        A :class:`LinkModel` with the fitted bandwidth and latency, the R² of the fit on the
        times (``nan`` if all times are equal) and ``workers``.

    Raises:
        ValueError: If the lengths differ, there are fewer than two distinct sizes, a size
            or time is negative or not finite, ``workers < 2``, or every time is zero.
    """
    n = _check_workers(workers)
    if n < 2:
        raise ValueError(f"`workers={workers!r}`: a single worker does no all-reduce; calibrate at N >= 2.")
    s = np.asarray(sizes_bytes, dtype=float).ravel()
    t = np.asarray(times_s, dtype=float).ravel()
    if s.shape != t.shape:
        raise ValueError(f"`sizes_bytes` has {s.size} values but `times_s` has {t.size}; they must match.")
    for name, arr in (("sizes_bytes", s), ("times_s", t)):
        bad = ~np.isfinite(arr) | (arr < 0)
        if bad.any():
            raise ValueError(f"`{name}` holds {float(arr[bad][0])!r}; values must be finite and >= 0.")
    if np.unique(s).size < 2:
        raise ValueError(
            f"`sizes_bytes` has {np.unique(s).size} distinct value(s); at least 2 are needed to separate "
            "bandwidth from latency."
        )
    design = np.column_stack([2.0 * (n - 1) / n * s, np.full_like(s, 2.0 * (n - 1))])
    if relative:
        if (t <= 0).any():
            raise ValueError(f"`times_s` holds {float(t[t <= 0][0])!r}; relative=True needs every time > 0.")
        (x1, x2), _ = nnls(design / t[:, None], np.ones_like(t))
    else:
        (x1, x2), _ = nnls(design, t)
    if x1 == 0 and x2 == 0:
        raise ValueError("`times_s` fit to zero cost (all times zero?); cannot calibrate a link.")
    fitted = design @ np.array([x1, x2])
    ss_res = float(np.sum((t - fitted) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else math.nan
    bandwidth = math.inf if x1 == 0 else 1.0 / float(x1)
    return LinkModel(bandwidth_bytes_per_s=bandwidth, latency_s=float(x2), r_squared=r2, workers=n)


@dataclass(frozen=True)
class CompressionRow:
    """Predicted all-reduce times for one worker count, uncompressed and compressed.

    Attributes:
        workers: Number of workers ``N``.
        size_bytes: Uncompressed gradient bytes ``S`` (params x bytes per param).
        bytes_sent_per_worker: ``2(N-1)/N * S``.
        time_s: Uncompressed predicted time.
        fp16_size_bytes: Bytes with fp16 compression (2 per parameter).
        fp16_time_s: Predicted time with fp16 compression.
        powersgd_size_bytes: Bytes with PowerSGD (``powersgd_ratio * S``).
        powersgd_time_s: Predicted time with PowerSGD.
        topk_size_bytes: Bytes one worker contributes with top-k: ``8 x topk_ratio x params`` (value + index).
        topk_time_s: Predicted time of the top-k all-gather (:func:`topk_allgather_time`).
        topk_breakeven_ratio: Largest top-k ratio that still beats the uncompressed all-reduce at this N
            (:func:`topk_breakeven_ratio`; the selection's compute is not counted).
    """

    workers: int
    size_bytes: float
    bytes_sent_per_worker: float
    time_s: float
    fp16_size_bytes: float
    fp16_time_s: float
    powersgd_size_bytes: float
    powersgd_time_s: float
    topk_size_bytes: float = math.nan
    topk_time_s: float = math.nan
    topk_breakeven_ratio: float = math.nan

    @property
    def fp16_saving_s(self) -> float:
        """Seconds saved by fp16 compression (negative if it costs more)."""
        return self.time_s - self.fp16_time_s

    @property
    def powersgd_saving_s(self) -> float:
        """Seconds saved by PowerSGD compression."""
        return self.time_s - self.powersgd_time_s

    @property
    def fp16_saving_frac(self) -> float:
        """Fraction of the uncompressed time saved by fp16 (0.0 when that time is 0)."""
        return self.fp16_saving_s / self.time_s if self.time_s > 0 else 0.0

    @property
    def powersgd_saving_frac(self) -> float:
        """Fraction of the uncompressed time saved by PowerSGD (0.0 when that time is 0)."""
        return self.powersgd_saving_s / self.time_s if self.time_s > 0 else 0.0

    def as_dict(self) -> dict[str, float | int]:
        """All fields and savings as a plain, JSON-ready dict.

        Returns:
            Field names to values, plus ``fp16_saving_s``, ``fp16_saving_frac``,
            ``powersgd_saving_s`` and ``powersgd_saving_frac``.
        """
        return {
            "workers": self.workers,
            "size_bytes": self.size_bytes,
            "bytes_sent_per_worker": self.bytes_sent_per_worker,
            "time_s": self.time_s,
            "fp16_size_bytes": self.fp16_size_bytes,
            "fp16_time_s": self.fp16_time_s,
            "fp16_saving_s": self.fp16_saving_s,
            "fp16_saving_frac": self.fp16_saving_frac,
            "powersgd_size_bytes": self.powersgd_size_bytes,
            "powersgd_time_s": self.powersgd_time_s,
            "powersgd_saving_s": self.powersgd_saving_s,
            "powersgd_saving_frac": self.powersgd_saving_frac,
            "topk_size_bytes": self.topk_size_bytes,
            "topk_time_s": self.topk_time_s,
            "topk_saving_s": self.time_s - self.topk_time_s,
            "topk_breakeven_ratio": self.topk_breakeven_ratio,
        }


def compression_table(
    params: float,
    bytes_per_param: float,
    bandwidth_bytes_per_s: float,
    latency_s: float,
    workers_list: Sequence[int],
    powersgd_ratio: float = 0.01,
    topk_ratio: float = 0.01,
) -> list[CompressionRow]:
    """Predicted gradient all-reduce time per worker count, with and without compression.

    fp16 compression (``fp16_compress_hook``) sends 2 bytes per parameter whatever the
    gradient dtype. PowerSGD is estimated as an all-reduce of ``powersgd_ratio * S`` bytes;
    its real ratio depends on the rank and the layer shapes (about ``r (m + n) / (m n)`` per
    ``m x n`` matrix) and it pays the latency term at least twice (see the module notes).

    Args:
        params: Number of parameters whose gradients are reduced (>= 0).
        bytes_per_param: Bytes per gradient element as reduced uncompressed (4 for fp32).
        bandwidth_bytes_per_s: Link bandwidth in bytes/s.
        latency_s: Per-step latency in seconds.
        workers_list: Worker counts ``N`` to tabulate (each >= 1).
        powersgd_ratio: PowerSGD bytes as a fraction of the uncompressed bytes, in (0, 1].
        topk_ratio: Fraction of the parameters top-k sends (values + int32 indices), in (0, 1].

    Returns:
        One :class:`CompressionRow` per entry of ``workers_list``, in order.

    Raises:
        ValueError: If any argument is out of range (the message names it).
    """
    p = _check_finite("params", params)
    bpp = _check_finite("bytes_per_param", bytes_per_param, strict=True)
    ratio = _check_finite("powersgd_ratio", powersgd_ratio, strict=True)
    if ratio > 1:
        raise ValueError(f"`powersgd_ratio={powersgd_ratio!r}` must be in (0, 1].")
    topk = _check_finite("topk_ratio", topk_ratio, strict=True)
    if topk > 1:
        raise ValueError(f"`topk_ratio={topk_ratio!r}` must be in (0, 1].")
    link = LinkModel(bandwidth_bytes_per_s, latency_s)
    if len(workers_list) == 0:
        raise ValueError("`workers_list` is empty; give at least one worker count.")
    size = p * bpp
    fp16_size = p * FP16_BYTES_PER_PARAM
    psgd_size = size * ratio
    rows = []
    for workers in workers_list:
        n = _check_workers(workers)
        rows.append(
            CompressionRow(
                workers=n,
                size_bytes=size,
                bytes_sent_per_worker=bytes_sent_per_worker(size, n),
                time_s=link.predict(size, n),
                fp16_size_bytes=fp16_size,
                fp16_time_s=link.predict(fp16_size, n),
                powersgd_size_bytes=psgd_size,
                powersgd_time_s=link.predict(psgd_size, n),
                topk_size_bytes=TOPK_BYTES_PER_ENTRY * topk * p,
                topk_time_s=topk_allgather_time(p, topk, n, bandwidth_bytes_per_s, latency_s),
                topk_breakeven_ratio=topk_breakeven_ratio(p, bpp, n, bandwidth_bytes_per_s, latency_s),
            )
        )
    return rows


#: Bytes top-k sends per selected entry: an fp32 value and an int32 index.
TOPK_BYTES_PER_ENTRY = 8


def topk_allgather_time(params: float, ratio: float, workers: int, bandwidth_bytes_per_s: float,
                        latency_s: float = 0.0) -> float:
    """Time of top-k's exchange: a ring all-gather of ``C = 8 x ratio x params`` bytes from each worker.

    ``T = (N-1) C / B + (N-1) a``: every worker receives every other worker's part, so unlike the
    all-reduce's ``2(N-1)/N S`` the traffic grows with N. 0 on one worker.

    Example: 1e9 params, ratio 0.01, N = 8, 12.5 GB/s, no latency: C = 80 MB, T = 7 x 80 MB / 12.5 GB/s = 44.8 ms
    (the fp32 all-reduce of the same model: 2 x 7/8 x 4 GB / 12.5 GB/s = 560 ms).
    """
    n = _check_workers(workers)
    size = TOPK_BYTES_PER_ENTRY * _check_finite("ratio", ratio) * _check_finite("params", params)
    bw = _check_finite("bandwidth_bytes_per_s", bandwidth_bytes_per_s, strict=True)
    return (n - 1) * size / bw + (n - 1) * _check_finite("latency_s", latency_s)


def topk_breakeven_ratio(params: float, bytes_per_param: float, workers: int, bandwidth_bytes_per_s: float,
                         latency_s: float = 0.0) -> float:
    """The top-k ratio below which its all-gather beats the uncompressed ring all-reduce on N workers.

    Solving ``(N-1) 8 r P / B + (N-1) a < 2 (N-1)/N b P / B + 2 (N-1) a`` (b: bytes per parameter)
    for r: ``r* = b / (4 N) + a B / (8 P)``. fp32 on 8 workers without latency: r* = 1/8; on 64: 1/64.
    Capped at 1; ``inf`` params-free corner cases are not defined (P must be > 0). The time to select
    the top-k entries is not in this model (on a CPU it can exceed the communication saved).
    """
    n = _check_workers(workers)
    p = _check_finite("params", params, strict=True)
    b = _check_finite("bytes_per_param", bytes_per_param, strict=True)
    bw = _check_finite("bandwidth_bytes_per_s", bandwidth_bytes_per_s, strict=True)
    if n == 1:
        return 1.0
    return min(1.0, b / (4 * n) + _check_finite("latency_s", latency_s) * bw / (TOPK_BYTES_PER_ENTRY * p))


def measure_allreduce(
    sizes_bytes: Sequence[float], repeats: int = 5, warmup: int = 2, group: object | None = None
) -> list[tuple[int, float]]:
    """Time real ``torch.distributed.all_reduce`` calls on float32 tensors of given sizes.

    Must be called on every rank of an initialized process group (it is a collective).
    Each timing is preceded by a barrier, so ranks start together; on CUDA (NCCL) the device
    is synchronized before the clock stops. Per size the median of ``repeats`` timings is
    taken, then the maximum of the medians over ranks, so every rank returns the same list.

    Args:
        sizes_bytes: Buffer sizes in bytes; each is rounded down to whole float32 elements
            (at least one element, i.e. >= 4 bytes).
        repeats: Timed all-reduces per size (>= 1).
        warmup: Untimed all-reduces per size before timing (>= 0).
        group: Process group to use; ``None`` for the default group.

    Returns:
        ``(size_bytes, seconds)`` per requested size, in order, where ``size_bytes`` is the
        actual tensor size (``4 * elements``).

    Raises:
        RuntimeError: If torch.distributed is unavailable or not initialized.
        ValueError: If a size is below 4 bytes, ``repeats < 1`` or ``warmup < 0``.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("measure_allreduce needs an initialized torch.distributed process group.")
    if isinstance(repeats, bool) or int(repeats) != repeats or repeats < 1:
        raise ValueError(f"`repeats={repeats!r}` must be an integer >= 1.")
    if isinstance(warmup, bool) or int(warmup) != warmup or warmup < 0:
        raise ValueError(f"`warmup={warmup!r}` must be an integer >= 0.")
    numels = []
    for size in sizes_bytes:
        if not math.isfinite(float(size)) or size < 4:
            raise ValueError(f"`sizes_bytes` holds {size!r}; each size must be >= 4 bytes (one float32).")
        numels.append(int(size) // 4)

    use_cuda = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

    def _sync() -> None:
        if use_cuda:
            torch.cuda.synchronize(device)

    medians = []
    for numel in numels:
        tensor = torch.ones(numel, dtype=torch.float32, device=device)
        for _ in range(int(warmup)):
            dist.all_reduce(tensor, group=group)
        _sync()
        timings = []
        for _ in range(int(repeats)):
            dist.barrier(group=group)
            _sync()
            start = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            _sync()
            timings.append(time.perf_counter() - start)
        medians.append(statistics.median(timings))
        del tensor

    agreed = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return [(4 * numel, float(sec)) for numel, sec in zip(numels, agreed.tolist(), strict=True)]
