"""Compare the runs of an MLflow experiment: what differs between them, and what each reached.

Runs of one kind side by side: the plain runs in one table, each sweep's runs (the children of a parent run,
which is left out) in one of their own. A row per run, best first by ``--metric``: name, status, the metric, the
lift over the linear baseline of its kind (``baseline/linear_acc``, ``..._expected_cost``), wall time and
``cost/usd``; a line names the params that differ. ``--long`` adds the other metrics, the baselines and the
values of the params that differ (a run that logged none, say one that crashed at start, makes none differ):
as columns when they fit the terminal, else a row per param, or each run by what it changes from most runs.
FAILED and KILLED runs are left out, and counted, unless ``--all``.

Examples::

    python -m recipes.compare --experiment digits
    python -m recipes.compare --experiment digits --long          # every metric, and the params' values
    python -m recipes.compare --experiment digits --all          # FAILED and KILLED runs too
    python -m recipes.compare --experiment digits --metric val/loss --plot compare.png
    python -m recipes.compare --experiment digits --metric val/expected_cost   # what mistakes cost (min)
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
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import mlflow
from mlflow.entities import Run

from callbacks.analysis.keys import (
    BASELINE_PREFIX,
    COST_KEY,
    DEFAULT_METRIC,
    KIND_TAG,
    LINEAR_BASELINE_KEY,
    LINEAR_BAYES_COST_BASELINE_KEY,
    LINEAR_COST_BASELINE_KEY,
    MAJORITY_BASELINE_KEY,
    MAJORITY_COST_BASELINE_KEY,
    PARENT_RUN_TAG,
    VAL_PREFIX,
)
from recipes.run.common import (
    ArgumentParser,
    UsageError,
    all_runs,
    check_output_file,
    check_tracking_server,
    get_experiment,
    parse_or_exit,
    run_main,
    tracking_uri,
)

__all__ = ["Comparison", "Group", "RunRow", "compare", "compare_figure", "differing_params", "main", "print_table",
           "short_key", "write_plot"]

#: The (linear, majority) baselines of a metric that is not an accuracy, by the metric's ending.
COST_BASELINES = {
    "bayes_expected_cost": (LINEAR_BAYES_COST_BASELINE_KEY, MAJORITY_COST_BASELINE_KEY),
    "expected_cost": (LINEAR_COST_BASELINE_KEY, MAJORITY_COST_BASELINE_KEY),
}
#: Params that differ between any two runs by construction (the run's own name and directories).
PER_RUN_PARAMS = frozenset({"run_name", "checkpoint.dirpath", "spot.dirpath", "ckpt_path", "fresh"})
#: Runs left out unless ``--all``: they ended without a result.
HIDDEN_STATUSES = ("FAILED", "KILLED")
_LOWER_IS_BETTER = ("loss", "error", "perplexity", "mse", "mae", "rmse", "cost")


def baselines_for(metric: str) -> tuple[str, str]:
    """The (linear, majority) baselines ``metric`` is judged against: ``val/expected_cost`` ->
    ``baseline/linear_expected_cost``, ``baseline/majority_expected_cost``; anything else the accuracies."""
    accuracies = (LINEAR_BASELINE_KEY, MAJORITY_BASELINE_KEY)
    return next((pair for end, pair in COST_BASELINES.items() if metric.endswith(end)), accuracies)


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
        logged_params: whether the run logged any param (a run that failed at start did not).
    """

    run_id: str
    run_name: str
    status: str
    start_time: float
    duration_s: float
    params: dict[str, str | None] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    logged_params: bool = True

    def lift(self, metric: str) -> float | None:
        """``metric`` minus its linear baseline (see :func:`baselines_for`), when the run logged both."""
        linear = baselines_for(metric)[0]
        if metric in self.metrics and linear in self.metrics:
            return self.metrics[metric] - self.metrics[linear]
        return None


def default_mode(metric: str) -> str:
    """``"min"`` for losses, errors and costs (``val/expected_cost``, ``cost/usd``), else ``"max"``."""
    return "min" if any(word in metric.lower() for word in _LOWER_IS_BETTER) else "max"


