"""The project's LightningCLI: defaults every entry point shares, and the run flow around ``fit``.

What it adds to Lightning's CLI:

- a run directory ``<runs_root>/<experiment>/<run_name>/`` with ``checkpoints/``, the resolved
  ``config.yaml`` and ``manifest.json``; ``runs_root`` may be an object-storage URL (``s3://``,
  ``gs://``, ``az://``): files are then written under ``staging_root`` first and uploaded, and a
  relaunch on a machine that never saw them resumes from the bucket;
- MLflow tracking by default (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``): the config as
  flattened params, metrics, artifacts, the model, system metrics; one run however many ranks;
- resume: relaunching with the same run name continues from the newest good checkpoint, in the
  same MLflow run (``--ckpt_path`` picks one explicitly, ``--fresh`` starts over);
- spot safety, baselines, atomic (by default asynchronous) checkpoint writes, a rich progress bar, an end table;
- one-line errors with exit code 2 for bad input, and no MLflow run left RUNNING after a failure.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import MLFlowLogger

from callbacks.analysis.keys import DEFAULT_METRIC
from callbacks.baselines import Baselines
from callbacks.checkpoint_io import AtomicCheckpointIO, BoundedAsyncCheckpointIO, PublishGate
from callbacks.cost import CostTracker
from callbacks.elastic import ElasticResume
from callbacks.manifest import Manifest
from callbacks.mlflow_model import LogModel
from callbacks.model_checkpoint import PublishedModelCheckpoint
from callbacks.progress import RunProgressBar
from callbacks.spot import REQUEUE_EXIT_CODE, SpotCheckpoint
from callbacks.storage import remote_store
from callbacks.storage.remote_store import StoreError
from callbacks.timing import StepTiming
from callbacks.utils.run_report import AfterFit, ExitCode, SummaryRows
from datamodules.streaming import StreamStopped
from recipes.run import stop_line, tracking
from recipes.run.agree import DecisionFailed, agent_store_available, decided_once
from recipes.run.cli_callbacks import (
    AgreedStart,
    LoggedThrough,
    RelocateCheckpointState,
    TrackedConfig,
    UploadRunFiles,
    pending_points,
)
from recipes.run.common import (
    ENV_CKPT_PATH,
    ENV_MLFLOW_RUN_ID,
    ENV_RUN_NAME,
    SIGINT_EXIT_CODE,
    USAGE_EXIT_CODE,
    UsageError,
    check_tracking_server,
)
from recipes.run.context import (
    AlreadyComplete,
    RunContext,
    check_devices,
    check_location,
    check_name,
    check_trainer_values,
    checkpoint_here,
    decide_start,
    default_run_name,
    global_rank_from_env,
    launched_by_parent,
    run_tags,
    search_tags,
    torchrun_nodes,
)
from recipes.run.end_table import print_end_table
from recipes.run.errors import lost_peer, machine_failure, out_of_space, parse_error_message
from recipes.run.lock import RunLock, RunLocked
from recipes.run.process import (
    ASYNC_LOGGING_BUFFER_ENV,
    ASYNC_LOGGING_BUFFER_S,
    ASYNC_LOGGING_THREADS_ENV,
    STOP_EXCEPTIONS,
    Interrupted,
    ReleaseInterruptedFrames,
    WrapUpSignals,
    apply_cpu_threads,
    cheap_gpu_checks,
    cpu_thread_callback,
    frozen_setup_objects,
    ignore_stop_signals,
    install_stop_signals,
    quiet_known_noise,
    rank_exit_code,
    release_interrupted_frames,
    reraise_swallowed_stop,
    reset_stop_signals,
    resume_line,
    stopping,
    stops_raised,
    wrap_up_done,
)
from recipes.run.quiet_profiler import QuietProfiler
from recipes.run.resumable_logger import ResumableMLFlowLogger
from recipes.run.shutdown import destroy_process_group
from recipes.run.tracking import RUN_DIR_TAG, TrackingError, flush_async_metrics, redact

log = logging.getLogger(__name__)



class AtscaleCLI(LightningCLI):
    """LightningCLI with the project's run directory, tracking, resume and safety defaults.

    Fitting is its only action: ``python -m recipes.fit --config X.yaml [--config Y.yaml] [--k=v ...]``.
    """

    def __init__(self, extra_callbacks: list[Callback] | None = None, show_summary: bool = True,
                 **kwargs: Any) -> None:
        kwargs.setdefault("run", False)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("seed_everything_default", 42)
        kwargs.setdefault("save_config_callback", TrackedConfig)
        kwargs.setdefault("auto_configure_optimizers", False)
        kwargs.setdefault("trainer_defaults", {"accelerator": "auto", "use_distributed_sampler": False,
                                               "log_every_n_steps": 10})
        kwargs.setdefault("parser_kwargs", {"description": __doc__.splitlines()[0] if __doc__ else None})
        self.context: RunContext | None = None
        self.lock: RunLock | None = None
        args = kwargs.get("args")  # the command line (None for a config given as a dict) names a run without a name
        self.command_args = [str(a) for a in sys.argv[1:]] if args is None else \
            [str(a) for a in args] if isinstance(args, (list, tuple)) else None
        #: Callbacks a caller adds to every launch (the Python API's progress lines), not part of the config.
        self.extra_callbacks: list[Callback] = list(extra_callbacks or [])
        #: Print the end table (the CLI); the Python API renders :attr:`summary` itself.
        self.show_summary = show_summary
        #: The end table's title and rows (global rank 0, once ``fit`` returned).
        self.summary: tuple[str, list[tuple[str, str]]] | None = None
        super().__init__(**kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--experiment", type=str, default="default", help="MLflow experiment name.")
        parser.add_argument("--run_name", type=str | None, default=None,
                            help="Run name; relaunching with the same name resumes the run.")
        parser.add_argument("--runs_root", type=str, default="runs",
                            help="Root of the run directories: a local path or an fsspec URL (s3://bucket/runs, "
                                 "gs://..., az://...) that outlives the machine.")
        parser.add_argument("--staging_root", type=str, default="runs",
                            help="Local directory for a remote run's files before upload and after download.")
        parser.add_argument("--ckpt_path", type=str | None, default=None,
                            help="Resume from this checkpoint instead of the run's newest good one.")
        parser.add_argument("--fresh", type=bool, default=False,
                            help="Start over: set the run's old checkpoints aside and open a new MLflow run.")
        parser.add_argument("--async_checkpoint", type=bool, default=True,
                            help="Write periodic checkpoints in a background thread.")
        parser.add_argument("--cpu_threads", type=str, default="auto",
                            help="CPU threads per process: 'auto' (torch's count when the run starts: every "
                                 "core for one process, a launcher's division for several, or OMP_NUM_THREADS; "
                                 "held for the run's life and set again on resume, so results never depend on "
                                 "the machine's load), a fixed count N (threads sleep while they wait), "
                                 "'adaptive' (fewer threads while other work holds cores: faster on a busy "
                                 "machine, but resumes and reproductions are no longer bitwise), or 'torch' "
                                 "(torch's own defaults, held like auto).")
        parser.add_argument("--oversubscribe", type=bool, default=False,
                            help="Start more CPU processes than the machine has cores (refused otherwise: they "
                                 "share the cores and crawl). For tests of many ranks on a small machine.")
        parser.add_argument("--system_metrics", type=bool, default=True,
                            help="Sample CPU, memory, disk and network into the MLflow run every 10 s (MLflow's "
                                 "system metrics: a thread beside the training step).")
        parser.add_argument("--log_model", type=bool, default=True,
                            help="Log the trained model to MLflow at the end (skip for sweeps and drills).")
        parser.add_lightning_class_args(PublishedModelCheckpoint, "checkpoint")
        parser.set_defaults({
            "checkpoint.monitor": DEFAULT_METRIC,
            "checkpoint.mode": "max",
            "checkpoint.save_top_k": 1,
            "checkpoint.filename": "best-{epoch:03d}-{step:08d}",
            "checkpoint.auto_insert_metric_name": False,
        })
        parser.add_lightning_class_args(SpotCheckpoint, "spot")
        parser.add_lightning_class_args(CostTracker, "cost")
        parser.add_lightning_class_args(ElasticResume, "elastic")
        # dollars move slowly: a point every 100 steps draws the curve at a tenth of the store writes; the bill
        # starts at the process's spawn, so a launch's imports are paid and show as start-up in the ledger
        parser.set_defaults({"cost.log_every_n_steps": 100, "cost.bill_from": "spawn"})

    # ------------------------------------------------------------ run context
    def before_instantiate_classes(self) -> None:
        cfg = self.config
        check_devices(cfg.trainer, bool(cfg.get("oversubscribe")))
        check_trainer_values(cfg.trainer)
        apply_cpu_threads(cfg.get("cpu_threads", "auto"))
        experiment = cfg.experiment
        inherited = os.environ.get(ENV_RUN_NAME) if launched_by_parent() else None
        run_name = cfg.run_name if cfg.run_name is not None else (inherited or default_run_name(self.command_args))
        # names are directories under the runs root: they must stay inside it; URLs carry no credentials
        check_name("--experiment", experiment)
        check_name("--run_name", run_name)
        for flag in ("runs_root", "staging_root", "ckpt_path"):
            check_location(f"--{flag}", cfg.get(flag))
        run_url = None
        if remote_store.is_remote(cfg.runs_root):
            run_url = remote_store.join(cfg.runs_root, experiment, run_name)
            run_dir = Path(cfg.staging_root) / experiment / run_name
            if not launched_by_parent():  # the launching process has checked
                try:
                    remote_store.check_writable(cfg.runs_root)
                except StoreError as err:
                    raise UsageError(f"--runs_root {err}") from err
        else:
            run_dir = remote_store.local_path(cfg.runs_root) / experiment / run_name
        tracking_uri = tracking.tracking_uri()
        self.context = RunContext(experiment, run_name, run_dir, tracking_uri, None, None, run_url)
        rank = global_rank_from_env()
        # one process decides for the job: the launching one (Lightning's launcher passes its decision on in the
        # environment), or global rank 0 under torchrun (the others receive it: recipes/run/agree.py)
        decides = not launched_by_parent() and (rank == 0 or not agent_store_available())
        if decides:
            check_tracking_server(tracking_uri)
            self._lock_run(self.context, cfg.runs_root)
            try:
                tracking.ensure_store(tracking_uri)
            except BaseException as err:  # refused (exit 2) or failed (a full disk: exit 1): no lock left behind
                self._release_lock()
                if isinstance(err, TrackingError):
                    raise UsageError(str(err)) from err
                raise
        try:
            ctx = self.context

            def here(decision: dict[str, Any]) -> dict[str, Any]:
                return {**decision, "ckpt_path": checkpoint_here(decision["ckpt_path"], cfg, ctx)}
            try:
                decision = here(decide_start(cfg, ctx)) if launched_by_parent() else \
                    decided_once(lambda: decide_start(cfg, ctx), rank, accept=here)
            except DecisionFailed as failed:  # refused, or found complete, elsewhere: this rank ends the same way
                if failed.kind == "AlreadyComplete":
                    raise AlreadyComplete(str(failed)) from None
                if failed.kind == "UsageError":
                    raise UsageError(str(failed)) from None
                raise
            ckpt_path, run_id = decision["ckpt_path"], decision["mlflow_run_id"]
            self.context.ckpt_path, self.context.mlflow_run_id = ckpt_path, run_id
            if decision["note"] and decides:
                log.warning("%s", decision["note"])
            # ranks that Lightning launches re-run this command: tell them what was decided
            os.environ[ENV_RUN_NAME] = run_name
            os.environ[ENV_CKPT_PATH] = ckpt_path or ""
            os.environ[ENV_MLFLOW_RUN_ID] = run_id or ""
            for key in ("checkpoint", "spot"):
                if cfg[key].get("dirpath") is None:
                    cfg[key]["dirpath"] = str(self.context.checkpoint_dir)
            self.save_config_kwargs = {**self.save_config_kwargs, "run_dir": str(run_dir)}
        except BaseException:
            self._release_lock()  # refused or failed at start-up: an in-process caller may launch it again
            raise

    def instantiate_classes(self) -> None:
        """Lightning's; a class refusing its values at construction lets go of the run (no lock, no folder left)."""
        try:
            super().instantiate_classes()
        except BaseException:
            self._release_lock()
            raise

    def _lock_run(self, ctx: RunContext, runs_root: str) -> None:
        """Hold the run directory for this process's life (global rank 0 only): a second launch is refused."""
        if global_rank_from_env() != 0:
            return
        lock = RunLock(ctx.run_dir)
        try:
            lock.acquire()
        except RunLocked as held:
            raise UsageError(f"run {ctx.experiment}/{ctx.run_name} is already running ({held}); wait for it to "
                             "end, or choose another --run_name.") from None
        except OSError as err:
            raise UsageError(f"--runs_root {redact(runs_root)}: cannot write the run directory {ctx.run_dir} "
                             f"({err.strerror or err}).") from None
        self.lock = lock

    def _release_lock(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # ---------------------------------------------------------------- trainer
    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        assert self.context is not None
        ctx = self.context
        config = dict(config)
        nodes = torchrun_nodes()
        if nodes is not None and config.get("num_nodes", 1) != nodes:  # torchrun --nnodes MIN:MAX: the round's
            if global_rank_from_env() == 0:
                print(f"torchrun: this rendezvous round has {nodes} node(s); training on {nodes} "
                      f"(trainer.num_nodes was {config.get('num_nodes', 1)}).", file=sys.stderr)
            config["num_nodes"] = nodes
        seed = self.config.get("seed_everything")
        extra: list[Callback] = [Manifest(ctx.run_dir, seed=seed if isinstance(seed, int) else None,
                                          argv=[redact(arg) for arg in sys.argv]),
                                 Baselines(metric=self.config.checkpoint.monitor or DEFAULT_METRIC, defer=True)]
        if ctx.run_url is not None:
            extra.append(UploadRunFiles(ctx.run_dir, ctx.run_url))
        extra += [RelocateCheckpointState(), AgreedStart(ctx.run_name, ctx.ckpt_path)]
        extra += [WrapUpSignals(), ReleaseInterruptedFrames()]
        if self.config.log_model:
            extra.append(LogModel(defer=True))  # logged by fit() once trainer.fit has returned
        extra += self.extra_callbacks
        user_callbacks = list(config.get("callbacks") or []) + callbacks + self.extra_callbacks
        threads = cpu_thread_callback(self.config.get("cpu_threads", "auto"), user_callbacks)
        if threads is not None:
            extra.append(threads)
        if not any(isinstance(cb, StepTiming) for cb in user_callbacks):  # a config may bring its own
            extra.append(StepTiming())
        if config.get("enable_progress_bar", True) is not False and not any(
                isinstance(cb, ProgressBar) for cb in user_callbacks):
            extra.append(RunProgressBar(leave=True))
        config["profiler"] = config.get("profiler") or QuietProfiler()  # Lightning's default, less its per-hook cost
        if config.get("logger") in (None, True):
            # one writer thread: batches are written in the order they were logged (MLflow's default of
            # 10 workers may write two windows out of order)
            os.environ.setdefault(ASYNC_LOGGING_THREADS_ENV, "1")
            os.environ.setdefault(ASYNC_LOGGING_BUFFER_ENV, ASYNC_LOGGING_BUFFER_S)
            # a relaunch logs no point the run holds already: its history stays an uninterrupted run's
            config["logger"] = ResumableMLFlowLogger(
                experiment_name=ctx.experiment,
                run_name=ctx.run_name,
                tracking_uri=ctx.tracking_uri,
                run_id=ctx.mlflow_run_id,
                # created with the run, atomically: a relaunch finds the run even if killed a moment later
                tags={**search_tags(self.config), **(run_tags() or {}), RUN_DIR_TAG: ctx.identity},
                # metrics go through MLflow's async queue: a sqlite/HTTP write per logging window on the
                # training thread cost milliseconds a step. set_terminated (Lightning's finalize, and
                # ours on failure) drains it before the run ends, an atexit hook at process exit.
                synchronous=False,
                # what the resumed checkpoint's record carries that the store may have lost (PublishGate)
                restore=pending_points(ctx.ckpt_path),
            )
        plugins = config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            # a checkpoint is published once the metrics of its steps are in the store: a relaunch misses none
            logger = config.get("logger")
            gate = PublishGate(logger.unconfirmed) if isinstance(logger, ResumableMLFlowLogger) else None
            if gate is not None:
                logger.watch_writes()
                extra.append(LoggedThrough(gate))
            io = AtomicCheckpointIO(mirror=ctx.remote_checkpoints(), gate=gate)
            plugins.append(BoundedAsyncCheckpointIO(io) if self.config.async_checkpoint else io)
        config["plugins"] = plugins
        trainer = super()._instantiate_trainer(config, callbacks + extra)
        for callback in trainer.callbacks:
            if isinstance(callback, (StepTiming, CostTracker)):
                callback.defer_plot = True  # drawn by fit() once trainer.fit has returned
        return trainer

    # ------------------------------------------------------------------ fit
    def mlflow_logger(self) -> MLFlowLogger | None:
        return next((lg for lg in self.trainer.loggers if isinstance(lg, MLFlowLogger)), None)

    def fit(self) -> int:
        """Train, then report; returns the process exit code."""
        assert self.context is not None
        ctx = self.context
        logger = self.mlflow_logger()
        monitor = None
        run_id: str | None = None  # once the MLflow run exists (rank zero): whatever stops the launch ends it
        self._stops_before = stops_raised()  # an earlier fit's stops (this process's) were handled there
        self._prepare_data()
        if logger is not None and self.trainer.is_global_zero:
            import mlflow  # global rank 0 alone: the other ranks never import MLflow

            mlflow.set_tracking_uri(ctx.tracking_uri)
            tracking.ensure_experiment(mlflow.MlflowClient(ctx.tracking_uri), ctx.experiment)  # races tolerated
        try:
            if logger is not None and self.trainer.is_global_zero:
                client, run_id = logger.experiment, logger.run_id  # creates the run, or reopens a resumed one
                if ctx.mlflow_run_id:
                    client.update_run(run_id, status="RUNNING")
                os.environ[ENV_MLFLOW_RUN_ID] = run_id
                if self.config.system_metrics:
                    monitor = self._start_system_metrics(run_id, resume=bool(ctx.mlflow_run_id))
            start = time.monotonic()
            with frozen_setup_objects(), cheap_gpu_checks():
                # checkpoints may come from a shared bucket: never unpickle code from them
                self.trainer.fit(self.model, datamodule=self.datamodule, ckpt_path=ctx.ckpt_path,
                                 weights_only=True)
            reraise_swallowed_stop(self._stops_before)  # a stop raised into a callback's library and lost there
            if run_id is not None:  # the store's last writes come after Lightning's FINISHED: all in, or it failed
                tracking.confirm_metrics(logger, self.trainer.log_every_n_steps, self.trainer.global_step,
                                         continued=bool(ctx.mlflow_run_id))
        except BaseException as err:
            if logger is not None and run_id is not None:
                # never leave the run RUNNING: a stopped attempt is KILLED (the relaunch continues it)
                release_interrupted_frames(err)  # a stop raised outside trainer.fit: before the store write
                # a stop to be relaunched: a signal, a lost peer, or a component's exit 75 (streamed data gone)
                # (a resume refused on other data, exit 2, leaves the run as it was too: KILLED, resumable)
                stopped = isinstance(err, STOP_EXCEPTIONS) or (
                    isinstance(err, SystemExit) and err.code in (REQUEUE_EXIT_CODE, USAGE_EXIT_CODE)) or (
                    isinstance(err, Exception) and lost_peer(err) is not None)
                try:
                    logger.experiment.set_terminated(run_id, "KILLED" if stopped else "FAILED")
                except Exception as mark_err:  # the store itself may be what failed (full: the end line says so)
                    self.status_unwritten = out_of_space(mark_err) is not None
                    if not self.status_unwritten:
                        log.error("Could not mark MLflow run %s as ended: %s", run_id, mark_err)
            raise
        finally:
            if logger is not None and self.trainer.is_global_zero:
                flush_async_metrics()  # what on_fit_end logged after Lightning's finalize, too
            if monitor is not None:
                monitor.finish()
        duration = time.monotonic() - start
        self._after_fit(logger)
        # the callbacks' asks (SpotCheckpoint's 75 after a notice): the largest wins
        code = max((c for cb in self.trainer.callbacks if isinstance(cb, ExitCode) and (c := cb.exit_code())),
                   default=0)
        interrupted = code == REQUEUE_EXIT_CODE
        if logger is not None and self.trainer.is_global_zero and interrupted:
            logger.experiment.set_terminated(logger.run_id, "KILLED")
        if self.trainer.is_global_zero:
            self.summary = self.summary_rows(duration, interrupted)
            if self.show_summary:
                self.print_summary(*self.summary)
        destroy_process_group()  # every rank got here; recipes.fit then ends the process (recipes.run.shutdown)
        return code

    def _after_fit(self, logger: MLFlowLogger | None) -> None:
        """What the callbacks deferred past ``trainer.fit``, off the training loop (the time plot, the model)."""
        try:
            for callback in self.trainer.callbacks:
                if isinstance(callback, AfterFit):
                    callback.after_fit(self.trainer)
                    reraise_swallowed_stop(self._stops_before)  # a Ctrl-C lost in a writer's library: stop here
            if logger is not None and self.trainer.is_global_zero:
                flush_async_metrics()  # what they logged (the baselines), before the end table and the exit
        except BaseException as err:
            if logger is not None and self.trainer.is_global_zero and logger.run_id:
                release_interrupted_frames(err)  # a stop's frames may hold the store's read lock
                logger.experiment.set_terminated(logger.run_id,
                                                 "KILLED" if isinstance(err, STOP_EXCEPTIONS) else "FAILED")
            raise

    def _prepare_data(self) -> None:
        """Download or check the data before any MLflow run exists: missing data is bad input, not a failed run.

        Lightning calls ``prepare_data`` again inside ``fit``; the datamodules make that a no-op once their files
        are in place."""
        prepare = getattr(self.datamodule, "prepare_data", None)
        if prepare is None or launched_by_parent() or int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return
        try:
            prepare()
        except (OSError, RuntimeError) as err:
            raise UsageError(" ".join(str(err).split()) or repr(err)) from err

    _start_system_metrics = staticmethod(tracking.start_system_metrics)

    def summary_rows(self, duration: float, interrupted: bool) -> tuple[str, list[tuple[str, str]]]:
        """The end table's title and rows: final metrics, baselines and lift, duration, where the run is in MLflow."""
        assert self.context is not None
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()
                   if isinstance(v, (torch.Tensor, float, int)) and torch.as_tensor(v).numel() == 1}
        title = "atscale run — INTERRUPTED (relaunch the same command to resume)" if interrupted \
            else "atscale run — finished"
        rows = [(key, f"{metrics[key]:.4f}") for key in sorted(metrics)]
        for callback in self.trainer.callbacks:
            if isinstance(callback, SummaryRows):
                rows += list(callback.summary_rows(metrics))
        rows.append(("duration", f"{duration:.1f} s (global step {self.trainer.global_step})"))
        logger = self.mlflow_logger()
        if logger is not None:
            rows.append(("mlflow", f"experiment {self.context.experiment!r}, run {logger.run_id}"))
            rows.append(("tracking", redact(self.context.tracking_uri)))
            page = tracking.run_page_url(self.context.tracking_uri, getattr(logger, "experiment_id", None) or "0",
                                         logger.run_id)
            if page is not None:
                rows.append(("view", f"{page} (the Training runs tab; charts under Model metrics)"))
        rows.append(("run dir", redact(self.context.location)))
        return title, rows

    #: The end table, printed with rich (recipes/run/end_table.py).
    print_summary = staticmethod(print_end_table)


