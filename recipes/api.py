"""Train a recipe from Python (a notebook cell): the same run, tracked the same way, as ``python -m recipes.fit``.

Example::

    from recipes import train

    run = train("configs/digits.yaml", trainer={"max_epochs": 3})       # one device: in this process
    run = train("configs/digits.yaml", "configs/strategy/ddp.yaml")      # DDP: 2 new processes
    run.metrics["val/acc"], run.run_id, run.run_dir                     # the run; a cell shows its table

Positional arguments are the ``--config`` files, in order; keyword arguments are the CLI's options, a
section as a dict (``trainer={"max_epochs": 3}`` is ``--trainer.max_epochs=3``, ``spot={"every_n_steps":
50}``, ``experiment="mine"``). The same parser checks them: a bad key or value raises one :class:`TrainError`
whose message is the CLI's ``error:`` line.

Where it runs:

- one device: in this process (the kernel), with the CLI's run flow (``recipes.run.cli.launch``): the run
  directory, MLflow run, checkpoints and resume are the command's. What a launch sets for its process (signal
  handlers, ``sys.argv``, torch's thread count) is put back when it returns, so one kernel runs any number of fits;
- DDP, FSDP, several devices or nodes: ``python -m recipes.fit`` as a new process (which starts the other
  ranks): never a fork of the kernel (Lightning's ``ddp_notebook`` forks it, and crashes with threads or
  CUDA in it). Its output is streamed into the cell, less the end table, which the returned run renders.

Either way, ``train`` puts back, when it returns or raises, what it and the libraries it imports change for the
whole process (:func:`process_state_kept`): the root logger's level, handlers and filters, the level of every
logger that existed before the call, the warnings filters and the environment (``os.environ``: keys added, changed
or removed), so a ``logging.warning`` in the next cell prints as it did before. What stays: the modules it
imported and the loggers they created, the log filters a launch adds once, for good, to Lightning's and MLflow's
loggers, and its wrapper of ``sys.unraisablehook`` (quiet only while a run is stopping).

The run's name, unless given, is derived from the arguments: the same call names the same run, so running the
cell again resumes an interrupted run, and returns a finished one without training again. Jupyter's
"interrupt kernel" (a SIGINT) is a spot notice: the run saves at the next step and ``train`` returns it as
``interrupted`` (in a child process it is sent on as SIGTERM, the notice signal); the kernel lives. A second
``train`` of a run that is running is refused as the CLI refuses it (``recipes.run.lock``).
"""

from __future__ import annotations

import contextlib
import html
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from callbacks.analysis import keys

__all__ = ["Run", "TrainError", "train"]

#: Signals a launch takes over in its process; put back afterwards (the kernel's own SIGINT handler included).
_PROCESS_SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGUSR1", None)) if s)
#: Exit codes of ``recipes.fit`` (see its docstring): done, bad input, interrupted after a checkpoint.
_DONE, _USAGE, _REQUEUE, _SIGINT = 0, 2, 75, 130
#: Metric prefixes the table of a run shows (``Run.metrics`` holds every metric).
_TABLE_PREFIXES = (keys.VAL_PREFIX, keys.TRAIN_LOSS_KEY, keys.BASELINE_PREFIX, keys.TEST_PREFIX, keys.SPOT_PREFIX,
                   keys.COST_KEY)
#: Terminal control sequences (colours, cursor): rich writes them when the kernel's environment asks for colour.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class TrainError(Exception):
    """A run refused or failed: one line saying why (the CLI's ``error:`` line for bad input)."""


