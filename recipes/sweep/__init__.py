"""Sweep a recipe's hyperparameters with Optuna: every trial a spot-safe run, resumable, on a dollar budget.

One machine (the study in a sqlite file beside the runs; 2 trials at a time, dividing the cores)::

    python -m recipes.sweep --config configs/digits.yaml --space configs/sweeps/digits.yaml --trials 20 \\
        --name digits-lr --parallel 2 --trainer.max_epochs 5

Many machines (run the same command on each; they share one study and never duplicate a trial; the runs'
``--runs_root`` must be a folder or bucket every machine sees, for a trial interrupted on one to resume on
another)::

    python -m recipes.sweep --config configs/digits.yaml --space configs/sweeps/digits.yaml --trials 100 \\
        --name digits-lr --storage postgresql://user:pass@db:5432/optuna --runs_root s3://bucket/runs \\
        --budget-usd 50 --cost.instance a3-highgpu-1g --cost.market spot

SLURM array (``configs/launch/sweep-slurm-array.sbatch``) and Kubernetes Indexed Job
(``configs/launch/sweep-kubernetes-job.yaml``) start that command N times.

Every other ``--key value`` goes to each trial's ``recipes.fit`` as an override. Relaunching the same command
(same ``--name``) continues the sweep: finished trials are not rerun, interrupted ones resume from their
checkpoints in their own MLflow runs, and the sweep holds exactly ``--trials`` trials. The search space is a
short YAML (:mod:`recipes.sweep.space`); the sampler is seeded (TPE by default); the pruner (median by
default, or successive halving) sees the trial's ``--metric`` after each validation epoch.

Why the trial prunes itself: the decision needs the metric of each epoch the moment it exists. A callback in
the trial process (:class:`recipes.sweep.pruning.SweepTrial`) reports it to the study and asks the pruner at
the epoch's end, then stops training like a finished run: no polling of MLflow's asynchronously written
metrics, no race between a fast epoch and a poll, no signal round trip, and a pruned trial keeps its
checkpoint, cost and model. This process only starts trials and records how they ended.

Outputs: each trial's run ``<runs_root>/<experiment>/<name>-t<NNN>`` (log beside it in
``<runs_root>/<experiment>/<name>/trial-<NNN>.log``), an MLflow parent run named ``<name>`` with the trials
nested under it, and at the end a table of trials, the best trial beside its baselines, parameter
importances, ``trials.csv``, ``optimization_history.png`` and ``parallel_coordinate.png`` (artifacts of the
parent run). ``python -m recipes.promote --sweep <name>`` promotes the best trial.

Exit codes: 0 done (or nothing left to run here), 2 bad input (before any trial starts), 75 interrupted
(SIGTERM/SIGUSR1: the running trials saved; relaunch), 130 Ctrl-C.

Where things live: this module is the command line (its parser and :func:`main`; ``__main__.py`` runs it). Its
submodules hold the sweep on Optuna, and none parses a command line: the search space
(:mod:`~recipes.sweep.space`), the study in a database (:mod:`~recipes.sweep.study`), the trial processes
(:mod:`~recipes.sweep.runner`), the pruning callback each trial runs (:mod:`~recipes.sweep.pruning`), the
in-process recipe check (:mod:`~recipes.sweep.check`) and the end-of-sweep report (:mod:`~recipes.sweep.report`).
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from callbacks.analysis.keys import DEFAULT_METRIC
from recipes.run.common import ArgumentParser, UsageError, check_tracking_server, run_main, tracking_uri

PROG = "python -m recipes.sweep"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", action="append", required=True, help="recipe YAML (repeatable, as for recipes.fit)")
    parser.add_argument("--space", required=True, help="search space YAML (recipes/sweep/space.py)")
    parser.add_argument("--trials", type=int, required=True, help="trials in the sweep, in all")
    parser.add_argument("--name", required=True, help="the sweep's name: its study, parent run and trial run names")
    parser.add_argument("--parallel", type=int, default=1, help="trials at once in this process (cores divided)")
    parser.add_argument("--budget-usd", dest="budget_usd", type=float, default=None,
                        help="no new trial once spent + running projections + one more trial would pass this")
    parser.add_argument("--storage", default=None,
                        help="Optuna storage URL (default sqlite:///<runs_root>/<experiment>/<name>/study.db); "
                             "postgresql://... to share the study between machines")
    parser.add_argument("--metric", default=DEFAULT_METRIC, help="validation metric to optimize")
    parser.add_argument("--mode", choices=("max", "min"), default="max", help="maximize or minimize --metric")
    parser.add_argument("--sampler", choices=("tpe", "random"), default="tpe", help="Optuna sampler")
    parser.add_argument("--seed", type=int, default=42, help="sampler seed (each trial draws from seed and number)")
    parser.add_argument("--pruner", choices=("median", "halving", "none"), default="median", help="Optuna pruner")
    parser.add_argument("--pruner-startup", dest="pruner_startup", type=int, default=2,
                        help="median pruner: finished trials before it prunes")
    parser.add_argument("--pruner-warmup", dest="pruner_warmup", type=int, default=0,
                        help="epochs of a trial before it may be pruned")
    parser.add_argument("--enqueue", action="append", default=[], metavar="JSON",
                        help='fixed parameters of the first trials, in order (repeatable): \'{"key": value}\'')
    parser.add_argument("--stale-after", dest="stale_after", type=float, default=120.0,
                        help="seconds without a heartbeat before another process takes over a trial")
    return parser


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """Arguments, and the overrides passed to every trial; :class:`UsageError` for bad ones."""
    import json

    args, extra = build_parser().parse_known_args(argv)
    if not _NAME.match(args.name):
        raise UsageError(f"--name {args.name!r}: letters, digits, '.', '_' and '-' only (it names runs and folders)")
    for flag, value, low in (("--trials", args.trials, 1), ("--parallel", args.parallel, 1),
                             ("--pruner-startup", args.pruner_startup, 0), ("--pruner-warmup", args.pruner_warmup, 0)):
        if value < low:
            raise UsageError(f"{flag} {value}: must be >= {low}")
    if args.budget_usd is not None and not args.budget_usd > 0:
        raise UsageError(f"--budget-usd {args.budget_usd}: must be > 0")
    if not 0 <= args.seed < 2**32:  # numpy's (hence the samplers') range
        raise UsageError(f"--seed {args.seed}: must be in [0, 2**32)")
    if not args.stale_after > 0:  # 0 or less: every process would take over every running trial at once
        raise UsageError(f"--stale-after {args.stale_after:g}: must be a positive number of seconds")
    cores = os.cpu_count() or 1
    if args.parallel > cores:
        raise UsageError(f"--parallel {args.parallel}: this machine has {cores} CPU cores")
    for path in args.config:
        if not Path(path).is_file():
            raise UsageError(f"--config {path}: no such file")
    if extra and not extra[0].startswith("--"):
        raise UsageError(f"unexpected argument {extra[0]!r} (overrides are --key value)")
    for key in ("--run_name", "--fresh", "--ckpt_path"):
        if any(a == key or a.startswith(key + "=") for a in extra):
            raise UsageError(f"{key}: the sweep names and resumes its trials itself; drop it")
    enqueue = []
    for text in args.enqueue:
        try:
            item = json.loads(text)
        except json.JSONDecodeError as err:
            raise UsageError(f"--enqueue {text!r}: not JSON ({err.msg})") from None
        if not isinstance(item, dict):
            raise UsageError(f"--enqueue {text!r}: expected a JSON object of parameters")
        enqueue.append(item)
    if len(enqueue) > args.trials:
        raise UsageError(f"--enqueue: {len(enqueue)} fixed trials but --trials {args.trials}")
    args.enqueue = enqueue
    return args, extra


def _main(argv: list[str] | None) -> int:
    args, extra = parse(argv)
    from rich.console import Console

    from recipes.sweep.space import check_fixed, load_space

    space = load_space(args.space)
    for index, params in enumerate(args.enqueue):
        check_fixed(space, params, f"--enqueue #{index + 1}")
    args.tracking_uri = tracking_uri()
    check_tracking_server(args.tracking_uri)
    from recipes.sweep.check import check_recipe

    recipe = check_recipe(args.config, extra, space, args.space, args.metric)
    if args.storage is None:
        root = Path("runs") if "://" in recipe.runs_root else Path(recipe.runs_root)
        folder = root / recipe.experiment / args.name
        folder.mkdir(parents=True, exist_ok=True)
        args.storage = f"sqlite:///{(folder / 'study.db').resolve()}"
    import optuna

    from recipes.sweep.runner import Sweep
    from recipes.sweep.study import open_storage, open_study

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = open_storage(args.storage)
    settings = {"configs": args.config, "space": {k: repr(v) for k, v in space.items()}, "metric": args.metric,
                "mode": args.mode, "sampler": args.sampler, "seed": args.seed, "pruner": args.pruner,
                "pruner_startup": args.pruner_startup, "pruner_warmup": args.pruner_warmup, "overrides": extra,
                "enqueue": args.enqueue, "experiment": recipe.experiment}
    study, _ = open_study(storage, args.storage, args.name, "maximize" if args.mode == "max" else "minimize",
                          settings, args.trials, args.enqueue)
    console = Console(stderr=False)
    if not console.is_terminal:  # a log file or a pipe: wide enough that the trials table prints whole
        console = Console(stderr=False, width=200)
    return Sweep(args, extra, space, recipe, study, storage, console).run()


def main(argv: list[str] | None = None) -> int:
    return run_main(lambda: _main(argv))

