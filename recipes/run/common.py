"""What every atscale tool shares: usage errors and exit codes, an argparse that raises, the tracking
store, and run lookups that page through the whole store.

The names of the metrics and tags the tools read are not here: each is defined once in
:mod:`callbacks.analysis.keys`, which the callbacks that log them import too (the few this module imports are
for the tools that still take them from here).

Imports neither torch nor Lightning, and mlflow only inside the functions that need it, so ``compare``,
``promote``, ``plan``, ``scale``, ``reproduce`` and ``comm`` start fast and run where no training stack is
installed.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import math
import os
import re
import secrets
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from callbacks.analysis.keys import (  # noqa: F401 (the tools import these from here)
    COST_KEY,
    DEFAULT_METRIC,
    LINEAR_BASELINE_KEY,
    REPRODUCES_TAG,
    SERIAL_KEY,
    STEP_KEY,
    THROUGHPUT_KEY,
)
from datamodules.urls import redact as redact_urls
from recipes.run import tracking
from recipes.run.compat import HelpFormatter
from recipes.run.errors import disk_error

if TYPE_CHECKING:
    import mlflow
    from mlflow.entities import Run

__all__ = [
    "NAME_PATTERN",
    "NAME_RULE",
    "SIGINT_EXIT_CODE",
    "USAGE_EXIT_CODE",
    "ArgumentParser",
    "HelpFormatter",
    "UsageError",
    "all_experiments",
    "all_pages",
    "all_runs",
    "check_name",
    "check_output_dir",
    "check_output_file",
    "check_tracking_server",
    "command_run_name",
    "find_run",
    "finite_float",
    "get_experiment",
    "parse_or_exit",
    "positive_ints",
    "quoted",
    "redact_argv",
    "run_main",
    "tracking_uri",
]

#: Exit status for bad input (as argparse and jsonargparse use for parse errors).
USAGE_EXIT_CODE = 2
#: Exit status after SIGINT (Ctrl-C), as shells report it.
SIGINT_EXIT_CODE = 130

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

#: Where the run's files live (see :func:`recipes.run.tracking.find_run`).
RUN_DIR_TAG = tracking.RUN_DIR_TAG


class UsageError(Exception):
    """Bad input: reported as one line on stderr, exit code 2."""


#: What a run or experiment name may be: one path component that stays where it is put (``<runs_root>/<experiment>/
#: <run_name>``, locally and in object storage): a letter or digit, then letters, digits and ``. _ - + = @``.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=@-]{0,127}")
NAME_RULE = ("one name of 1-128 letters, digits and . _ - + = @, starting with a letter or digit (no '/', no '..': "
             "it names a directory inside the runs root)")


def check_name(flag: str, value: object) -> str:
    """``value`` if it is a valid run or experiment name (:data:`NAME_PATTERN`), else :class:`UsageError` naming it.

    The names become directories under the runs root: ``/``, ``..``, ``.`` or an empty name would
    write outside it, into the filesystem root or the working directory, or make the experiment's own
    folder a run directory.
    """
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise UsageError(f"{flag} {value!r} is not a valid name: expected {NAME_RULE}.")
    return value


#: Options that choose how a command starts, not what it trains: a command's run name leaves them out, so the same
#: command with ``--fresh true`` starts *its* run over and with ``--ckpt_path`` continues it from that file.
_START_OPTIONS = ("--run_name", "--fresh", "--ckpt_path")


def command_run_name(args: Sequence[str]) -> str:
    """The name of the run a ``recipes.fit`` command trains when it names none: the same command, the same run.

    ``<first config's stem>-<8 hex digits of the arguments>``: a scheduler that relaunches the job's command line
    (a SLURM requeue, a Kubernetes Job restart, a SkyPilot recovery) resumes the run instead of starting another,
    and a finished run relaunched says it is complete. ``--key=value`` and ``--key value`` are one argument; the
    start options (:data:`_START_OPTIONS`) are left out. ``recipes.api.train`` names its runs by this rule from
    the command line it builds, so a cell and the command it stands for share one run.
    """
    words: list[str] = []
    for arg in args:
        words += arg.split("=", 1) if arg.startswith("--") and "=" in arg else [arg]
    kept: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
            continue
        if word in _START_OPTIONS:
            skip = True
            continue
        kept.append(word)
    configs = [kept[i + 1] for i, word in enumerate(kept[:-1]) if word == "--config"]
    stem = re.sub(r"[^A-Za-z0-9._+=@-]", "-", Path(configs[0]).stem).lstrip("._+=@-")[:100] if configs else ""
    digest = hashlib.sha256(json.dumps(kept).encode()).hexdigest()[:8]
    return f"{stem or 'run'}-{digest}"


def finite_float(text: str) -> float:
    """argparse's ``type=float`` in every tool: ``nan`` and ``inf`` are refused (no option means either).

    A NaN passes every ``<``/``>`` check a tool makes after parsing (``nan < 0`` is False) and then poisons the
    arithmetic (a sampler's softmax, a plan's table); an infinity overflows it. Leave the option out for
    "no limit".
    """
    value = float(text)  # not a number: argparse's own "invalid float value: 'x'"
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


class ArgumentParser(argparse.ArgumentParser):
    """The argument parser of every tool but ``recipes.fit`` (which is Lightning's, jsonargparse).

    Bad input raises :class:`UsageError` (the tool prints it as one line and exits 2) instead of printing
    the usage; ``--help`` gives each option's default after its help (:class:`HelpFormatter`). argparse, not
    jsonargparse: ``recipes.scale`` and ``recipes.sweep`` pass the options they do not know on to
    ``recipes.fit`` (``parse_known_args``), which jsonargparse refuses by design.

    Every ``type=float`` option takes finite numbers only (:func:`finite_float`). Once the command line is
    parsed, the passwords of the URLs in ``sys.argv`` are masked (:func:`redact_argv`): a library that prints
    ``sys.argv`` later (LightningCLI warns with it) shows none. The tools pass what they parsed on, never
    ``sys.argv``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("type", float, finite_float)

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        """argparse's, then ``sys.argv`` redacted (:func:`redact_argv`)."""
        args = list(sys.argv[1:] if args is None else args)
        try:
            return super().parse_known_args(args, namespace)
        finally:
            redact_argv()


def redact_argv() -> None:
    """Mask the passwords of the URLs in ``sys.argv``, in place (``s3://AKIA:***@bucket/runs``), once it is parsed.

    A library may print ``sys.argv`` whole (LightningCLI's warning when it is given ``args`` too): the secrets must
    be gone from it before any can. The same redaction as every stored or printed text
    (:func:`recipes.run.tracking.redact`).
    """
    sys.argv[1:] = [tracking.redact(arg) for arg in sys.argv[1:]]


def check_output_file(flag: str, path: str | os.PathLike) -> Path:
    """``path`` as a :class:`~pathlib.Path` if a file can be written there; else :class:`UsageError` naming it.

    Checked before the tool does any work, so that a mistyped ``--plot`` is one line and exit 2 before anything
    is printed, trained or recorded, not a traceback after the table.
    """
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give the file to write.")
    if not target.parent.is_dir():
        raise UsageError(f"{flag} {path}: folder {target.parent} does not exist.")
    _check_writable(flag, path, target.parent)
    return target


def check_output_dir(flag: str, path: str | os.PathLike) -> Path:
    """``path`` as a :class:`~pathlib.Path` if it is, or can be made, a folder to write in; else :class:`UsageError`.

    Nothing is created: the nearest folder that exists (``path`` itself, or the one it would be made in) must
    take new files.
    """
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise UsageError(f"{flag} {path}: is a file, not a folder.")
    existing = target.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag} {path}: {existing} is a file, not a folder.")
    _check_writable(flag, path, existing)
    return target