def short_key(key: str) -> str:
    """A param key without jsonargparse's ``init_args`` levels: ``model.init_args.width`` -> ``model.width``."""
    return ".".join(part for part in key.split(".") if part != "init_args")


def differing_params(params: Sequence[dict[str, str]]) -> list[str]:
    """Keys whose value is not the same in every run that logged params.

    A key one of those runs lacks counts as differing (say, a callback only it added); a run that logged
    no param at all (it failed before the CLI logged its config) makes nothing differ.
    """
    params = [p for p in params if p]
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
        logged_params=bool(run.data.params),
    )


#: The ``atscale.kind`` tags of runs that stand for a group of runs (``recipes.scale``, ``recipes.sweep``), by how
#: the hidden-run note names them.
PARENT_KINDS = {"scale": "scale sweep", "sweep": "sweep"}


@dataclass
class Group:
    """Runs compared among themselves: the experiment's plain runs, or the children of one parent run.

    Args:
        title: what the runs are: ``experiment 'digits'``, ``sweep 'digits-lr'``, ``scale sweep 'scale-...'``.
        rows: its runs, best first (as in :attr:`Comparison.rows`).
        keys: the params that differ among them (see :func:`differing_params`).
    """

    title: str
    rows: list[RunRow]
    keys: list[str]


@dataclass
class Comparison:
    """What :func:`compare` found.

    Args:
        rows: the runs shown, best first by the metric; runs without it come last, newest first.
        keys: the params that differ among them (see :func:`differing_params`).
        mode: ``"max"`` or ``"min"``.
        hidden: runs left out, counted by status (FAILED, KILLED without ``show_all``).
        groups: the same rows, by kind: the plain runs first, then each parent run's children.
    """

    rows: list[RunRow]
    keys: list[str]
    mode: str
    hidden: dict[str, int] = field(default_factory=dict)
    groups: list[Group] = field(default_factory=list)


def _groups(runs: list[Run], parents: dict[str, Run], experiment: str) -> list[tuple[str, list[Run]]]:
    """``runs`` by the parent run they nest under (none first, then by start), each with its title."""
    by_parent: dict[str, list[Run]] = {}
    for run in runs:
        by_parent.setdefault(run.data.tags.get(PARENT_RUN_TAG, ""), []).append(run)
    out = [(f"experiment {experiment!r}", by_parent.pop(""))] if "" in by_parent else []
    for parent_id, members in sorted(by_parent.items(), key=lambda item: min(r.info.start_time for r in item[1])):
        parent = parents.get(parent_id)
        kind = PARENT_KINDS.get(parent.data.tags.get(KIND_TAG, ""), "parent run") if parent else "parent run"
        out.append((f"{kind} {parent.info.run_name if parent else parent_id[:8]!r}", members))
    return out


