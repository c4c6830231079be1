"""The ``chaos`` subcommand of ``recipes.bench``: its options, their checks, the chains driven, the report written.

A benchmark of the recipe's fault tolerance, not a CI test::

    python -m recipes.bench chaos --faults 10 --out chaos.json
    python -m recipes.bench chaos --faults 100 --chains 2 --out chaos.json  # two runs at once, one per core
    python -m recipes.bench chaos --faults 10 --seed 7 --ddp          # every launch with configs/strategy/ddp.yaml
    python -m recipes.bench chaos --faults 3 --kinds sigterm,sigkill,corrupt

A launch costs what ``recipes.fit`` costs to start (imports, MLflow) plus the moment of its fault, and a fault
takes more than one launch on average (setup, ``--ckpt_path`` and double launches, a finishing launch every
``--faults-per-run``), so the soak's time grows with ``--faults``; a second chain only pays where a second
core is otherwise idle.

Exit status: 0 if every invariant held, 1 if one broke, 2 for bad options.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from recipes.run.common import USAGE_EXIT_CODE
from recipes.soak.faults import KINDS, RANK_KINDS, STORE_KINDS, WORKER_KINDS, PlannedFault, plan_faults
from recipes.soak.observe import observer_pool
from recipes.soak.report import build_report, print_report
from recipes.soak.soak import Soak

REPO = Path(__file__).resolve().parents[2]
STORES = ("local", "s3")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``chaos`` subcommand's options (``python -m recipes.bench chaos ...``)."""
    parser.add_argument("--faults", type=int, default=10, help="how many faults to inject")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice")
    parser.add_argument("--kinds", default=None,
                        help=f"comma-separated fault kinds (default: all of {', '.join(KINDS)}; "
                             f"{', '.join(STORE_KINDS)} only with --store s3, {', '.join(RANK_KINDS)} only with "
                             "--ddp)")
    parser.add_argument("--store", default="local", choices=STORES,
                        help="where the run root is: a local directory, or (s3) a bucket of moto's S3 server on "
                             "127.0.0.1 behind a proxy the soak can take down (needs moto[server] and s3fs)")
    parser.add_argument("--faults-per-run", dest="faults_per_run", type=int, default=10,
                        help="finish and check the run after this many faults, then go on with a new run name")
    parser.add_argument("--chains", type=int, default=1,
                        help="drive this many runs at once, the faults dealt out in turn (each chain has its own "
                             "MLflow store and disk): 2 uses both cores of a 2-core machine, and times then "
                             "include the other chain's load")
    parser.add_argument("--ddp", action="store_true", help="every launch (and the reference) with the DDP fragment")
    parser.add_argument("--workers", type=int, default=2,
                        help="loader worker processes of every launch (and the reference), as users load data: a "
                             "signal to the process group reaches them too (group_signal needs at least 1)")
    parser.add_argument("--epochs", type=int, default=2, help="trainer.max_epochs of the run (45 steps each)")
    parser.add_argument("--batches", type=int, default=0,
                        help="trainer.limit_train_batches of the run (0: whole epochs)")
    parser.add_argument("--every", type=int, default=5, help="spot.every_n_steps of the run")
    parser.add_argument("--launch-timeout", dest="launch_timeout", type=float, default=240.0,
                        help="seconds after which a launch counts as hung and is killed")
    parser.add_argument("--tmpfs-mb", dest="tmpfs_mb", type=int, default=256, help="size of the disk_full tmpfs")
    parser.add_argument("--repo", default=str(REPO), help="the checkout whose recipes.fit is soaked")
    parser.add_argument("--workdir", default=None, help="keep the runs and launch logs here (default: a temporary "
                                                        "directory, removed unless an invariant failed)")
    parser.add_argument("--out", default=None, help="write the report as JSON here")