def run_cli(args: list[str] | None = None, **kwargs: Any) -> int:
    """Parse, build and fit; bad input -> one line on stderr and exit code 2.

    Until SpotCheckpoint takes the signals over at the start of training (and after it gives them
    back), SIGTERM and SIGINT unwind the process: nothing is left half-written, the MLflow run (if one
    was opened) is marked KILLED, and the exit code is 75 (relaunch to resume) or 130 (Ctrl-C).
    """
    reset_stop_signals()
    outcome = launch(args, **kwargs)
    if outcome.message is not None:
        print(outcome.message, file=sys.stderr if outcome.error else sys.stdout)
    code = outcome.code
    wrap_up_done()
    if stopping() or code in (REQUEUE_EXIT_CODE, SIGINT_EXIT_CODE):  # a stop: nothing more to do
        ignore_stop_signals()
    return rank_exit_code(code, launched_by_parent())


@dataclass
class Launch:
    """What one launch came to: its exit code, the CLI object (once built) and the line it has for a person."""

    code: int
    cli: AtscaleCLI | None = None
    #: The one line the command prints (``error: ...`` on stderr; "already complete" on stdout), if any.
    message: str | None = None
    #: Whether :attr:`message` is an error (stderr) rather than a note (stdout).
    error: bool = False
    #: Bad input (exit 2): :attr:`message` says which value.
    usage: bool = False