def compare(client: mlflow.MlflowClient, experiment: str, metric: str, mode: str | None = None,
            tracking_uri: str = "", show_all: bool = False) -> Comparison:
    """The experiment's runs, best first by ``metric``.

    Args:
        client: an MLflow client on the tracking store.
        experiment: the experiment's name.
        metric: the metric to sort by (its final value).
        mode: ``"max"`` or ``"min"``; default :func:`default_mode`.
        tracking_uri: for error messages.
        show_all: also the runs whose status is in :data:`HIDDEN_STATUSES`.

    Returns:
        The :class:`Comparison`.

    Raises:
        UsageError: unknown experiment, an experiment without runs, or a metric no run logged.
    """
    exp = get_experiment(client, experiment, tracking_uri)
    runs = all_runs(client, [exp.experiment_id])
    every_run = {r.info.run_id: r for r in runs}
    if not runs:
        raise UsageError(f"experiment {experiment!r} has no runs.")
    logged = sorted({k for r in runs for k in r.data.metrics if not k.startswith("system/")})
    if metric not in logged:
        raise UsageError(f"metric {metric!r} is not logged by any run of experiment {experiment!r} "
                         f"(logged: {', '.join(logged) if logged else 'none'}).")
    mode = mode or default_mode(metric)
    hidden: dict[str, int] = {}
    if not show_all:
        for run in runs:
            if run.info.status in HIDDEN_STATUSES:
                hidden[run.info.status] = hidden.get(run.info.status, 0) + 1
        runs = [r for r in runs if r.info.status not in HIDDEN_STATUSES]
        # a sweep's parent run summarises its children (which are shown): it is no training run to compare, and
        # its own settings as params would make every param "differ"
        for run in runs:
            label = PARENT_KINDS.get(run.data.tags.get(KIND_TAG, ""))
            if label:
                hidden[label] = hidden.get(label, 0) + 1
        runs = [r for r in runs if r.data.tags.get(KIND_TAG, "") not in PARENT_KINDS]
    keys = differing_params([r.data.params for r in runs])
    now = time.time()
    sign = -1.0 if mode == "max" else 1.0

    def best_first(row: RunRow) -> tuple[bool, float, float]:
        return metric not in row.metrics, sign * row.metrics.get(metric, 0.0), -row.start_time

    groups = []
    for title, members in _groups(runs, every_run, experiment):
        group_keys = differing_params([r.data.params for r in members])
        shown = sorted(set(keys) | set(group_keys))
        groups.append(Group(title, sorted((_row(r, shown, now) for r in members), key=best_first), group_keys))
    rows = sorted((row for group in groups for row in group.rows), key=best_first)
    return Comparison(rows, keys, mode, hidden, groups)


# ----------------------------------------------------------------------------------------------- output


