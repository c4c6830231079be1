"""Run a sweep's trials as ``python -m recipes.fit`` processes, ``--parallel`` at a time, until none is left.

Each trial is a real run of the recipe with the trial's parameters as overrides: its own run directory
``<runs_root>/<experiment>/<name>-t<number>``, checkpoints, cost accounting and baselines, and an MLflow run
nested under the sweep's parent run (tags ``sweep``, ``trial``). The trial reports its metric and is pruned
from inside (:class:`recipes.sweep.pruning.SweepTrial`); this process only starts trials, watches them
end, and tells the study how each ended:

========================  ======================================================================
trial process ends        trial
========================  ======================================================================
0, pruned                 PRUNED (the run is FINISHED, tagged ``pruned``)
0                         COMPLETE, valued by its last reported metric
75 (saved on a notice)    back to WAITING: the next claimant resumes it from its checkpoints (also a
                          trial this process stopped before it could save: killed by the SIGTERM)
anything else             FAIL (its log: ``<sweep dir>/trial-<number>.log``)
========================  ======================================================================

SIGTERM, SIGUSR1 or SIGINT to this process: every running trial gets SIGTERM, saves and exits 75, goes back
to WAITING, and this process exits 75 (130 after SIGINT). A trial process also gets SIGTERM if this process
dies without a word (Linux's parent-death signal).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState
from rich.console import Console

from callbacks.analysis import keys
from recipes.run.common import ENV_FROM_PARENT, ENV_PARENT_RUN_ID, ENV_RUN_TAGS, SIGINT_EXIT_CODE
from recipes.run.tracking import redact

from . import report
from .pruning import ENV_SWEEP_STORAGE
from .space import Space, override_args
from .study import (
    ATTEMPTS_ATTR,
    HEARTBEAT_S,
    PARENT_RUN_ATTR,
    PRUNED_ATTR,
    RUN_ID_ATTR,
    RUN_NAME_ATTR,
    claim_trial,
    heartbeat,
    make_sampler,
    release,
    stale_trials,
    study_lock,
    trial_id,
)

#: recipes.fit's exit status after a notice save (callbacks.spot.REQUEUE_EXIT_CODE; not imported: no torch here).
REQUEUE_EXIT_CODE = 75
POLL_S = 0.25
_PR_SET_PDEATHSIG = 1


@dataclass
class Child:
    """A running trial process."""

    number: int
    trial_id: int
    proc: subprocess.Popen
    log: Path
    beat: float
    slot: int = 0


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def outcome(code: int, pruned: bool, reported: bool, stopping: bool) -> str:
    """How a trial whose process exited with ``code`` ended: ``WAITING`` (to resume), ``PRUNED``, ``COMPLETE``
    or ``FAIL``.

    75 is a save on a notice. While this process is stopping, a trial it sent SIGTERM before the trial had
    taken the signals over (its first seconds, importing) dies of it (-15) or stops with 130: it lost
    nothing a relaunch cannot redo, so it goes back to the queue too, never to FAIL.
    """
    if code == REQUEUE_EXIT_CODE or (stopping and code in (-signal.SIGTERM, SIGINT_EXIT_CODE)):
        return "WAITING"
    if code == 0 and pruned:
        return "PRUNED"
    if code == 0 and reported:
        return "COMPLETE"
    return "FAIL"


def gpu_slots(parallel: int) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` of each of ``parallel`` slots: the visible GPUs divided among them, or none
    (a CPU machine, or fewer GPUs than slots: the trials then share what there is)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        import torch

        count = torch.cuda.device_count()
    except ImportError:  # pragma: no cover
        count = 0
    ids = [i.strip() for i in visible.split(",") if i.strip()] if visible else [str(i) for i in range(count)]
    ids = ids[:count]
    if parallel < 2 or len(ids) < parallel:
        return []
    per = len(ids) // parallel
    return [",".join(ids[i * per:(i + 1) * per]) for i in range(parallel)]


def suggest(trial: optuna.Trial, space: Space) -> dict[str, Any]:
    """The trial's parameters: sampled now, or the ones it already has (a resumed trial keeps them)."""
    params: dict[str, Any] = {}
    for key, dist in space.items():
        if isinstance(dist, CategoricalDistribution):
            params[key] = trial.suggest_categorical(key, list(dist.choices))
        elif isinstance(dist, IntDistribution):
            params[key] = trial.suggest_int(key, dist.low, dist.high, step=dist.step, log=dist.log)
        elif isinstance(dist, FloatDistribution):
            params[key] = trial.suggest_float(key, dist.low, dist.high, step=dist.step, log=dist.log)
    return params