def validate(args: argparse.Namespace) -> str | None:
    """The first problem with the options, or None; normalises ``args.kinds`` to a tuple."""
    store = getattr(args, "store", "local")
    if args.kinds is None:
        args.kinds = ",".join(k for k in KINDS if (store == "s3" or k not in STORE_KINDS)
                              and (args.ddp or k not in RANK_KINDS) and (args.workers > 0 or k not in WORKER_KINDS))
    kinds = tuple(k.strip() for k in str(args.kinds).split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        return f"--kinds {args.kinds}: unknown {unknown or 'empty'}; known: {', '.join(KINDS)}"
    if store != "s3" and (need := [k for k in kinds if k in STORE_KINDS]):
        return f"--kinds {args.kinds}: {', '.join(need)} needs --store s3"
    if not args.ddp and (need := [k for k in kinds if k in RANK_KINDS]):
        return f"--kinds {args.kinds}: {', '.join(need)} needs --ddp"
    if args.workers < 1 and (need := [k for k in kinds if k in WORKER_KINDS]):
        return f"--kinds {args.kinds}: {', '.join(need)} needs --workers 1 or more"
    if args.workers < 0:
        return f"--workers {args.workers} must be >= 0"
    args.kinds = kinds
    if store == "s3":
        import importlib.util

        missing = [m for m in ("moto", "s3fs", "flask") if importlib.util.find_spec(m) is None]
        if missing:
            return f"--store s3 needs {', '.join(missing)} (pip install 'moto[server]' s3fs)"
    for name in ("faults", "faults_per_run", "epochs", "every", "chains"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1"
    if args.batches < 0:
        return f"--batches {args.batches} must be >= 0"
    if args.seed < 0:
        return f"--seed {args.seed} must be >= 0"
    if not args.launch_timeout > 0:
        return f"--launch-timeout {args.launch_timeout} must be > 0"
    if args.tmpfs_mb < 1:
        return f"--tmpfs-mb {args.tmpfs_mb} must be >= 1"
    if not (Path(args.repo) / "recipes" / "fit.py").is_file():
        return f"--repo {args.repo} has no recipes/fit.py"
    if args.workdir and Path(args.workdir).exists() and any(Path(args.workdir).iterdir()):
        return f"--workdir {args.workdir} is not empty"
    return None


def main(args: argparse.Namespace) -> int:
    """Run the soak; 0 if every invariant held, 1 if one broke, 2 for bad options."""
    problem = validate(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return USAGE_EXIT_CODE
    # the soak reads checkpoints it corrupted itself: their warnings are expected (restored afterwards, so a caller
    # in the same process, a test suite, keeps its logging)
    ckpt_log = logging.getLogger("callbacks.storage.ckpt_store")
    previous = ckpt_log.level
    ckpt_log.setLevel(logging.ERROR)
    try:
        return _soak(args)
    finally:
        ckpt_log.setLevel(previous)


def _soak(args: argparse.Namespace) -> int:
    """The soak itself (see :func:`main`)."""
    temporary = args.workdir is None
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="atscale-chaos-")
    console = Console()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        report = soak(args, console, progress)
    print_report(report, console)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
        console.print(f"report: {args.out}", highlight=False)
    failed = [name for name, result in report["invariants"].items() if not result["ok"]]
    if failed:
        console.print(f"[red]invariants failed: {', '.join(failed)}[/] (runs and launch logs kept in {args.workdir})")
        return 1
    if temporary:
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 0


def soak(args: argparse.Namespace, console: Console, progress: Progress | None = None) -> dict[str, Any]:
    """The reference run, then the plan's faults over ``args.chains`` concurrent chains; the report."""
    started = time.monotonic()
    plan = plan_faults(args.faults, args.kinds, args.seed)
    chains = [Soak(args, console, None if args.chains == 1 else c + 1) for c in range(args.chains)]
    try:
        for chain in chains:
            chain.open_bucket()
        with observer_pool():
            return _drive(args, chains, plan, started, progress)
    finally:
        for chain in chains:
            if chain.bucket is not None:
                chain.bucket.stop()


def _drive(args: argparse.Namespace, chains: list[Soak], plan: list[PlannedFault], started: float,
           progress: Progress | None) -> dict[str, Any]:
    task = progress.add_task("reference run", total=len(plan)) if progress is not None else None
    chains[0].run_reference()
    for chain in chains[1:]:
        chain.reference = chains[0].reference
    parts = [[(i, p) for i, p in enumerate(plan) if i % args.chains == c] for c in range(args.chains)]
    if len(chains) == 1:
        chains[0].run(parts[0], progress, task)
    else:
        with ThreadPoolExecutor(len(chains)) as pool:
            futures = [pool.submit(chain.run, part, progress, task) for chain, part in zip(chains, parts, strict=True)]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                for chain in chains:
                    chain.stop.set()
                    chain.kill_all()
                raise
    report = build_report(chains, plan)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    return report