def _num(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def to_json(comparison: Comparison, metric: str, experiment: str, tracking_uri: str) -> dict[str, Any]:
    """The comparison as a JSON-ready dict."""
    return {
        "experiment": experiment,
        "tracking_uri": tracking_uri,
        "metric": metric,
        "mode": comparison.mode,
        "differing_params": comparison.keys,
        "hidden": comparison.hidden,
        "groups": [{"title": g.title, "run_ids": [r.run_id for r in g.rows], "differing_params": g.keys}
                   for g in comparison.groups],
        "runs": [{**asdict(r), "metrics": {k: _num(v) for k, v in r.metrics.items()},
                  "lift_over_linear": _num(r.lift(metric)), "cost_usd": _num(r.metrics.get(COST_KEY))}
                 for r in comparison.rows],
    }


def _metric_columns(rows: list[RunRow], metric: str) -> list[str]:
    logged = {k for r in rows for k in r.metrics}
    others = sorted(k for k in logged if k.startswith(VAL_PREFIX) and k != metric)
    return [metric, *others, *(k for k in baselines_for(metric) if k in logged)]


def _fmt_duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _console() -> Any:
    """A rich console as wide as the terminal, or ``COLUMNS``; 200 columns when piped without ``COLUMNS``."""
    from rich.console import Console

    if sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit():
        return Console()
    return Console(width=200)


def _header(key: str) -> str:
    """A metric's column header, on two lines after its group: ``baseline/linear_acc`` -> ``baseline/⏎linear_acc``."""
    from rich.markup import escape

    return escape(key).replace(BASELINE_PREFIX, f"{BASELINE_PREFIX}\n")


#: The runs table's last columns, left out in this order (after the secondary metrics) when it is too wide.
_EXTRAS = ("cost $", "vs linear", "duration")


def _runs_table(rows: list[RunRow], keys: list[str], columns: list[str], metric: str, title: str,
                omit: Sequence[str] = ()) -> Any:
    """One row per run: #, name, status, the ``keys`` params, the ``columns`` metrics, lift, duration, cost.

    ``omit`` leaves out some of :data:`_EXTRAS`.
    """
    from rich.markup import escape
    from rich.table import Table

    has_cost = "cost $" not in omit and any(COST_KEY in r.metrics for r in rows)
    has_lift = "vs linear" not in omit and any(r.lift(metric) is not None for r in rows)
    has_duration = "duration" not in omit
    table = Table(title=title)
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("run", no_wrap=True)
    table.add_column("status", no_wrap=True)
    for key in keys:
        table.add_column(escape(short_key(key)), no_wrap=True)
    for col in columns:
        table.add_column(_header(col), justify="right", no_wrap=True)
    if has_lift:
        table.add_column("vs linear", justify="right", no_wrap=True)
    if has_duration:
        table.add_column("duration", justify="right", no_wrap=True)
    if has_cost:
        table.add_column("cost $", justify="right", no_wrap=True)
    for i, r in enumerate(rows, 1):
        cells = [str(i), escape(r.run_name), r.status]
        cells += [escape(str(r.params[k])) if r.params.get(k) is not None else "-" for k in keys]
        cells += [f"{r.metrics[c]:.4f}" if c in r.metrics else "-" for c in columns]
        if has_lift:
            lift = r.lift(metric)
            cells.append(f"{lift:+.4f}" if lift is not None else "-")
        if has_duration:
            cells.append(_fmt_duration(r.duration_s))
        if has_cost:
            cells.append(f"{r.metrics[COST_KEY]:,.4f}" if COST_KEY in r.metrics else "-")
        table.add_row(*cells)
    return table


#: ``_usual_values``' mark for a param no two runs share a value of.
VARIES = object()


def _usual_values(rows: list[RunRow], keys: list[str]) -> dict[str, Any]:
    """Each param's value in most runs that logged params (``None``: most did not log it; :data:`VARIES`: no
    value is shared by two runs)."""
    usual: dict[str, Any] = {}
    logged = [r for r in rows if r.logged_params]
    for key in keys:
        counts = Counter(r.params.get(key) for r in logged)
        value, count = counts.most_common(1)[0] if counts else (None, 0)
        usual[key] = value if count >= 2 else VARIES
    return usual


#: A param value longer than this is cut in the tables (``--json`` keeps it whole): a callback's init_args, logged as
#: one JSON param, would fill a screen.
SHOWN_VALUE_CHARS = 60


def _shown(value: object) -> str:
    text = str(value)
    return text if len(text) <= SHOWN_VALUE_CHARS else text[:SHOWN_VALUE_CHARS - 1] + "…"


def _params_tables(rows: list[RunRow], keys: list[str], fits: Any) -> tuple[list[Any], bool]:
    """The differing params for a second table or two, and whether they are shown as changes from most runs.

    When one row per param and one column per run (named ``#1``, ``#2`` ... as in the runs table) fits, that
    is the table. Else, with many runs, columns of repeated ``None``s would hide the one ``auto`` a reader
    looks for: one table gives each param's value in most runs, and a second lists, run by run, only where
    it departs from them.
    """
    from rich.markup import escape
    from rich.table import Table

    grid = Table(title="params that differ")
    grid.add_column("param", no_wrap=True)
    for i, row in enumerate(rows):
        grid.add_column(f"#{i + 1}\n{escape(row.run_name)}", overflow="fold")
    for key in keys:
        grid.add_row(escape(short_key(key)), *(escape(_shown(r.params[key])) if r.params.get(key) is not None
                                               else "-" for r in rows))
    if fits(grid):
        return [grid], False

    usual = _usual_values(rows, keys)
    common = Table(title="params that differ: the value most runs have")
    common.add_column("param", no_wrap=True)
    common.add_column("most runs", overflow="fold")
    for key in keys:
        shown = "(no two runs agree)" if usual[key] is VARIES else "-" if usual[key] is None else _shown(usual[key])
        common.add_row(escape(short_key(key)), escape(shown))
    changes = Table(title="what each run changes")
    changes.add_column("#", justify="right", no_wrap=True)
    changes.add_column("run", no_wrap=True)
    changes.add_column("params unlike most runs", overflow="fold")
    for i, row in enumerate(rows):
        if not row.logged_params:
            departs = "(logged no params)"
        else:  # a param this run did not log is no change it made (say, the string form of a class it set)
            departs = ", ".join(f"{short_key(k)}={_shown(row.params[k])}" for k in keys
                                if row.params.get(k) is not None and row.params[k] != usual[k]) or "(none)"
        changes.add_row(str(i + 1), escape(row.run_name), escape(departs))
    return [common, changes], True


#: Param names the default view lists under a table (``--long`` gives them all, with their values).
SHOWN_PARAM_NAMES = 8


def print_table(comparison: Comparison, metric: str, experiment: str, console: Any = None, long: bool = False) -> None:
    """Print the comparison, a table per group of runs (:attr:`Comparison.groups`), as wide as the console
    allows and never cut off (as the module docstring says; with ``long``, the runs table leaves the params, and
    if still too wide the secondary metrics, to the tables after it when they do not fit).
    """
    from rich.measure import Measurement

    console = console or _console()

    def width(table: Any) -> Measurement:
        return Measurement.get(console, console.options.update_width(10_000), table)

    def fits(table: Any) -> bool:  # every cell on one line (the runs table's cells never wrap)
        return width(table).maximum <= console.width

    def fits_wrapped(table: Any) -> bool:  # param values may wrap, at spaces or anywhere (never cut off)
        return width(table).minimum <= console.width

    notes = [] if comparison.groups else ["No runs to show."]
    for group in comparison.groups:
        rows, keys = group.rows, group.keys
        title = f"{group.title}: {len(rows)} run{'s' if len(rows) != 1 else ''} by {metric} ({comparison.mode})"
        columns = _metric_columns(rows, metric) if long else [metric]
        table = _runs_table(rows, keys if long else [], columns, metric, title)
        params_apart = long and not fits(table)
        dropped: list[str] = []
        omit: list[str] = []
        if params_apart or not fits(table):
            table = _runs_table(rows, [], columns, metric, title)
            while not fits(table) and (len(columns) > 1 or len(omit) < len(_EXTRAS)):
                if len(columns) > 1:
                    dropped.insert(0, columns.pop())
                else:
                    omit.append(_EXTRAS[len(omit)])
                table = _runs_table(rows, [], columns, metric, title, omit)
        console.print(table)
        as_changes = False
        if params_apart:
            params_tables, as_changes = _params_tables(rows, keys, fits_wrapped)
            for params in params_tables:
                console.print(params)
        group_notes = []
        if dropped or omit:
            group_notes.append(f"Not shown at {console.width} columns: {', '.join(dropped + omit)} "
                               f"({'' if long else '--long, '}--json {'has' if long else 'have'} them).")
        if not keys:
            group_notes.append("These runs share all their params.")
        elif long:
            group_notes.append("Params: only those that differ among these runs"
                               + ("; each run by what it changes from most runs." if as_changes else "."))
        else:
            names = ", ".join(short_key(k) for k in keys[:SHOWN_PARAM_NAMES])
            more = f" and {len(keys) - SHOWN_PARAM_NAMES} more" if len(keys) > SHOWN_PARAM_NAMES else ""
            group_notes.append(f"Params that differ: {names}{more} (--long shows their values).")
        silent = [r.run_name for r in rows if not r.logged_params]
        if silent:
            group_notes.append(f"{', '.join(silent)} logged no params.")
        for note in group_notes:
            console.print(note, markup=False, highlight=False)
    for status, count in comparison.hidden.items():
        one = count == 1
        notes.append(f"{count} {status} run{'' if one else 's'} hidden (--all shows {'it' if one else 'them'}).")
    for note in notes:
        console.print(note, markup=False, highlight=False)


def _time_unit(seconds: Sequence[float]) -> tuple[float, str]:
    longest = max(seconds, default=0.0)
    return (1.0, "s") if longest < 120 else (60.0, "min") if longest < 7200 else (3600.0, "h")


def compare_figure(rows: list[RunRow], metric: str) -> Any:
    """The metric per run as bars with each run's baselines, and the metric against cost (or wall time).

    Against cost only when the costs differ; when every run cost the same (say $0 on your own machine)
    the second panel is against wall time, and its title says what every run cost.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shown = [r for r in rows if metric in r.metrics]
    names = [r.run_name for r in shown]
    values = [r.metrics[metric] for r in shown]
    fig = Figure(figsize=(max(8.0, 1.2 * len(shown) + 5), 4.5), layout="tight")
    FigureCanvasAgg(fig)
    bars, scatter = fig.subplots(1, 2)
    xs = range(len(shown))
    bars.bar(xs, values, color="tab:blue", label=metric)
    for key, style in zip(baselines_for(metric), ("tab:red", "tab:gray"), strict=True):
        pts = [(i, r.metrics[key]) for i, r in enumerate(shown) if key in r.metrics]
        if pts:
            bars.scatter([p[0] for p in pts], [p[1] for p in pts], marker="_", s=600, color=style, label=key)
    bars.set_xticks(list(xs), names, rotation=30, ha="right")
    bars.set_ylabel(metric)
    bars.set_title(f"{metric} by run (best first)")
    bars.legend(loc="best", fontsize=8, framealpha=0.8)
    costs = {r.metrics[COST_KEY] for r in shown if COST_KEY in r.metrics}
    use_cost = len(costs) > 1
    if use_cost:
        xvals = [r.metrics.get(COST_KEY, math.nan) for r in shown]
        scatter.set_xlabel("cost (USD)")
        scatter.set_title(f"{metric} against cost")
    else:
        scale, unit = _time_unit([r.duration_s for r in shown])
        xvals = [r.duration_s / scale for r in shown]
        scatter.set_xlabel(f"wall time ({unit})")
        every = len(costs) == 1 and all(COST_KEY in r.metrics for r in shown)
        same = f"\n(every run cost ${costs.pop():,.2f})" if every else "\n(no cost recorded)" if not costs else ""
        scatter.set_title(f"{metric} against wall time{same}")
    scatter.scatter(xvals, values, color="tab:blue")
    scatter.margins(x=0.25, y=0.15)  # room for the names beside the points
    for x, y, name in zip(xvals, values, names, strict=True):
        scatter.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    scatter.set_ylabel(metric)
    return fig


def write_plot(rows: list[RunRow], metric: str, path: str) -> None:
    """Write :func:`compare_figure` as a PNG."""
    compare_figure(rows, metric).savefig(path, dpi=110)


# ------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m recipes.compare", description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", required=True, help="MLflow experiment name.")
    parser.add_argument("--metric", default=DEFAULT_METRIC, help="Metric to sort by (final value).")
    parser.add_argument("--mode", choices=("max", "min"), default=None,
                        help="Best is max or min (default: min for losses, errors and costs, else max).")
    parser.add_argument("--plot", default=None, metavar="FILE", help="Also write a comparison PNG here.")
    parser.add_argument("--all", action="store_true", dest="show_all",
                        help=f"Also the runs that ended {' or '.join(HIDDEN_STATUSES)} (left out by default).")
    parser.add_argument("--long", action="store_true",
                        help="Every validation metric and baseline, and the values of the params that differ.")
    parser.add_argument("--json", action="store_true", help="Print JSON instead of the table.")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_or_exit(build_parser(), argv)
    return run_main(lambda: _compare_and_show(args))


def _compare_and_show(args: argparse.Namespace) -> int:
    if args.plot:  # before the table: a plot that cannot be written is bad input, not a traceback after it
        check_output_file("--plot", args.plot)
    uri = tracking_uri()
    check_tracking_server(uri)
    client = mlflow.MlflowClient(tracking_uri=uri)
    comparison = compare(client, args.experiment, args.metric, args.mode, uri, show_all=args.show_all)
    if args.plot:
        write_plot(comparison.rows, args.metric, args.plot)
    if args.json:
        print(json.dumps(to_json(comparison, args.metric, args.experiment, uri), indent=2))
    else:
        print_table(comparison, args.metric, args.experiment, long=args.long)
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