def launch(args: list[str] | None, **kwargs: Any) -> Launch:
    """Parse, build and fit in this process, printing nothing of its own outcome: the CLI prints
    :attr:`Launch.message`, the Python API (:mod:`recipes.api`) raises or returns it. Failures that are not bad
    input, a stop or a full machine are raised, as the command raises them."""
    quiet_known_noise()
    install_stop_signals()
    cli: AtscaleCLI | None = None
    kwargs.setdefault("parser_kwargs", {})
    kwargs["parser_kwargs"] = {"exit_on_error": False, **kwargs["parser_kwargs"]}
    try:
        cli = AtscaleCLI(args=args, **kwargs)
        try:
            code = cli.fit()
            resume = resume_line(cli.trainer.global_step, cli.command_args) \
                if code == REQUEUE_EXIT_CODE and cli.trainer.is_global_zero else None
            return Launch(code, cli, resume, error=resume is not None)
        finally:
            cli._release_lock()  # this launch is over: an in-process caller (tests, a bench) may launch it again
    except AlreadyComplete as done:
        return Launch(0, cli, str(done))
    except argparse.ArgumentError as err:  # jsonargparse's parse errors: the message, not the 70-line usage
        return Launch(USAGE_EXIT_CODE, cli, f"error: {redact(parse_error_message(str(err)))}\n"
                      f"(python -m recipes.fit --help lists every option)", error=True, usage=True)
    except (UsageError, MisconfigurationException, ValueError, TypeError, FileNotFoundError) as err:
        if cli is not None and not isinstance(err, UsageError):
            raise  # past start-up these are failures, not bad input
        message = str(err)
        if message.startswith("Does not validate against any of the Union subtypes"):  # raised while instantiating
            message = parse_error_message(message)
        return Launch(USAGE_EXIT_CODE, cli, f"error: {redact(message)}", error=True, usage=True)
    except SystemExit as err:
        rank = global_rank_from_env()
        if isinstance(err, StreamStopped) and rank != 0:  # rank 0 sees a lost peer: it prints this line, this code
            stop_line.leave(err.line, rank, int(err.code or 0))
        if err.code != REQUEUE_EXIT_CODE:
            raise
        # a component ended the run to be relaunched (the streamed data loader, after its one line): a stop, as a
        # notice is, so a rank Lightning's launcher started reports it as one (run_cli: 0 there)
        return Launch(REQUEUE_EXIT_CODE, cli)
    except DecisionFailed as err:
        return Launch(1, cli, f"error: global rank 0 failed to decide where the run starts ({err.kind}: {err}); its "
                      "output says why.", error=True)
    except STOP_EXCEPTIONS as err:
        signum = err.signum if isinstance(err, Interrupted) else (
            signal.SIGINT if isinstance(err, KeyboardInterrupt) else signal.SIGTERM)
        return Launch(SIGINT_EXIT_CODE if signum == signal.SIGINT else REQUEUE_EXIT_CODE, cli,
                      f"interrupted ({signal.Signals(signum).name}): the run stopped; relaunch the same command to "
                      "resume it.", error=True)
    except Exception as err:
        peer = lost_peer(err)
        if peer is not None:
            world = getattr(getattr(cli, "trainer", None), "world_size", 1)
            left = stop_line.left_by_peers(world) if world > 1 else None
            if left is not None:  # the peer stopped the run in order, and said why (and with which exit code)
                return Launch(left[0], cli, left[1], error=True)
            return Launch(REQUEUE_EXIT_CODE, cli, f"error: a peer process was lost ({peer}): the run stopped; relaunch "
                          "to resume it from its newest checkpoint (torchrun --nnodes MIN:MAX restarts on the nodes "
                          "left).", error=True)
        trainer = getattr(cli, "trainer", None)  # a full tracking store or disk: the machine's, in one line
        line = machine_failure(err, cli.context.tracking_uri if cli is not None and cli.context else None,
                               trainer.global_step if trainer is not None else None,
                               getattr(cli, "status_unwritten", False))
        if line is None:
            raise
        return Launch(1, cli, redact(line), error=True)