class Sweep:
    """One process's part of a sweep (module docstring)."""

    def __init__(self, args: Any, extra: list[str], space: Space, recipe: Any, study: optuna.Study,
                 storage: optuna.storages.RDBStorage, console: Console) -> None:
        self.args, self.extra, self.space, self.recipe = args, extra, space, recipe
        self.study, self.storage, self.console = study, storage, console
        self.children: dict[int, Child] = {}
        self.stop_signal: int | None = None
        self.budget_stopped = False
        self.client = mlflow.MlflowClient(args.tracking_uri)
        self.experiment_id = self._experiment_id()
        root = Path("runs") if "://" in recipe.runs_root else Path(recipe.runs_root)
        self.out_dir = root / recipe.experiment / args.name
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.parent_run_id = self._parent_run()
        self.threads = max(1, (os.cpu_count() or 1) // args.parallel)
        self.gpu_slots = gpu_slots(args.parallel)
        self._claim_after = 0.0

    # ---------------------------------------------------------------- setup
    def _experiment_id(self) -> str:
        from recipes.run.tracking import ensure_experiment, ensure_store

        ensure_store(self.args.tracking_uri)  # a new sqlite store created whole, before any trial opens it
        return ensure_experiment(self.client, self.recipe.experiment)

    def _parent_run(self) -> str:
        with study_lock(self.storage, self.args.storage, self.args.name):
            run_id = self.study.user_attrs.get(PARENT_RUN_ATTR)
            if run_id:
                self.client.update_run(run_id, status="RUNNING")
                return str(run_id)
            run = self.client.create_run(self.experiment_id, run_name=self.args.name,
                                         tags={keys.KIND_TAG: "sweep", keys.SWEEP_NAME_TAG: self.args.name})
            run_id = run.info.run_id
            params = {"space": json.dumps({k: str(v) for k, v in self.space.items()}), "trials": self.args.trials,
                      "metric": self.args.metric, "mode": self.args.mode, "sampler": self.args.sampler,
                      "pruner": self.args.pruner, "seed": self.args.seed, "configs": ",".join(self.args.config),
                      "overrides": " ".join(self.extra), "storage": redact(self.args.storage)}
            self.client.log_batch(run_id, params=[mlflow.entities.Param(k, str(v)[:6000]) for k, v in params.items()])
            self.study.set_user_attr(PARENT_RUN_ATTR, run_id)
            return run_id

    # ----------------------------------------------------------------- trials
    def command(self, number: int, params: dict[str, Any]) -> list[str]:
        """The ``python -m recipes.fit`` command line of trial ``number``."""
        callback = {"class_path": "recipes.sweep.pruning.SweepTrial",
                    "init_args": {"study": self.args.name, "trial": number, "metric": self.args.metric,
                                  "pruner": self.args.pruner, "startup_trials": self.args.pruner_startup,
                                  "warmup_epochs": self.args.pruner_warmup}}
        cmd = [sys.executable, "-m", "recipes.fit"]
        for config in self.args.config:
            cmd += ["--config", config]
        cmd += ["--run_name", self.run_name(number), "--trainer.enable_progress_bar", "false",
                "--spot.requeue_slurm", "false", "--cpu_threads", str(self.threads), *self.extra,
                *override_args(params), f"--trainer.callbacks+={json.dumps(callback)}"]
        return cmd

    def run_name(self, number: int) -> str:
        return f"{self.args.name}-t{number:03d}"

    def env(self, number: int, slot: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ENV_FROM_PARENT}
        if self.gpu_slots:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu_slots[slot]
        env.setdefault("MLFLOW_TRACKING_URI", self.args.tracking_uri)
        env.update({ENV_PARENT_RUN_ID: self.parent_run_id, ENV_SWEEP_STORAGE: self.args.storage,
                    ENV_RUN_TAGS: json.dumps({keys.TRIAL_SWEEP_TAG: self.args.name, keys.TRIAL_TAG: str(number)}),
                    "PYTHONUNBUFFERED": "1"})
        return env

    def claim(self) -> optuna.Trial | None:
        """The next WAITING trial, claimed, with its own seeded sampler (:func:`recipes.sweep.study.claim_trial`)."""
        return claim_trial(self.study, self.storage, self.args.storage,
                           sampler=lambda number: make_sampler(self.args.sampler, self.args.seed, number))

    def start(self, trial: optuna.Trial) -> None:
        number = trial.number
        tid = trial_id(self.storage, self.study, number)
        params = suggest(trial, self.space)  # by the sampler claim() gave the study for this trial
        attempts = int(trial.user_attrs.get(ATTEMPTS_ATTR, 0)) + 1
        trial.set_user_attr(RUN_NAME_ATTR, self.run_name(number))
        trial.set_user_attr(ATTEMPTS_ATTR, attempts)
        log = self.out_dir / f"trial-{number:03d}.log"
        cmd = self.command(number, params)
        shown = ", ".join(f"{k.rsplit('.', 1)[-1]}={report.param_text(v)}" for k, v in params.items())
        how = "resumes" if attempts > 1 else "starts"
        self.console.print(f"trial {number} {how} ({self.run_name(number)}): {shown}", highlight=False)
        with open(log, "a") as out:
            out.write(f"\n=== attempt {attempts}: {' '.join(cmd[1:])}\n")
            out.flush()
            slot = min(set(range(self.args.parallel)) - {c.slot for c in self.children.values()})
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env(number, slot),
                                    start_new_session=True, preexec_fn=_die_with_parent)
        self.children[number] = Child(number, tid, proc, log, time.monotonic(), slot)

    def finish(self, child: Child, code: int) -> None:
        """Tell the study how the trial process ended (module docstring's table)."""
        frozen = self.storage.get_trial(child.trial_id)
        number = child.number
        state = outcome(code, PRUNED_ATTR in frozen.user_attrs, bool(frozen.intermediate_values),
                        self.stop_signal is not None)
        if state == "WAITING":
            release(self.storage, child.trial_id)
            self.console.print(f"trial {number} interrupted (exit {code}): back in the queue (resumes on "
                               "relaunch)", highlight=False)
            return
        if state == "PRUNED":
            self.study.tell(number, state=TrialState.PRUNED)
        elif state == "COMPLETE":
            last = frozen.intermediate_values[max(frozen.intermediate_values)]
            self.study.tell(number, last)
        else:
            why = f"exit {code}" if code else f"it reported no {self.args.metric}"
            self.storage.set_trial_user_attr(child.trial_id, "failure", why)
            self.study.tell(number, state=TrialState.FAIL)
            self.console.print(f"trial {number} failed ({why}); log {child.log}", highlight=False)
        run_id = frozen.user_attrs.get(RUN_ID_ATTR)
        if run_id:
            with contextlib.suppress(Exception):
                self.client.set_tag(run_id, keys.TRIAL_STATE_TAG, state)
        value = self.storage.get_trial(child.trial_id).value
        shown = f": {self.args.metric} {value:.4f}" if value is not None else ""
        self.console.print(f"trial {number} {state.lower()}{shown}", highlight=False)

    def reap(self) -> None:
        for number, child in list(self.children.items()):
            code = child.proc.poll()
            if code is None:
                if time.monotonic() - child.beat > HEARTBEAT_S:
                    heartbeat(self.storage, child.trial_id)
                    child.beat = time.monotonic()
                continue
            del self.children[number]
            self.finish(child, code)
            self._claim_after = 0.0  # a slot is free (and a trial may be back in the queue): claim now

    # ----------------------------------------------------------------- budget
    def over_budget(self) -> bool:
        """Whether starting one more trial could pass ``--budget-usd`` (spent + running projections + the
        mean cost of a finished trial)."""
        if self.args.budget_usd is None:
            return False
        runs = report.child_runs(self.client, self.experiment_id, self.args.name)
        trials = self.study.get_trials(deepcopy=False)
        cash = report.money(runs, trials)
        finished = [cash.per_trial[t.number][0] for t in trials
                    if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and t.number in cash.per_trial]
        estimate = sum(finished) / len(finished) if finished else 0.0
        ahead = 0.0
        for t in trials:
            if t.state == TrialState.RUNNING:
                usd, projected = cash.per_trial.get(t.number, (0.0, None))
                ahead += max(0.0, (projected if projected is not None else estimate) - usd)
        if cash.spent_usd + ahead + estimate > self.args.budget_usd:
            self.console.print(f"budget: ${cash.spent_usd:.4f} spent + ${ahead:.4f} projected for the running "
                               f"trials + ${estimate:.4f} for one more > ${self.args.budget_usd:.4f}: no new trial "
                               "starts", highlight=False)
            return True
        return False

    # ------------------------------------------------------------------- loop
    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
            for child in self.children.values():
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)

    def run(self) -> int:
        """Claim and run trials until none is left (or the budget or a signal stops it); the exit code."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
        status = "FAILED"
        try:
            self._recover()
            while True:
                self.reap()
                if self.stop_signal is None and not self.budget_stopped and time.monotonic() >= self._claim_after:
                    while len(self.children) < self.args.parallel and self.stop_signal is None:
                        if self.over_budget():
                            self.budget_stopped = True
                            break
                        trial = self.claim()
                        if trial is None and not self.children:
                            trial = self.claim() if self._recover() else None
                        if trial is None:
                            self._claim_after = time.monotonic() + 2.0  # nothing to claim: look again later
                            break
                        self.start(trial)
                if not self.children:
                    break
                time.sleep(POLL_S)
            if self.stop_signal is not None:
                status = "KILLED"
                name = signal.Signals(self.stop_signal).name
                self.console.print(f"interrupted ({name}): running trials saved; relaunch the same command to "
                                   "continue the sweep", highlight=False)
                return SIGINT_EXIT_CODE if self.stop_signal == signal.SIGINT else REQUEUE_EXIT_CODE
            status = self.finalize()
            return 0
        finally:
            if self.children:  # an error here: stop the trials (they save) and hand them back, never leave them
                self.stop_signal = self.stop_signal or signal.SIGTERM
            for child in self.children.values():
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)
            for child in list(self.children.values()):
                with contextlib.suppress(Exception):
                    self.finish(child, child.proc.wait(120))
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if status != "RUNNING":
                self.client.set_terminated(self.parent_run_id, status)

    def _recover(self) -> bool:
        handed = stale_trials(self.study, self.storage, self.args.storage, self.args.stale_after,
                              set(self.children))
        if handed:
            self.console.print(f"trial(s) {', '.join(map(str, handed))} had lost their process: back in the "
                               "queue", highlight=False)
        return bool(handed)

    # --------------------------------------------------------------- the end
    def finalize(self) -> str:
        """Report and log to the parent run; returns its status (RUNNING while trials run elsewhere)."""
        trials = self.study.get_trials(deepcopy=False)
        running = [t.number for t in trials if t.state == TrialState.RUNNING]
        waiting = [t.number for t in trials if t.state == TrialState.WAITING]
        runs = report.child_runs(self.client, self.experiment_id, self.args.name)
        cash = report.money(runs, trials)
        self.console.print(report.trials_table(self.study, self.args.metric, cash))
        if running:
            self.console.print(f"trial(s) {', '.join(map(str, running))} still run elsewhere; the process that "
                               "finishes last writes the sweep's report", highlight=False)
            return "RUNNING"
        stopped_by = "stopped by the budget" if waiting and self.budget_stopped else (
            "finished" if not waiting else "stopped")
        from recipes.compare import baselines_for

        best = report.best_trial(self.study)
        best_run = runs.get(best.number) if best is not None else None
        ranked = report.importances(self.study)
        self.console.print(report.summary_table(self.study, self.args.metric, self.args.mode, cash, best_run,
                                                baselines_for(self.args.metric), ranked, stopped_by,
                                                self.args.budget_usd, self.parent_run_id))
        self._log_parent(trials, cash, best, best_run, ranked, stopped_by)
        return "FINISHED"

    def _log_parent(self, trials: list[FrozenTrial], cash: report.Money, best: FrozenTrial | None, best_run: Any,
                    ranked: dict[str, float], stopped_by: str) -> None:
        run_id, now = self.parent_run_id, int(time.time() * 1000)
        counts = {s.name.lower(): sum(t.state == s for t in trials) for s in TrialState}
        metrics = {keys.SWEEP_SPENT_KEY: cash.spent_usd, keys.SWEEP_SAVED_BY_PRUNING_KEY: cash.saved_by_pruning_usd,
                   **{keys.sweep_trials_key(k): float(v) for k, v in counts.items()}}
        if self.args.budget_usd is not None:
            metrics[keys.SWEEP_BUDGET_KEY] = self.args.budget_usd
        if best is not None and best.value is not None:
            metrics[keys.SWEEP_BEST_VALUE_KEY] = best.value
        metrics.update({keys.sweep_importance_key(k): v for k, v in ranked.items()})
        self.client.log_batch(run_id, metrics=[mlflow.entities.Metric(k, float(v), now, 0) for k, v in metrics.items()])
        tags = {keys.SWEEP_STOPPED_BY_TAG: "budget" if self.budget_stopped else stopped_by}
        if best is not None:
            tags[keys.SWEEP_BEST_TRIAL_TAG] = str(best.number)
            if best_run is not None:
                tags[keys.SWEEP_BEST_RUN_TAG] = best_run.info.run_id
        for key, value in tags.items():
            self.client.set_tag(run_id, key, value)
        files = [report.write_csv(self.study, cash, self.out_dir / "trials.csv"),
                 *report.write_plots(self.study, self.out_dir)]
        (self.out_dir / "importances.json").write_text(json.dumps(ranked, indent=2))
        for path in [*files, self.out_dir / "importances.json"]:
            self.client.log_artifact(run_id, str(path))