@dataclass
class Run:
    """A run as ``train`` left it: where it is tracked and kept, its final metrics, and its end table.

    In Jupyter the run renders as the CLI's end table (``_repr_html_``); in a terminal with rich, as a rich
    table.
    """

    name: str
    experiment: str
    run_id: str | None
    run_dir: Path
    #: ``finished`` (trained to its end now), ``complete`` (finished before: nothing trained), ``interrupted``.
    status: str
    #: Every metric's latest value in the MLflow run (what ``recipes.compare`` reads).
    metrics: dict[str, float] = field(default_factory=dict)
    #: The end table's rows (key, value), as the CLI prints them.
    rows: list[tuple[str, str]] = field(default_factory=list)
    tracking_uri: str = ""
    #: What a child process printed (DDP, FSDP); empty for a run in this process.
    log: list[str] = field(default_factory=list, repr=False)

    @property
    def title(self) -> str:
        note = {"interrupted": " — INTERRUPTED (run the cell again to resume)",
                "complete": " — complete (finished earlier)"}.get(self.status, " — finished")
        return f"atscale run {self.name}{note}"

    def _repr_html_(self) -> str:
        cells = "".join(f"<tr><td style='text-align:left'><code>{html.escape(k)}</code></td>"
                        f"<td style='text-align:left'>{html.escape(v)}</td></tr>" for k, v in self.rows)
        return f"<table><caption>{html.escape(self.title)}</caption>{cells}</table>"

    def __rich__(self) -> Any:
        from rich.table import Table

        table = Table(title=self.title, show_header=False)
        table.add_column("key", style="cyan")
        table.add_column("value")
        for key, value in self.rows:
            table.add_row(key, value)
        return table

    def __str__(self) -> str:
        width = max((len(k) for k, _ in self.rows), default=0)
        return "\n".join([self.title, *(f"  {k.ljust(width)}  {v}" for k, v in self.rows)])


def train(*configs: str | os.PathLike[str], run_name: str | None = None, **options: Any) -> Run:
    """Train the recipe the config files describe, as ``python -m recipes.fit --config ...`` would; return the run.

    Args:
        *configs: config files, composed in order (``"configs/digits.yaml", "configs/strategy/ddp.yaml"``).
        run_name: the run's name (default: derived from the arguments, so the same call resumes or returns
            the same run).
        **options: the CLI's options; a section as a dict (``trainer={"max_epochs": 3}``), nested dicts for
            nested keys, lists and dicts with ``class_path`` passed whole.

    Returns:
        The :class:`Run`: ``status`` ``"interrupted"`` after a kernel interrupt (run the cell again to resume).

    Raises:
        TrainError: bad input (the CLI's one ``error:`` line), a run of that name already running, or a child
            process that failed.
        KeyboardInterrupt: an interrupt before training started (nothing was saved; nothing needs to be).
    """
    if not configs:
        raise TrainError("train() needs at least one config file, e.g. train(\"configs/digits.yaml\").")
    configs = tuple(str(c) for c in configs)
    for config in configs:
        if not Path(config).is_file():
            raise TrainError(f"config file {config!r} not found (working directory {os.getcwd()}).")
    with process_state_kept():  # from before the first import: the libraries' import-time settings go back too
        name = run_name or default_run_name(configs, options)
        # the layer table is for a terminal; a cell keeps its output (trainer.enable_model_summary=True shows it)
        trainer = {"enable_model_summary": False, **dict(options.get("trainer") or {})}
        args = arguments(configs, {**options, "trainer": trainer, "run_name": name})
        if in_processes(configs, options):
            return _in_processes(args, name, experiment_of(configs, options))
        return _in_kernel(args, name, experiment_of(configs, options))


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """Inside: anything goes; on the way out (returned or raised), the process-wide settings are as they were.

    Put back: the root logger's level, handlers and filters (MLflow's ``mlflow.pytorch`` calls
    ``logging.basicConfig(level=ERROR)`` when imported, which silenced a user's warnings for good); the level of
    every logger that existed on the way in; the warnings filters (torch, Lightning and MLflow add theirs on
    import and during a fit); and ``os.environ``, key by key (Lightning sets ``PYTORCH_NVML_BASED_CUDA_CHECK`` and
    torch ``TORCHINDUCTOR_CACHE_DIR`` on import; the launch its own variables). Loggers created inside keep what
    they were given: they are the imported libraries' own.
    """
    root = logging.getLogger()
    level, handlers, filters = root.level, root.handlers[:], root.filters[:]
    levels = {name: logger.level for name, logger in logging.Logger.manager.loggerDict.items()
              if isinstance(logger, logging.Logger)}
    environ = dict(os.environ)
    try:
        with warnings.catch_warnings():  # restores warnings.filters (and showwarning) on exit
            yield
    finally:
        root.setLevel(level)
        root.handlers[:], root.filters[:] = handlers, filters
        for name, was in levels.items():
            logger = logging.getLogger(name)
            if logger.level != was:
                logger.setLevel(was)
        for key in [k for k in os.environ if k not in environ]:
            del os.environ[key]
        for key, value in environ.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


# ------------------------------------------------------------------------------------ arguments

