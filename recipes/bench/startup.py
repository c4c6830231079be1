"""``python -m recipes.bench startup``: how long a launch of the recipe takes to reach its first step, and to exit.

A spot run pays its start-up on every relaunch, so this is a figure users feel. Each round runs the
default recipe twice as a user does, ``python -m recipes.fit --config configs/digits.yaml`` in a fresh
interpreter: a *fresh* launch (a new run, stopped by a fire drill after its first step, as a notice stops
it: checkpoint, exit 75) and the *relaunch* that resumes it and finishes (its model logged, its time
breakdown drawn). Each launch is cut into phases by the clock readings of a callback it carries
(:class:`StartupStamps`) and the parent's own at spawn and exit:

- ``imports``: spawn until the CLI parses its configuration (the interpreter, torch, Lightning, MLflow);
- ``cli``: the parse, the run directory and MLflow run, the trainer, model and data built;
- ``setup``: ``trainer.fit`` until the first training batch (baselines, the resume, the data loader);
- ``wrap-up``: the end of training until the process has exited (the checkpoint, model, plot, MLflow).

Each round also times the *floor*, ``python -c "import torch, lightning.pytorch"`` (spawn to exit), in turn
with the two launches (the floor first in even rounds, last in odd ones), and reports spawn-to-first-step over
the floor for each kind of launch, with a paired bootstrap interval over the rounds
(:func:`recipes.bench.stats.time_ratio_ci`) and a verdict against the goal of at most
:data:`FLOOR_GOAL` (issue 47): what a launch pays beyond importing the two libraries it cannot do without.

``--imports`` adds where the import time goes (``python -X importtime``, first import of each library)::

    python -m recipes.bench startup --rounds 5 --imports

``--stream`` makes each round also launch the streamed recipe (``configs/digits-stream.yaml``) from moto's S3
server behind the loopback proxy shaped as a same-region bucket (:class:`recipes.soak.bucket.Bucket`, 30 ms a
request, 100 MB/s a connection; chunks of 64 digits), stopped at a step drawn at random mid-epoch (the same step
for both sources in a round), and its relaunch with an empty chunk cache (a relaunch on another machine): the
``relaunch-stream`` column against ``relaunch`` is what a resume pays to reach its first batch from the bucket::

    python -m recipes.bench startup --rounds 5 --stream
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch import Callback, LightningModule, Trainer
from rich.console import Console
from rich.table import Table
from typing_extensions import override

from recipes.bench.output import emit
from recipes.bench.runs import own_store
from recipes.run.common import UsageError

REPO = Path(__file__).resolve().parents[2]
#: The phases of a launch, in order, each from the previous stamp to its own.
PHASES = ("imports", "cli", "setup", "wrap-up")
#: Libraries whose first import ``--imports`` reports (everything else is "the rest").
LIBRARIES = ("torch", "lightning", "mlflow")
#: What a launch imports before it parses its configuration (``recipes.fit`` imports it inside ``main``).
LAUNCH_IMPORTS = "recipes.run.cli"
#: The floor of a launch: the two imports no training launch can skip.
FLOOR_CODE = "import torch, lightning.pytorch"
#: Goal: spawn to first step at most this many times the floor.
FLOOR_GOAL = 1.3
#: Set by the parent: where :class:`StartupStamps` writes its clock readings.
STAMPS_ENV = "ATSCALE_BENCH_STAMPS"

#: When this module was imported in a launch: jsonargparse imports it while it parses the configuration.
_IMPORTED_AT = time.time()


class StartupStamps(Callback):
    """Writes the wall-clock readings that cut a launch into phases, as JSON, to ``$ATSCALE_BENCH_STAMPS``."""

    def __init__(self) -> None:
        self.stamps: dict[str, float] = {"parse": _IMPORTED_AT}

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.stamps["fit_start"] = time.time()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if "first_step" not in self.stamps:  # the first batch only: no clock read on every later step
            self.stamps["first_step"] = time.time()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.stamps["train_end"] = time.time()
        self._write()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.stamps["train_end"] = time.time()
        self._write()

    def _write(self) -> None:
        path = os.environ.get(STAMPS_ENV)
        if path:
            Path(path).write_text(json.dumps(self.stamps))


def phases(spawned: float, stamps: dict[str, float], exited: float) -> dict[str, float]:
    """Seconds of each phase of one launch (:data:`PHASES`), plus ``to_first_step`` and ``total``.

    Args:
        spawned: the parent's clock just before it started the process.
        stamps: :class:`StartupStamps`' readings (``parse``, ``fit_start``, ``first_step``, ``train_end``).
        exited: the parent's clock once the process had exited.

    Raises:
        ValueError: if a reading is missing or the readings are out of order.
    """
    order = [spawned, *(stamps.get(k, float("nan")) for k in ("parse", "fit_start", "first_step", "train_end")),
             exited]
    if any(math.isnan(v) for v in order) or any(b < a for a, b in itertools.pairwise(order)):
        raise ValueError(f"startup stamps missing or out of order: spawn {spawned}, {stamps}, exit {exited}")
    spawn, parse, fit_start, first_step, train_end, end = order
    return {"imports": parse - spawn, "cli": fit_start - parse, "setup": first_step - fit_start,
            "wrap-up": end - train_end, "to_first_step": first_step - spawn, "total": end - spawn}


def import_breakdown(importtime_stderr: str) -> dict[str, float]:
    """Seconds of the first import of each of :data:`LIBRARIES` and of everything, from ``-X importtime`` output.

    A library's figure is the sum of the cumulative times of its outermost rows (a row of the library with
    no row of any of the libraries around it): what importing it loaded that was not loaded yet (torch
    modules that Lightning imports count as Lightning's). The total is the
    sum of the top-level rows; ``rest`` is the total less the libraries (the interpreter's own start is not in
    the output).
    """
    rows = []
    for line in importtime_stderr.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| ( *)(\S+)", line)
        if match:
            rows.append((int(match.group(2)) / 1e6, len(match.group(3)), match.group(4)))
    def library_of(name: str) -> str | None:
        return next((lib for lib in LIBRARIES if name == lib or name.startswith(lib + ".")), None)

    # the output lists a module after everything it imported: read backwards, a row's ancestors are the stack
    out = dict.fromkeys(LIBRARIES, 0.0)
    ancestors: list[tuple[int, str | None]] = []  # (depth, library of that row)
    for cumulative, depth, name in reversed(rows):
        while ancestors and ancestors[-1][0] >= depth:
            ancestors.pop()
        library = library_of(name)
        if library is not None and not any(lib is not None for _, lib in ancestors):
            out[library] += cumulative
        ancestors.append((depth, library))
    total = sum(cumulative for cumulative, depth, _ in rows if depth == 0)
    out["rest"] = total - sum(out[lib] for lib in LIBRARIES)
    out["total"] = total
    return out


def _launch(workdir: Path, args: Sequence[str], stamps: Path) -> dict[str, Any]:
    """One ``python -m recipes.fit`` launch in ``workdir``: its exit code and phases."""
    stamps.unlink(missing_ok=True)
    env = {**os.environ, STAMPS_ENV: str(stamps), "PYTHONPATH": str(REPO)}
    spawned = time.time()
    result = subprocess.run([sys.executable, "-m", "recipes.fit", *args], cwd=workdir, env=env,
                            capture_output=True, text=True)
    exited = time.time()
    if not stamps.exists():
        raise RuntimeError(f"the launch (exit {result.returncode}) wrote no stamps:\n{result.stderr[-3000:]}")
    return {"exit_code": result.returncode, **phases(spawned, json.loads(stamps.read_text()), exited)}


def _floor() -> float:
    """Seconds from spawn to exit of ``python -c FLOOR_CODE`` (:data:`FLOOR_CODE`)."""
    spawned = time.time()
    subprocess.run([sys.executable, "-c", FLOOR_CODE], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                   capture_output=True, check=True)
    return time.time() - spawned


@contextlib.contextmanager
def _streamed_digits(root: Path, sources: Sequence[str]) -> Iterator[str]:
    """The digits prepared in chunks of 64 in a local S3 server shaped as a same-region bucket (its URL); the
    launches reach it through :meth:`Bucket.env`, set in this process's environment meanwhile. Nothing without
    ``stream`` among ``sources``."""
    if "stream" not in sources:
        yield ""
        return
    from recipes.soak.bucket import Bucket

    bucket = Bucket(root / "moto.log")
    bucket.start()
    saved = {key: os.environ.get(key) for key in bucket.env()}
    try:
        os.environ.update(bucket.env())
        url = bucket.url("digits")
        subprocess.run([sys.executable, "-m", "recipes.prepare", "digits", "--output", url, "--chunk_items", "64",
                        "--staging", str(root / "staging")], cwd=root, env={**os.environ, "PYTHONPATH": str(REPO)},
                       capture_output=True, check=True)
        bucket.shape(0.030, 100e6)
        yield url
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        bucket.stop()


def bench_startup(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """``args.rounds`` rounds of a fresh launch and its relaunch, each in a new run of its own store, and the floor."""
    callback = json.dumps({"class_path": f"{__name__}.StartupStamps"})
    sources = ("memory", "stream") if getattr(args, "stream", False) else ("memory",)
    launches: dict[str, list[dict[str, Any]]] = {f"{kind}{suffix}": [] for suffix in
                                                 ("" if s == "memory" else "-stream" for s in sources)
                                                 for kind in ("fresh", "relaunch")}
    floors: list[float] = []
    draw = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp, own_store(Path(args.out or tmp)) as root, \
            _streamed_digits(root, sources) as url:
        for index in range(args.rounds):
            # the default: the first step; --stream: a step mid-epoch (an epoch is 45 steps of 32 digits)
            stop = draw.randrange(5, 40) if len(sources) > 1 else 1
            if index % 2 == 0:  # the floor before the launches in even rounds, after them in odd ones
                floors.append(_floor())
            for source in sources:
                workdir = root / f"round{index}-{source}"
                workdir.mkdir()
                base = ["--config", str(REPO / "configs" / "digits.yaml"), "--trainer.max_steps", str(stop + 1),
                        "--trainer.enable_progress_bar", "false", "--run_name", f"startup-{index}",
                        "--spot.drill_steps", f"[{stop}]", f"--trainer.callbacks+={callback}"]
                if source == "stream":
                    base[1] = str(REPO / "configs" / "digits-stream.yaml")
                    base += ["--data.url", url]
                for kind in ("fresh", "relaunch"):
                    cache = ["--data.cache_dir", str(workdir / f"cache-{kind}")] if source == "stream" else []
                    launch = _launch(workdir, [*base, *cache], root / "stamps.json")
                    expected = 75 if kind == "fresh" else 0
                    if launch["exit_code"] != expected:
                        raise RuntimeError(f"round {index + 1}: the {source} {kind} launch exited "
                                           f"{launch['exit_code']}, not {expected}")
                    key = kind if source == "memory" else f"{kind}-stream"
                    launches[key].append(launch)
                    what = f"stopped at step {stop}" if kind == "fresh" else f"resumed from step {stop}"
                    console.print(f"round {index + 1}/{args.rounds} ({key}, {what}): first step "
                                  f"after {launch['to_first_step']:.1f} s, exited after {launch['total']:.1f} s",
                                  highlight=False)
            if index % 2 == 1:
                floors.append(_floor())
            console.print(f"round {index + 1}/{args.rounds} (floor): {floors[-1]:.1f} s", highlight=False)
    # here: a launch imports this module, and scipy.stats is slow
    from recipes.bench.stats import bootstrap_ci, time_ratio_ci, verdict_at_most

    figures: dict[str, Any] = {"launches": launches, "median": {}, "ci95": {}, "load_average": list(os.getloadavg()),
                               "settings": {"rounds": args.rounds, "stream": len(sources) > 1}}
    for kind, runs in launches.items():
        figures["median"][kind] = {}
        figures["ci95"][kind] = {}
        for key in (*PHASES, "to_first_step", "total"):
            values = np.array([run[key] for run in runs])
            figures["median"][kind][key] = statistics.median(values)
            figures["ci95"][kind][key] = bootstrap_ci(len(values), lambda picks, v=values: float(np.median(v[picks])))
    figures["floor"] = {"code": FLOOR_CODE, "seconds": floors, "median": statistics.median(floors),
                        "ci95": bootstrap_ci(len(floors), lambda picks: float(np.median(np.array(floors)[picks])))}
    figures["over_floor"] = {}
    for kind, runs in launches.items():
        ratio, low, high = time_ratio_ci([run["to_first_step"] for run in runs], floors)
        figures["over_floor"][kind] = {"ratio": ratio, "ci95": [low, high], "goal": FLOOR_GOAL,
                                       "verdict": verdict_at_most(low, high, FLOOR_GOAL)}
    if args.imports:
        result = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {LAUNCH_IMPORTS}"], cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                                check=True)
        figures["imports"] = import_breakdown(result.stderr)
    return figures


_PHASE_NAMES = {"imports": "imports", "cli": "CLI and run set-up", "setup": "fit start to first step",
                "wrap-up": "end of training to exit", "to_first_step": "spawn to first step",
                "total": "spawn to exit"}


def print_startup(figures: dict[str, Any], console: Console) -> None:
    rounds = figures["settings"]["rounds"]
    table = Table(title=f"A launch of the digits recipe, phase by phase (seconds; medians of {rounds} rounds, "
                        "95% CI)")
    for column in ("phase", *(k.replace("fresh", "fresh launch") for k in figures["median"])):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for key, name in _PHASE_NAMES.items():
        cells = []
        for kind in figures["median"]:
            low, high = figures["ci95"][kind][key]
            cells.append(f"{figures['median'][kind][key]:.2f} ({low:.2f} .. {high:.2f})")
        table.add_row(name, *cells)
    console.print(table)
    if "floor" in figures:
        floor = figures["floor"]
        low, high = floor["ci95"]
        console.print(f"floor: python -c \"{floor['code']}\" {floor['median']:.2f} s ({low:.2f} .. {high:.2f})",
                      highlight=False, markup=False)
        for kind, over in figures["over_floor"].items():
            low, high = over["ci95"]
            console.print(f"spawn to first step / floor, {kind}: x{over['ratio']:.2f} ({low:.2f} .. {high:.2f}; "
                          f"goal <= x{over['goal']:.1f}: {over['verdict']})", highlight=False, markup=False)
    if "imports" in figures:
        imports = figures["imports"]
        parts = ", ".join(f"{lib} {imports[lib]:.2f} s" for lib in (*LIBRARIES, "rest") if lib in imports)
        console.print(f"import {LAUNCH_IMPORTS}: {imports['total']:.2f} s ({parts}; first import of each)",
                      highlight=False)
    console.print(f"load average at the end {', '.join(f'{v:.2f}' for v in figures['load_average'])}",
                  highlight=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=5, help="rounds of a fresh launch and its relaunch")
    parser.add_argument("--imports", action="store_true", help="also: the import time of each library")
    parser.add_argument("--stream", action="store_true",
                        help="also: the streamed recipe from a shaped local S3 server, stopped mid-epoch, and its "
                             "relaunch with an empty cache (time to the first batch from the bucket)")
    parser.add_argument("--out", default=None, help="keep run files here (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise UsageError(f"--rounds {args.rounds} must be >= 1")
    console = Console(stderr=args.json)
    figures = bench_startup(args, console)
    emit(figures, args.json, lambda: print_startup(figures, console))
    return 0
