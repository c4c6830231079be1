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

Where things live: this module is the command line (its parser and :func:`main`; ``__main__.py`` runs it), and
the sweep is split along its seams:

- :mod:`recipes.scale.points`: the measured points and the laws fitted to them (no I/O but a CSV).
- :mod:`recipes.scale.launch`: the training launches at each device count, and the CSV path instead.
- :mod:`recipes.scale.report`: the files, the MLflow parent run's record and the terminal tables.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console

from callbacks.storage.remote_store import is_remote
from recipes.run.common import (
    USAGE_EXIT_CODE,
    ArgumentParser,
    UsageError,
    check_name,
    check_output_dir,
    os_error_exit_code,
    os_error_line,
)
from recipes.run.tracking import TrackingError
from recipes.scale.launch import ChildFailed, run_from_csv, run_sweep
from recipes.scale.report import print_report

PROG = "python -m recipes.scale"


class _RunsRoot(argparse.Action):
    """Store ``--runs_root`` and remember how the user spelled it (``--runs-root`` is an alias), for messages."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.runs_root_flag = option_string or "--runs_root"



def check_places(args: argparse.Namespace) -> None:
    """Refuse (:class:`UsageError`) where the sweep would write before it writes anything: the experiment is a name
    inside the runs root (``../../x`` wrote its log outside it), the runs root and ``--out`` folders that take
    files, the timeout a positive number of seconds."""
    if args.experiment is not None:
        check_name("--experiment", args.experiment)
    if not is_remote(args.runs_root):
        check_output_dir(args.runs_root_flag, args.runs_root)
    if args.out is not None:
        check_output_dir("--out", args.out)
    if not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout:g} must be a positive number of seconds.")


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
        check_places(args)
        if args.from_csv and extra:
            raise UsageError(f"--from-csv trains nothing; unexpected arguments {' '.join(extra)}")
        quiet = Console(stderr=True) if args.json else console
        if args.json:  # only JSON on stdout: MLflow writes "View run ... at: URL" there when a server's run ends
            os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        result = run_from_csv(args, quiet) if args.from_csv else run_sweep(args, extra, quiet)
    except (UsageError, TrackingError) as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except OSError as err:  # a file that cannot be read or written after the checks (a folder removed meanwhile)
        code = os_error_exit_code(err)
        if code is None:
            raise
        print(f"error: {os_error_line(err)}", file=sys.stderr)
        return code
    except (ChildFailed, subprocess.TimeoutExpired) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print_report(result, console)
    return 0