def arguments(configs: Sequence[str], options: Mapping[str, Any]) -> list[str]:
    """The command line of ``recipes.fit`` for these configs and options (values as JSON, which YAML reads)."""
    args: list[str] = []
    for config in configs:
        args += ["--config", config]
    for key, value in flat_options(options).items():
        args.append(f"--{key}={value if isinstance(value, str) else json.dumps(value)}")
    return args


def flat_options(options: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"trainer": {"max_epochs": 3}}`` -> ``{"trainer.max_epochs": 3}``; a dict with a ``class_path`` stays whole."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        if isinstance(value, Mapping) and value and "class_path" not in value:
            out.update(flat_options(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def default_run_name(configs: Sequence[str], options: Mapping[str, Any]) -> str:
    """The name the command these arguments stand for would get (``recipes.run.common.command_run_name``): the same
    call, the same run, and the same run as ``python -m recipes.fit`` with these arguments."""
    from recipes.run.common import command_run_name

    return command_run_name(arguments(configs, options))


def _merged(configs: Sequence[str], options: Mapping[str, Any]) -> dict[str, Any]:
    """The configs' top-level values, the later file winning, then the options (enough to see where it runs)."""
    import yaml

    merged: dict[str, Any] = {"trainer": {}}
    for config in configs:
        data = yaml.safe_load(Path(config).read_text()) or {}
        if isinstance(data, dict):
            for key, value in data.items():
                if key == "trainer" and isinstance(value, dict):
                    merged["trainer"].update(value)
                else:
                    merged[key] = value
    for key, value in flat_options(options).items():
        if key.startswith("trainer."):
            merged["trainer"][key.split(".", 1)[1]] = value
        elif key == "trainer" and isinstance(value, Mapping):
            merged["trainer"].update(value)
        else:
            merged[key] = value
    return merged


def experiment_of(configs: Sequence[str], options: Mapping[str, Any]) -> str:
    """The run's MLflow experiment (the CLI's default: ``default``)."""
    return str(_merged(configs, options).get("experiment") or "default")


def in_processes(configs: Sequence[str], options: Mapping[str, Any]) -> bool:
    """Whether the run needs processes of its own: a strategy, more than one device, or more than one node."""
    trainer = _merged(configs, options)["trainer"]
    strategy = trainer.get("strategy")
    if strategy not in (None, "auto", "single_device"):
        return True
    if int(trainer.get("num_nodes") or 1) > 1:
        return True
    devices = trainer.get("devices")
    if devices in (None, 1, "1"):
        return False
    if devices in ("auto", -1, "-1"):
        import torch

        return torch.cuda.device_count() > 1
    return not (isinstance(devices, list) and len(devices) == 1)


# ------------------------------------------------------------------------------------ in the kernel

def _in_kernel(args: list[str], name: str, experiment: str) -> Run:
    """The CLI's run flow in this process, with the signal handlers, ``sys.argv`` and torch's thread count put back
    afterwards (the environment, logging and warnings filters: :func:`process_state_kept`, around it)."""
    import torch

    from callbacks.utils.launch_clock import mark_launch
    from recipes.fit import __file__ as fit_file
    from recipes.run.cell import EpochLines
    from recipes.run.cli import launch
    from recipes.run.process import reset_stop_signals, wrap_up_done

    main = threading.current_thread() is threading.main_thread()
    handlers = {s: signal.getsignal(s) for s in _PROCESS_SIGNALS} if main else {}
    argv, threads = sys.argv, torch.get_num_threads()  # the environment: train's process_state_kept
    # the kernel's interrupt (SIGINT) is a spot notice: save at the next step, then return the run
    args = [*args, '--spot.signals=["SIGTERM", "SIGUSR1", "SIGINT"]']
    sys.argv = [fit_file, *args]  # what `python -m recipes.fit ...` shows: the run's note and manifest say so
    reset_stop_signals()  # an earlier launch's stop or wrap-up is not this one's (as run_cli does)
    mark_launch()  # the bill starts at this call, not when the kernel did (train puts the environment back)
    try:
        outcome = launch(None, extra_callbacks=[EpochLines()], show_summary=False)  # parses sys.argv, as the CLI
    finally:
        wrap_up_done()
        sys.argv = argv
        torch.set_num_threads(threads)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    if outcome.code == _SIGINT:
        raise KeyboardInterrupt(outcome.message)
    if outcome.code != _DONE and outcome.code != _REQUEUE:
        raise TrainError(_one_line(outcome.message or f"the run ended with exit code {outcome.code}"))
    cli = outcome.cli
    if outcome.code == _REQUEUE and (cli is None or cli.summary is None):
        # a stop before training, or one the fit ended early (streamed data gone): the line above the error says why
        raise TrainError(_one_line(outcome.message or "the run stopped before it finished (exit 75; its output says "
                                   "why): run the cell again to resume it"))
    status = "interrupted" if outcome.code == _REQUEUE else ("finished" if cli is not None else "complete")
    if outcome.message and status == "complete":
        print(outcome.message)
    run = _tracked(name, experiment, status)
    if cli is not None and cli.summary is not None:
        run.rows = list(cli.summary[1])
    if status == "interrupted":
        print(f"Interrupted: checkpoint saved, MLflow run {run.run_id} KILLED until resumed. Run the cell again to "
              "resume it exactly.")
    return run


def _one_line(message: str) -> str:
    return message.removeprefix("error: ").split("\n(python -m recipes.fit --help")[0]


# ------------------------------------------------------------------------------------ in new processes

def _child_env() -> dict[str, str]:
    """The kernel's environment less what would make the child think it is a rank of another launch."""
    from recipes.run.common import ENV_FROM_PARENT

    drop = {*ENV_FROM_PARENT, "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
            "PL_GLOBAL_SEED", "MLFLOW_RUN_ID"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _in_processes(args: list[str], name: str, experiment: str) -> Run:
    """``python -m recipes.fit`` in a new session, its output streamed here; a kernel interrupt is sent on."""
    proc = subprocess.Popen([sys.executable, "-m", "recipes.fit", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, env=_child_env(),
                            start_new_session=True)  # the kernel's interrupt reaches it only as we send it on
    assert proc.stdout is not None
    log: list[str] = []
    table = False  # the end table is rendered by the returned run, not echoed
    interrupts = 0
    while True:
        try:
            line = proc.stdout.readline()
        except KeyboardInterrupt:
            interrupts += 1
            # first: the notice signal (save at the next step, exit 75); again: SIGINT, stop now
            proc.send_signal(signal.SIGTERM if interrupts == 1 else signal.SIGINT)
            print("Interrupt: asking the run to checkpoint and stop." if interrupts == 1 else
                  "Interrupt again: stopping the run now.", flush=True)
            continue
        if not line:
            break
        log.append(line.rstrip("\n"))
        table = table or "atscale run —" in _ANSI.sub("", line)  # the end table's title: the table follows
        if not table and not line.startswith(("error: ", "(python -m recipes.fit --help")):  # raised instead
            print(line, end="", flush=True)
    code = proc.wait()
    if code == _USAGE:
        errors = [line for line in log if line.startswith("error: ")]
        raise TrainError(_one_line(errors[-1] if errors else "\n".join(log[-3:])))
    if code not in (_DONE, _REQUEUE):
        raise TrainError(f"python -m recipes.fit exited with {code}: " + " | ".join(log[-3:]))
    complete = code == _DONE and any(" is already complete" in line for line in log)
    status = "interrupted" if code == _REQUEUE else ("complete" if complete else "finished")
    run = _tracked(name, experiment, status)
    run.log = log
    if status == "interrupted":
        print(f"Interrupted: checkpoint saved, MLflow run {run.run_id} KILLED until resumed. Run the cell again to "
              "resume it exactly.")
    return run


# ------------------------------------------------------------------------------------ the record

def _tracked(name: str, experiment: str, status: str) -> Run:
    """The run as MLflow holds it: id, every metric's latest value, and its directory (the run-dir tag)."""
    import mlflow

    from recipes.run import tracking
    from recipes.run.common import find_run

    uri = tracking.tracking_uri()
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    found = None if exp is None else find_run(client, [exp.experiment_id], name)
    if found is None:
        return Run(name, experiment, None, Path("runs") / experiment / name, status, tracking_uri=uri)
    metrics = dict(found.data.metrics)
    run_dir = Path(found.data.tags.get(tracking.RUN_DIR_TAG, Path("runs") / experiment / name))
    rows = [(k, f"{v:.4f}") for k, v in sorted(metrics.items()) if k.startswith(_TABLE_PREFIXES)]
    rows += [("mlflow", f"experiment {experiment!r}, run {found.info.run_id}"), ("tracking", tracking.redact(uri)),
             ("run dir", str(run_dir))]
    return Run(name, experiment, found.info.run_id, run_dir, status, metrics, rows, uri)
