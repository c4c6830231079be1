"""What every atscale tool shares: usage errors and exit codes, an argparse that raises, the tracking
store, run lookups, and the names of the metrics and tags the tools read.

Imports neither torch nor Lightning, and mlflow only inside the functions that need it, so ``compare``,
``promote``, ``plan``, ``scale``, ``reproduce`` and ``comm`` start fast and run where no training stack is
installed.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from recipes.run import tracking
from recipes.run.compat import HelpFormatter

if TYPE_CHECKING:
    import mlflow
    from mlflow.entities import Run

__all__ = [
    "SIGINT_EXIT_CODE",
    "USAGE_EXIT_CODE",
    "ArgumentParser",
    "HelpFormatter",
    "UsageError",
    "check_tracking_server",
    "find_run",
    "get_experiment",
    "parse_or_exit",
    "positive_ints",
    "run_main",
    "tracking_uri",
]

#: Exit status for bad input (as argparse and jsonargparse use for parse errors).
USAGE_EXIT_CODE = 2
#: Exit status after SIGINT (Ctrl-C), as shells report it.
SIGINT_EXIT_CODE = 130

# Metric keys the tools read (logged by the callbacks named beside them).
#: StepTiming: the run's mean seconds per optimizer step.
STEP_KEY = "time/mean/step_s"
#: StepTiming: the run's mean global samples per second.
THROUGHPUT_KEY = "time/mean/samples_per_s"
#: StepTiming: the run's Amdahl serial fraction.
SERIAL_KEY = "amdahl/serial_fraction"
#: CostTracker: dollars the run cost so far.
COST_KEY = "cost/usd"
#: Baselines: the linear model's validation accuracy (what promote's candidate must beat by default).
LINEAR_BASELINE_KEY = "baseline/linear_acc"
#: The default metric of ``compare`` and ``promote``.
DEFAULT_METRIC = "val/acc"

# Environment the CLI reads: set by the launching CLI process for its further ranks, and by the tools.
#: The run name every rank uses.
ENV_RUN_NAME = "ATSCALE_RUN_NAME"
#: The checkpoint every rank resumes from.
ENV_CKPT_PATH = "ATSCALE_CKPT_PATH"
#: The MLflow run every rank logs to.
ENV_MLFLOW_RUN_ID = "ATSCALE_MLFLOW_RUN_ID"
#: JSON object of tags for a new MLflow run (kept out of config.yaml, e.g. ``reproduces=<run id>``).
ENV_RUN_TAGS = "ATSCALE_RUN_TAGS"
#: Set by ``recipes.scale``: the sweep's parent MLflow run, under which this run nests.
ENV_PARENT_RUN_ID = "ATSCALE_MLFLOW_PARENT_RUN_ID"
#: What a launching CLI passes to its ranks: a tool starting a new run must not inherit them.
ENV_FROM_PARENT = (ENV_RUN_NAME, ENV_CKPT_PATH, ENV_MLFLOW_RUN_ID)

# Tags the CLI sets on every run and the tools filter by.
#: Where the run's files live (see :func:`recipes.run.tracking.find_run`).
RUN_DIR_TAG = tracking.RUN_DIR_TAG
#: Set by ``recipes.reproduce`` on a rerun: the id of the run it reproduces.
REPRODUCES_TAG = "reproduces"


class UsageError(Exception):
    """Bad input: reported as one line on stderr, exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    """The argument parser of every tool but ``recipes.fit`` (which is Lightning's, jsonargparse).

    Bad input raises :class:`UsageError` (the tool prints it as one line and exits 2) instead of printing
    the usage; ``--help`` gives each option's default after its help (:class:`HelpFormatter`). argparse, not
    jsonargparse: ``recipes.scale`` and ``recipes.sweep`` pass the options they do not know on to
    ``recipes.fit`` (``parse_known_args``), which jsonargparse refuses by design.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def parse_or_exit(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``; bad input is one line on stderr and ``SystemExit(2)``, as argparse exits."""
    try:
        return parser.parse_args(argv)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(USAGE_EXIT_CODE) from None


def run_main(body: Callable[[], int]) -> int:
    """Run a tool's body; bad input (:class:`UsageError`, a tracking store that cannot be used) and
    Ctrl-C become one line on stderr and their exit codes."""
    try:
        return body()
    except (UsageError, tracking.TrackingError) as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return SIGINT_EXIT_CODE


def positive_ints(flag: str, text: str, example: str = "1,2,4") -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` for ``flag``; :class:`UsageError` naming the item that is not an integer >= 1."""
    out: list[int] = []
    for part in text.split(","):
        item = part.strip()
        if not item.lstrip("-").isdigit():
            raise UsageError(f"{flag}: {item!r} is not an integer >= 1 (expected e.g. {example})")
        if int(item) < 1:
            raise UsageError(f"{flag}: {int(item)} must be >= 1 (expected e.g. {example})")
        out.append(int(item))
    return out


def tracking_uri() -> str:
    """The tracking store's URI (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``), credentials removed."""
    return tracking.tracking_uri()


def check_tracking_server(uri: str, timeout: float = 5.0) -> None:
    """Fail early (:class:`UsageError`) when an HTTP tracking server does not answer its health endpoint."""
    try:
        tracking.check_server(uri, timeout)
    except tracking.TrackingError as err:
        raise UsageError(str(err)) from None


def client(uri: str | None = None) -> tuple[mlflow.MlflowClient, str]:
    """An MLflow client on the tracking store (checked to answer first), and the store's URI."""
    import mlflow

    uri = uri or tracking_uri()
    check_tracking_server(uri)
    return mlflow.MlflowClient(uri), uri


def get_experiment(client: mlflow.MlflowClient, name: str, tracking_uri: str) -> Any:
    """The experiment named ``name``; :class:`UsageError` naming it (and the known ones) if absent."""
    from mlflow.entities import ViewType

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        known = sorted(e.name for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY))
        raise UsageError(f"experiment {name!r} not found at {tracking_uri} (experiments there: "
                         f"{', '.join(known) if known else 'none'}).")
    return experiment


def find_run(client: mlflow.MlflowClient, experiment_ids: Sequence[str], run_name: str) -> Run | None:
    """The newest MLflow run named ``run_name`` in the experiments, or None."""
    quoted = run_name.replace("'", "\\'")
    runs = client.search_runs(list(experiment_ids), filter_string=f"tags.`mlflow.runName` = '{quoted}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def human_duration(seconds: float) -> str:
    """A duration in the unit that fits it: ``"0.046 s"``, ``"22 s"``, ``"34 min"``, ``"8.59 h"``, ``"11.6 d"``.

    Args:
        seconds: The duration (>= 0; ``inf`` or ``nan`` print as ``"-"``).

    Returns:
        Two or three significant digits and a unit: s below a minute, min below an hour, h below two
        days, else d.
    """
    if not math.isfinite(seconds):
        return "-"
    if seconds < 10:
        return f"{seconds:.2g} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        minutes = seconds / 60
        return f"{minutes:.1f} min" if minutes < 10 else f"{minutes:.0f} min"
    if seconds < 48 * 3600:
        hours = seconds / 3600
        return f"{hours:.2f} h" if hours < 10 else f"{hours:.1f} h"
    return f"{seconds / 86400:.1f} d"