def _check_writable(flag: str, path: str | os.PathLike, folder: Path) -> None:
    """Create and remove one empty file in ``folder``: the filesystem's own answer (permissions, a read-only mount,
    ``/proc``), which ``os.access`` does not give (root passes every permission check)."""
    probe = folder / f".atscale-write-check-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError as err:
        raise UsageError(f"{flag} {path}: cannot write in {folder} ({err.strerror or err}).") from None
    probe.unlink(missing_ok=True)


def parse_or_exit(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``; bad input is one line on stderr and ``SystemExit(2)``, as argparse exits.

    The line's URLs are redacted (:func:`datamodules.urls.redact`): argparse quotes the arguments it refuses
    (``unrecognized arguments: s3://KEY:SECRET@bucket/d``).
    """
    try:
        return parser.parse_args(argv)
    except UsageError as err:
        print(f"error: {redact_urls(str(err))}", file=sys.stderr)
        raise SystemExit(USAGE_EXIT_CODE) from None


def run_main(body: Callable[[], int]) -> int:
    """Run a tool's body; bad input (:class:`UsageError`, a tracking store that cannot be used), a file that
    cannot be read or written, and Ctrl-C become one line on stderr and their exit codes."""
    try:
        return body()
    except (UsageError, tracking.TrackingError) as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except OSError as err:
        code = os_error_exit_code(err)
        if code is None:
            raise
        print(f"error: {os_error_line(err)}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return SIGINT_EXIT_CODE


def os_error_exit_code(err: OSError) -> int | None:
    """The exit code of a tool stopped by ``err``, read by its type: a file named on the command line that cannot be
    read or written (``--plot /nonexistent/dir/p.png``) is bad input (2); a full disk or an I/O error is the
    machine's (1); an ``OSError`` about no file is neither (None: a traceback, it is a bug)."""
    if err.filename is None:
        return None
    return 1 if disk_error(err) is not None and err.errno != errno.EROFS else USAGE_EXIT_CODE


def os_error_line(err: OSError) -> str:
    """``err`` as one line: the file, then what the system said (``/nonexistent/dir/p.png: No such file or ...``)."""
    target = f"{err.filename} -> {err.filename2}" if err.filename2 else str(err.filename)
    return tracking.redact(f"{target}: {err.strerror or err}")


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
        known = sorted(e.name for e in all_experiments(client, ViewType.ACTIVE_ONLY))
        raise UsageError(f"experiment {name!r} not found at {tracking_uri} (experiments there: "
                         f"{', '.join(known) if known else 'none'}).")
    return experiment


#: Runs asked of the store per request; MLflow caps a page (SEARCH_MAX_RESULTS_THRESHOLD, 50,000).
SEARCH_PAGE_SIZE = 1000


def all_pages(search: Callable[..., Sequence[Any]], **kwargs: Any) -> list[Any]:
    """Every result of a paged MLflow search (``search_runs``, ``search_experiments``, ``search_logged_models``).

    Each of them answers one page and a token for the next (``search_experiments`` stops at 1,000 experiments,
    ``search_logged_models`` at 100 models): a reader that asks once loses the rest without a word.
    """
    results: list[Any] = []
    token: str | None = None
    while True:
        page = search(**kwargs, page_token=token)
        results.extend(page)
        token = getattr(page, "token", None)
        if not token:
            return results


def all_runs(client: mlflow.MlflowClient, experiment_ids: Sequence[str], filter_string: str = "",
             order_by: Sequence[str] | None = None, active_only: bool = True) -> list[Run]:
    """Every run of the experiments that matches ``filter_string``, page after page (:func:`all_pages`).

    Select in ``filter_string`` (``tags.sweep = 'x'``, ``metrics.`val/acc` > 0.9``), not in Python after a
    capped search. MLflow's fluent ``mlflow.search_runs`` pages too, but on the process's active store and with a
    cap of its own, so the tools page here with their own client.
    """
    from mlflow.entities import ViewType

    view = ViewType.ACTIVE_ONLY if active_only else ViewType.ALL
    return all_pages(client.search_runs, experiment_ids=list(experiment_ids), filter_string=filter_string,
                     run_view_type=view, max_results=SEARCH_PAGE_SIZE, order_by=list(order_by or []))


def all_experiments(client: mlflow.MlflowClient, view_type: int | None = None) -> list[Any]:
    """Every experiment of the store (active ones by default), page after page (:func:`all_pages`)."""
    from mlflow.entities import ViewType

    return all_pages(client.search_experiments, view_type=ViewType.ACTIVE_ONLY if view_type is None else view_type,
                     max_results=SEARCH_PAGE_SIZE)


def quoted(value: str) -> str:
    """``value`` as a string of an MLflow filter: ``'x'``, or ``"it's"`` (MLflow reads no escaped quote: a
    ``'it\\'s'`` matches nothing, without an error).

    Raises:
        UsageError: ``value`` holds both quote characters, which no MLflow filter can say.
    """
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise UsageError(f"{value!r}: a name with both ' and \" cannot be searched for in MLflow.")


def find_run(client: mlflow.MlflowClient, experiment_ids: Sequence[str], run_name: str) -> Run | None:
    """The newest MLflow run named ``run_name`` in the experiments, or None."""
    runs = client.search_runs(list(experiment_ids), filter_string=f"tags.`mlflow.runName` = {quoted(run_name)}",
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
