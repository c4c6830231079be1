"""Predict gradient all-reduce time per step, and what fp16 or PowerSGD compression would save.

Uses the ring all-reduce model of :mod:`callbacks.analysis.comm_model`,
``T = 2(N-1)/N * S/B + 2(N-1)*a`` with ``S = params x bytes per param``, to answer before
renting N machines how long each step's gradient sync will take on a given network::

    python -m recipes.comm --params 1.5e9 --bytes-per-param 4 --bandwidth-gbps 100 \\
        --latency-us 5 --workers 2,8,64
    python -m recipes.comm --params 1.5e9 --bytes-per-param fp32 --bandwidth-gbps 100 \\
        --workers 2,8,64 --json        # machine-readable rows

It prints, per worker count N: bytes each worker sends (``2(N-1)/N * S``), the predicted time,
the time with fp16 compression (2 bytes/param) and with PowerSGD (``--powersgd-ratio`` of
the bytes, 1% by default), and the savings. Bad values print one line on stderr naming the
value and exit with code 2.

The model counts one all-reduce per step with no overlap with the backward pass: DDP's
buckets each pay the latency term, and overlap hides part of the bandwidth term.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence

from callbacks.analysis.comm_model import bytes_per_element, compression_table, gbps_to_bytes_per_s
from recipes.run.common import ArgumentParser, UsageError, positive_ints

PROG = "python -m recipes.comm"


def _number(flag: str, text: str, *, minimum: float = 0.0, strict: bool = False) -> float:
    """Parse a finite number >= (or >) ``minimum`` for ``flag``, or raise UsageError naming it."""
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{flag}: {text!r} is not a number") from None
    op = ">" if strict else ">="
    if not math.isfinite(value) or (value <= minimum if strict else value < minimum):
        raise UsageError(f"{flag}: {text!r} must be a finite number {op} {minimum:g}")
    return value


def _bytes_per_param(text: str) -> float:
    """Parse ``--bytes-per-param`` as a number > 0 or a dtype name (fp32, bf16, ...)."""
    try:
        float(text)
    except ValueError:
        try:
            return float(bytes_per_element(text))
        except ValueError:
            raise UsageError(
                f"--bytes-per-param: {text!r} is neither a number nor a dtype (fp32, fp16, bf16)"
            ) from None
    return _number("--bytes-per-param", text, strict=True)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (values are parsed as text and checked in :func:`main`).

    Returns:
        The parser.
    """
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--params", required=True, help="number of parameters, e.g. 1.5e9")
    parser.add_argument(
        "--bytes-per-param", default="4", help="bytes per gradient element or dtype name (4 = fp32)"
    )
    parser.add_argument("--bandwidth-gbps", required=True, help="link bandwidth in Gbit/s, e.g. 100")
    parser.add_argument("--latency-us", default="0", help="per-step link latency in microseconds")
    parser.add_argument("--workers", required=True, help="comma-separated worker counts, e.g. 2,8,64")
    parser.add_argument(
        "--powersgd-ratio", default="0.01", help="PowerSGD bytes as a fraction of uncompressed"
    )
    parser.add_argument(
        "--topk-ratio", default="0.01", help="top-k: fraction of the parameters sent, values + indices"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _print_table(inputs: dict[str, float], rows: list[dict[str, float | int]]) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (
        f"Ring all-reduce of {_fmt_bytes(inputs['size_bytes'])} "
        f"({inputs['params']:.4g} params x {inputs['bytes_per_param']:g} B) at "
        f"{inputs['bandwidth_gbps']:g} Gbit/s, latency {inputs['latency_us']:g} us"
    )
    caption = (
        f"per worker: bytes each worker sends, 2(N-1)/N*S; fp16: 2 B/param; "
        f"PSGD: PowerSGD at {inputs['powersgd_ratio']:g} of the bytes; top-k: all-gather of "
        f"{inputs['topk_ratio']:g} of the entries (8 B each); pays off below: the top-k ratio that still beats "
        "the uncompressed all-reduce; saved: ms (% of time)"
    )
    table = Table(title=title, caption=caption)
    for header in ("N", "per worker", "time ms", "fp16 ms", "fp16 saved", "PSGD ms", "PSGD saved", "top-k ms",
                   "top-k pays off below"):
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(
            str(row["workers"]),
            _fmt_bytes(row["bytes_sent_per_worker"]),
            f"{row['time_s'] * 1e3:.2f}",
            f"{row['fp16_time_s'] * 1e3:.2f}",
            f"{row['fp16_saving_s'] * 1e3:.1f} ({row['fp16_saving_frac']:.0%})",
            f"{row['powersgd_time_s'] * 1e3:.2f}",
            f"{row['powersgd_saving_s'] * 1e3:.1f} ({row['powersgd_saving_frac']:.0%})",
            f"{row['topk_time_s'] * 1e3:.2f}",
            f"ratio {row['topk_breakeven_ratio']:.3g}",
        )
    Console(file=sys.stdout).print(table)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv[1:]``.

    Returns:
        0 on success, 2 on a bad value (after one line on stderr naming it).
    """
    try:
        args = build_parser().parse_args(argv)
        params = _number("--params", args.params, strict=True)
        bytes_per_param = _bytes_per_param(args.bytes_per_param)
        bandwidth_gbps = _number("--bandwidth-gbps", args.bandwidth_gbps, strict=True)
        latency_us = _number("--latency-us", args.latency_us)
        workers = positive_ints("--workers", args.workers, "2,8,64")
        ratio = _number("--powersgd-ratio", args.powersgd_ratio, strict=True)
        if ratio > 1:
            raise UsageError(f"--powersgd-ratio: {args.powersgd_ratio!r} must be in (0, 1]")
        topk = _number("--topk-ratio", args.topk_ratio, strict=True)
        if topk > 1:
            raise UsageError(f"--topk-ratio: {args.topk_ratio!r} must be in (0, 1]")
        if not math.isfinite(params * bytes_per_param):
            raise UsageError(f"--params {args.params} x --bytes-per-param {args.bytes_per_param} bytes overflow a "
                             "float: give a real model size (e.g. 1.5e9)")
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    rows = [
        row.as_dict()
        for row in compression_table(
            params,
            bytes_per_param,
            gbps_to_bytes_per_s(bandwidth_gbps),
            latency_us * 1e-6,
            workers,
            powersgd_ratio=ratio,
            topk_ratio=topk,
        )
    ]
    inputs = {
        "params": params,
        "bytes_per_param": bytes_per_param,
        "size_bytes": params * bytes_per_param,
        "bandwidth_gbps": bandwidth_gbps,
        "bandwidth_bytes_per_s": gbps_to_bytes_per_s(bandwidth_gbps),
        "latency_us": latency_us,
        "powersgd_ratio": ratio,
        "topk_ratio": topk,
    }
    overflowed = sorted({k for row in rows for k, v in row.items() if not math.isfinite(v)})
    if overflowed:  # the bytes fit a float, a time or saving computed from them does not
        print(f"error: --params {args.params} with --bandwidth-gbps {args.bandwidth_gbps} and --latency-us "
              f"{args.latency_us} overflow a float in {', '.join(overflowed)}: give a real model size and link",
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"inputs": inputs, "rows": rows}, indent=2, allow_nan=False))
    else:
        _print_table(inputs, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
