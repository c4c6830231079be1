"""Compare the runs of an MLflow experiment: what differs between them, and what each reached.

One row per run, best first by ``--metric``: the config values that differ between the runs (the
flattened params the CLI logs), the final metrics, the baselines and the lift over the linear one,
the wall time, and the cost where the run logged ``cost/usd``.

Examples::

    python -m recipes.compare --experiment digits
    python -m recipes.compare --experiment digits --metric val/loss --plot compare.png
    python -m recipes.compare --experiment digits --json > runs.json

The tracking store is ``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``. Exit status: 0; 2 on bad
input (an unknown experiment or a metric no run logged: one line on stderr naming it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import mlflow
from mlflow.entities import Run, ViewType

from recipes.cli import DEFAULT_TRACKING_URI, USAGE_EXIT_CODE, UsageError, check_tracking_server

__all__ = ["RunRow", "compare", "differing_params", "main", "print_table", "short_key", "write_plot"]

LINEAR = "baseline/linear_acc"
MAJORITY = "baseline/majority_acc"
COST = "cost/usd"
#: Params that differ between any two runs by construction (the run's own name and directories).
PER_RUN_PARAMS = frozenset({"run_name", "checkpoint.dirpath", "spot.dirpath", "ckpt_path", "fresh"})
_LOWER_IS_BETTER = ("loss", "error", "perplexity", "mse", "mae", "rmse")


@dataclass
class RunRow:
    """One run, as the table shows it.

    Args:
        run_id: MLflow run id.
        run_name: the run's name.
        status: ``FINISHED``, ``RUNNING``, ``FAILED``, ``KILLED``...
        start_time: start, seconds since the epoch.
        duration_s: end minus start (now minus start while running), seconds.
        params: the run's values of the differing params (``None``: not logged by this run).
        metrics: final value of every metric except system metrics.
    """

    run_id: str
    run_name: str
    status: str
    start_time: float
    duration_s: float
    params: dict[str, str | None] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def lift(self, metric: str) -> float | None:
        """``metric`` minus the linear baseline, when the run logged both."""
        if metric in self.metrics and LINEAR in self.metrics:
            return self.metrics[metric] - self.metrics[LINEAR]
        return None


def default_mode(metric: str) -> str:
    """``"min"`` for losses and errors, else ``"max"``."""
    return "min" if any(word in metric.lower() for word in _LOWER_IS_BETTER) else "max"


def short_key(key: str) -> str:
    """A param key without jsonargparse's ``init_args`` levels: ``model.init_args.width`` -> ``model.width``."""
    return ".".join(part for part in key.split(".") if part != "init_args")


def differing_params(params: Sequence[dict[str, str]]) -> list[str]:
    """Keys whose value is not the same in every run (a key some run lacks counts as differing)."""
    keys = sorted(set().union(*params)) if params else []
    return [k for k in keys if k not in PER_RUN_PARAMS and len({p.get(k) for p in params}) > 1]


def _row(run: Run, keys: list[str], now: float) -> RunRow:
    start = run.info.start_time / 1000.0
    end = run.info.end_time / 1000.0 if run.info.end_time else now
    return RunRow(
        run_id=run.info.run_id,
        run_name=run.info.run_name or run.info.run_id[:8],
        status=run.info.status,
        start_time=start,
        duration_s=max(0.0, end - start),
        params={k: run.data.params.get(k) for k in keys},
        metrics={k: float(v) for k, v in run.data.metrics.items() if not k.startswith("system/")},
    )


def get_experiment(client: mlflow.MlflowClient, name: str, tracking_uri: str) -> Any:
    """The experiment named ``name``; :class:`UsageError` naming it (and the known ones) if absent."""
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        known = sorted(e.name for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY))
        raise UsageError(f"experiment {name!r} not found at {tracking_uri} (experiments there: "
                         f"{', '.join(known) if known else 'none'}).")
    return experiment


def compare(client: mlflow.MlflowClient, experiment: str, metric: str, mode: str | None = None,
            tracking_uri: str = "") -> tuple[list[RunRow], list[str], str]:
    """The experiment's runs, best first by ``metric``.

    Args:
        client: an MLflow client on the tracking store.
        experiment: the experiment's name.
        metric: the metric to sort by (its final value).
        mode: ``"max"`` or ``"min"``; default :func:`default_mode`.
        tracking_uri: for error messages.

    Returns:
        ``(rows, differing param keys, mode)``; runs without the metric come last, newest first.

    Raises:
        UsageError: unknown experiment, an experiment without runs, or a metric no run logged.
    """
    exp = get_experiment(client, experiment, tracking_uri)
    runs = client.search_runs([exp.experiment_id], run_view_type=ViewType.ACTIVE_ONLY, max_results=5000)
    if not runs:
        raise UsageError(f"experiment {experiment!r} has no runs.")
    logged = sorted({k for r in runs for k in r.data.metrics if not k.startswith("system/")})
    if metric not in logged:
        raise UsageError(f"metric {metric!r} is not logged by any run of experiment {experiment!r} "
                         f"(logged: {', '.join(logged) if logged else 'none'}).")
    mode = mode or default_mode(metric)
    keys = differing_params([r.data.params for r in runs])
    rows = [_row(r, keys, time.time()) for r in runs]
    sign = -1.0 if mode == "max" else 1.0
    rows.sort(key=lambda r: (metric not in r.metrics, sign * r.metrics.get(metric, 0.0), -r.start_time))
    return rows, keys, mode


# ----------------------------------------------------------------------------------------------- output


def _num(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def to_json(rows: list[RunRow], keys: list[str], metric: str, mode: str, experiment: str,
            tracking_uri: str) -> dict[str, Any]:
    """The comparison as a JSON-ready dict."""
    return {
        "experiment": experiment,
        "tracking_uri": tracking_uri,
        "metric": metric,
        "mode": mode,
        "differing_params": keys,
        "runs": [{**asdict(r), "metrics": {k: _num(v) for k, v in r.metrics.items()},
                  "lift_over_linear": _num(r.lift(metric)), "cost_usd": _num(r.metrics.get(COST))} for r in rows],
    }


def _metric_columns(rows: list[RunRow], metric: str) -> list[str]:
    logged = {k for r in rows for k in r.metrics}
    others = sorted(k for k in logged if k.startswith("val/") and k != metric)
    return [metric, *others, *(k for k in (LINEAR, MAJORITY) if k in logged)]


def _fmt_duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def print_table(rows: list[RunRow], keys: list[str], metric: str, mode: str, experiment: str) -> None:
    """Print the comparison as a rich table, best run first."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    columns = _metric_columns(rows, metric)
    has_cost = any(COST in r.metrics for r in rows)
    has_lift = any(r.lift(metric) is not None for r in rows)
    table = Table(title=f"experiment {experiment!r}: {len(rows)} runs by {metric} ({mode})",
                  caption="params: only those that differ between the runs" if keys else "all runs share their params")
    table.add_column("#", justify="right")
    table.add_column("run")
    table.add_column("status")
    for key in keys:
        table.add_column(escape(short_key(key)))
    for col in columns:
        table.add_column(escape(col), justify="right")
    if has_lift:
        table.add_column("vs linear", justify="right")
    table.add_column("duration", justify="right")
    if has_cost:
        table.add_column("cost $", justify="right")
    for i, r in enumerate(rows, 1):
        cells = [str(i), escape(r.run_name), r.status]
        cells += [escape(str(r.params[k])) if r.params.get(k) is not None else "-" for k in keys]
        cells += [f"{r.metrics[c]:.4f}" if c in r.metrics else "-" for c in columns]
        if has_lift:
            lift = r.lift(metric)
            cells.append(f"{lift:+.4f}" if lift is not None else "-")
        cells.append(_fmt_duration(r.duration_s))
        if has_cost:
            cells.append(f"{r.metrics[COST]:,.4f}" if COST in r.metrics else "-")
        table.add_row(*cells)
    console.print(table)


def write_plot(rows: list[RunRow], metric: str, path: str) -> None:
    """A PNG: the metric per run as bars with each run's baselines, and the metric against wall time (or cost)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if metric in r.metrics]
    names = [r.run_name for r in shown]
    values = [r.metrics[metric] for r in shown]
    fig, (bars, scatter) = plt.subplots(1, 2, figsize=(max(8.0, 1.2 * len(shown) + 5), 4.5))
    xs = range(len(shown))
    bars.bar(xs, values, color="tab:blue", label=metric)
    for key, style in ((LINEAR, "tab:red"), (MAJORITY, "tab:gray")):
        pts = [(i, r.metrics[key]) for i, r in enumerate(shown) if key in r.metrics]
        if pts:
            bars.scatter([p[0] for p in pts], [p[1] for p in pts], marker="_", s=600, color=style, label=key)
    bars.set_xticks(list(xs), names, rotation=30, ha="right")
    bars.set_ylabel(metric)
    bars.set_title(f"{metric} by run (best first)")
    bars.legend(loc="best", fontsize=8, framealpha=0.8)
    use_cost = any(COST in r.metrics for r in shown)
    xvals = [r.metrics.get(COST, math.nan) if use_cost else r.duration_s / 60 for r in shown]
    scatter.scatter(xvals, values, color="tab:blue")
    for x, y, name in zip(xvals, values, names, strict=True):
        scatter.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    scatter.set_xlabel("cost (USD)" if use_cost else "wall time (min)")
    scatter.set_ylabel(metric)
    scatter.set_title(f"{metric} against {'cost' if use_cost else 'time'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m recipes.compare", description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", required=True, help="MLflow experiment name.")
    parser.add_argument("--metric", default="val/acc", help="Metric to sort by (final value). Default val/acc.")
    parser.add_argument("--mode", choices=("max", "min"), default=None,
                        help="Best is max or min (default: min for losses and errors, else max).")
    parser.add_argument("--plot", default=None, metavar="FILE", help="Also write a comparison PNG here.")
    parser.add_argument("--json", action="store_true", help="Print JSON instead of the table.")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    uri = os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_TRACKING_URI)
    try:
        check_tracking_server(uri)
        client = mlflow.MlflowClient(tracking_uri=uri)
        rows, keys, mode = compare(client, args.experiment, args.metric, args.mode, uri)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE_EXIT_CODE
    if args.plot:
        write_plot(rows, args.metric, args.plot)
    if args.json:
        print(json.dumps(to_json(rows, keys, args.metric, mode, args.experiment, uri), indent=2))
    else:
        print_table(rows, keys, args.metric, mode, args.experiment)
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
