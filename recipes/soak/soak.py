"""The soak of one chain: the reference run, then the faults struck on the run's launches, and the checks.

The run is the user's command with short settings, in a scratch directory with a NEW sqlite MLflow store::

    python -m recipes.fit --config configs/digits.yaml [--config configs/strategy/ddp.yaml]
        --trainer.max_epochs 2 --spot.every_n_steps 5
        --trainer.log_every_n_steps 1 --log_model false --trainer.enable_progress_bar false
        --trainer.enable_model_summary false --run_name chaos-1

An uninterrupted reference run of the same command (in a directory of its own) comes first. Every
``--faults-per-run`` faults the run is let finish and is checked, and the soak goes on with the next
run name (``chaos-2``, ...), so that a run always has training left to interrupt; with
``--faults <= --faults-per-run`` it is one run. Each launch is started in a new session (its own
process group: under DDP the rank Lightning starts is in it) and signals go to the whole group.

:class:`Soak` strikes each kind of :mod:`recipes.soak.faults` and checks the invariants after every launch;
:mod:`recipes.bench.chaos` drives one or more chains and :mod:`recipes.soak.report` sums them up.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from callbacks.spot import CHECKPOINT_PATTERN, REQUEUE_EXIT_CODE
from recipes.run.common import SIGINT_EXIT_CODE, USAGE_EXIT_CODE, command_run_name
from recipes.soak.bucket import Bucket
from recipes.soak.dataset import Dataset, data_stop_line, judge_damaged, judge_replaced
from recipes.soak.disk import Disk
from recipes.soak.faults import CORRUPTED, DATA_KINDS, Fault, PlannedFault, RunState, Watch, corrupt
from recipes.soak.launch import (
    EXIT_WATCH_LINE,
    Launch,
    hung_where,
    last_error,
    parse_complete,
    parse_resume,
    unlogged_bound,
)
from recipes.soak.ledger import LEDGER_ARGS, check_ledger
from recipes.soak.observe import EXPERIMENT, Store, good_checkpoints, newest_good, pruned_by_policy

_STORE_ERROR = re.compile(r"sqlalchemy|alembic|no such table|database is locked|schema", re.IGNORECASE)
_POLL_S = 0.02


class Soak:
    """Runs the reference, the faults and the checks; ``run()`` returns the report."""

    def __init__(self, args: argparse.Namespace, console: Console, chain: int | None = None) -> None:
        self.args, self.console = args, console
        self.repo = Path(args.repo).resolve()
        self.root = Path(args.workdir).resolve()
        self.work = self.root if chain is None else self.root / f"chain-{chain}"
        self.prefix = "chaos" if chain is None else f"chaos{chain}"
        self.stop = threading.Event()
        self.logs = self.work / "logs"
        self.chaos = self.work / "chaos"
        self.store = Store(self.chaos / "mlflow.db")
        self.disk = Disk(self.chaos / "runs", args.tmpfs_mb)
        #: ``--store s3``: the object store every launch's run root is in (started by :meth:`open_bucket`).
        self.bucket = Bucket(self.logs / "moto.log") if getattr(args, "store", "local") == "s3" else None
        self.launch_count = 0
        self.launches: list[Launch] = []
        self.faults: list[Fault] = []
        self.runs: list[RunState] = []
        self.tokens: dict[str, int] = {}  # run name -> the token its command carries (see arguments())
        self.watches: list[Watch] = []
        self.awaiting: list[Fault] = []  # faults whose next launch has not decided yet
        self.skipped_kinds: dict[str, str] = {}
        self.reference: dict[str, Any] = {}
        self.store_killed: Fault | None = None
        #: with a kind of ``DATA_KINDS``: the streamed set every launch reads (see :mod:`recipes.soak.dataset`)
        self.dataset: Dataset | None = None
        if set(getattr(args, "kinds", ()) or ()) & set(DATA_KINDS):
            reason = Dataset.unavailable()
            if reason:
                self.skipped_kinds.update(dict.fromkeys(DATA_KINDS, reason))
                console.print(f"[yellow]{', '.join(DATA_KINDS)} faults skipped: {reason}[/]")
            else:
                self.dataset = Dataset(self.repo, self.root / "data", self.work / "data" / "digits")

    # ------------------------------------------------------------ commands
    def command(self, run_name: str, extra: Sequence[str] = (), named: bool = True) -> list[str]:
        """A launch of run ``run_name``; ``named=False`` leaves ``--run_name`` out (the command names its run)."""
        args = self.arguments(self.tokens.get(run_name, 0), chaos=run_name != "reference")
        return [sys.executable, "-m", "recipes.fit", *args, *(["--run_name", run_name] if named else []), *extra]

    def arguments(self, token: int, chaos: bool = True) -> list[str]:
        """The arguments every launch of one run shares. ``token`` (as ``--spot.drill_seed``, which trains nothing
        while no drill rate is set) tells the runs' commands apart: each run is its command's own run
        (``recipes.run.common.command_run_name``), which a launch without ``--run_name`` resumes."""
        a = self.args
        args = ["--config", str(self.repo / (Dataset.CONFIG if self.dataset is not None else "configs/digits.yaml"))]
        if a.ddp:
            args += ["--config", str(self.repo / "configs/strategy/ddp.yaml")]
        if self.dataset is not None:  # streamed, in the experiment the soak reads
            args += ["--experiment", EXPERIMENT, *self.dataset.launch_args(reference=not chaos)]
        args += ["--trainer.max_epochs", str(a.epochs)]
        if a.batches:
            args += ["--trainer.limit_train_batches", str(a.batches)]
        args += ["--spot.every_n_steps", str(a.every), "--trainer.log_every_n_steps", "1", "--log_model", "false",
                 "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                 "--data.num_workers", str(a.workers), "--spot.drill_seed", str(token), *LEDGER_ARGS]
        if self.bucket is not None:
            args += ["--runs_root", self.bucket.url(f"{self.prefix}-runs" if chaos else "reference")]
        return args

    def runs_url(self, run_name: str) -> str:
        """``--store s3``: the run root in the bucket (the reference has a root of its own)."""
        assert self.bucket is not None
        return self.bucket.url("reference" if run_name == "reference" else f"{self.prefix}-runs")

    def ckpt_url(self, run_name: str) -> str:
        return f"{self.runs_url(run_name)}/{EXPERIMENT}/{run_name}/checkpoints"

    def open_bucket(self) -> None:
        if self.bucket is not None:
            self.logs.mkdir(parents=True, exist_ok=True)
            self.bucket.start()

    def expected_resume(self, run_name: str, workdir: Path | None = None) -> tuple[str, int] | None:
        """The checkpoint a launch should resume from: the newest good staged one, or with ``--store s3`` what
        the CLI picks between the bucket and the staging directory (the bucket's, unless a newer one is staged)."""
        staged = newest_good(self.ckpt_dir(run_name, workdir))
        if self.bucket is None:
            return staged
        url = self.ckpt_url(run_name)
        fetched = self.bucket.newest(url)
        if fetched is None:  # the CLI uploads the staged one first only into a bucket without any record
            return staged if not self.bucket.records(url) else None
        return staged if staged is not None and staged[1] > fetched[1] else fetched

    def env(self, workdir: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ATSCALE_", "SLURM_", "MLFLOW_"))}
        env.update({"MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlflow.db'}", "PYTHONPATH": str(self.repo),
                    "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                    # a hung launch is asked for its stacks (SIGABRT) before it is killed: see end()
                    "PYTHONFAULTHANDLER": "1"})
        if self.bucket is not None:
            env = {k: v for k, v in env.items() if not k.startswith("AWS_")}
            env.update(self.bucket.env())
        return env

    def ckpt_dir(self, run_name: str, workdir: Path | None = None) -> Path:
        return (workdir or self.chaos) / "runs" / EXPERIMENT / run_name / "checkpoints"

    def start(self, run_name: str, label: str, extra: Sequence[str] = (), workdir: Path | None = None,
              named: bool = True) -> Launch:
        workdir = workdir or self.chaos
        self.launch_count += 1
        stem = self.logs / f"{self.launch_count:04d}-{label.replace(' ', '_')}"
        expected = self.expected_resume(run_name, workdir)
        with open(f"{stem}.out", "wb") as out, open(f"{stem}.err", "wb") as err:
            started, t0 = time.time(), time.monotonic()
            proc = subprocess.Popen(self.command(run_name, extra, named), cwd=workdir, env=self.env(workdir),
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        launch = Launch(label, run_name, list(extra), started, list(expected) if expected else None,
                        f"{stem}.out", f"{stem}.err", t0=t0, proc=proc)
        self.launches.append(launch)
        return launch

    def wait_until(self, launches: Sequence[Launch], moment: float, until: Any = None) -> bool:
        """Poll until ``moment`` s after the first launch's start (or ``until()`` is true); True if one still runs."""
        while launches[0].elapsed() < moment and any(x.alive() for x in launches):
            if until is not None and until():
                break
            time.sleep(_POLL_S)
        return any(x.alive() for x in launches)

    def end(self, launch: Launch, timeout: float, store: Store | None = None) -> Launch:
        """Wait for ``launch`` (SIGKILL after ``timeout``: hung), make sure its group is gone, read what it left."""
        if not launch.wait(timeout):
            launch.hung = True
            assert launch.proc is not None
            try:  # faulthandler (PYTHONFAULTHANDLER) writes every thread's stack to its stderr, then it aborts
                os.kill(launch.proc.pid, signal.SIGABRT)
                launch.wait(10)
            except ProcessLookupError:
                pass
            launch.send(signal.SIGKILL)
            launch.wait(30)
        assert launch.proc is not None
        launch.exit_code = launch.proc.returncode
        launch.wall_s = round(launch.elapsed(), 3)
        self._reap_group(launch.proc.pid)
        text = launch.stderr()
        resume = parse_resume(text) or parse_complete(Path(launch.out).read_text(errors="replace") + text)
        if resume:
            launch.resumed_path, launch.resumed_from = resume
        launch.traceback = "Traceback (most recent call last)" in text
        if launch.hung:
            launch.hung_where = hung_where(text)
        launch.error_line = next((line for line in text.splitlines() if line.startswith("error:")), None)
        launch.skipped_corrupt = sorted({Path(p).name for p in re.findall(
            r"(\S+\.ckpt) (?:is truncated or changed|fails its SHA-256)", text)})
        steps = (store or self.store).train_steps(launch.run_name, launch.started)
        if steps:
            launch.first_step_s = round(steps[0][1] / 1000 - launch.started, 3)
            launch.furthest_step = max(s for s, _ in steps) + 1  # logged after optimizer step k: step k - 1
        if launch.exit_code == -signal.SIGKILL:  # no loss in the store at all: unknown (None), no upper bound
            launch.unlogged_max = unlogged_bound(steps, launch.started + launch.wall_s)
        launch.decided = resume is not None or bool(steps)
        if launch.decided and resume is None:
            launch.resumed_from = 0
        return launch

    @staticmethod
    def _reap_group(pgid: int) -> None:
        """SIGKILL what is left of a launch's process group (a DDP rank whose parent died) after 10 s."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    # ------------------------------------------------------------ reference
    def run_reference(self) -> None:
        workdir = self.root / "reference"
        workdir.mkdir(parents=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        if self.dataset is not None:
            self.dataset.prepare(self.env(workdir), self.logs / "prepare",
                                 other="dataset_replaced" in self.args.kinds)
        store = Store(workdir / "mlflow.db")
        launch = self.start("reference", "reference", workdir=workdir)
        anchor = self.anchor([launch], self.args.launch_timeout, workdir)
        self.end(launch, self.args.launch_timeout, store)
        if launch.exit_code != 0:
            raise RuntimeError(f"the reference run failed (exit {launch.exit_code}); see {launch.err}:\n"
                               + launch.stderr()[-3000:])
        steps = store.train_steps("reference", launch.started)
        times = [t / 1000 for _, t in steps]
        total = max(s for s, _ in steps) + 1
        self.reference = {
            "workdir": str(workdir), "wall_s": launch.wall_s, "startup_s": launch.first_step_s,
            "anchor_s": anchor if anchor is not None else launch.first_step_s,
            "step_s": (times[-1] - times[0]) / max(len(times) - 1, 1), "steps": total,
            "final": newest_good(self.ckpt_dir("reference", workdir), CHECKPOINT_PATTERN),
            "schema": store.schema(), "launch": launch.record(),
        }

    def anchor(self, launches: Sequence[Launch], limit: float, workdir: Path | None = None) -> float | None:
        """Seconds from the first launch's start to when one of them wrote the run's ``config.yaml`` (None: none did).

        The CLI writes it as training sets up, once the launch's MLflow run is open: the end of start-up.
        """
        config = self.ckpt_dir(launches[0].run_name, workdir).parent / "config.yaml"
        started = min(x.started for x in launches)
        while any(x.alive() for x in launches) and launches[0].elapsed() < limit:
            try:
                if config.stat().st_mtime >= started:
                    return launches[0].elapsed()
            except OSError:
                pass
            time.sleep(0.05)
        return None

    def moment(self, plan: PlannedFault, launches: Sequence[Launch]) -> float:
        """The planned fault's moment for these launches, in seconds from the first one's start.

        Start-up: ``u`` x the reference's launch-to-:meth:`anchor` time (imports, MLflow store, no run
        yet). Early: from this launch's own anchor (its MLflow run is open) to its first periodic save.
        Training: from its first step to its expected last save (the reference's step time x the steps
        it has left). Waits for the anchor where the phase needs it.
        """
        ref = self.reference
        if plan.phase == "startup":
            return plan.u * ref["anchor_s"]
        seen = self.anchor(launches, limit=3 * ref["startup_s"] + 30)
        opened = seen if seen is not None else ref["anchor_s"]
        to_first_step = ref["startup_s"] - ref["anchor_s"]
        if plan.phase == "early":
            return opened + plan.u * (to_first_step + self.args.every * ref["step_s"])
        done = (launches[0].expected_resume or [None, 0])[1]
        left = max(ref["steps"] - done, 0) * ref["step_s"]
        return opened + to_first_step + plan.u * max(left, 0.5)

    # ------------------------------------------------------------ fault kinds
    def strike(self, fault: Fault, launches: list[Launch], moment: float, action: Any, until: Any = None) -> None:
        """At ``moment`` (if a launch still runs): note the protected checkpoints, then ``action()``."""
        if not self.wait_until(launches, moment, until):
            fault.struck = False
            return
        self.protect(fault, launches)
        fault.moment_s = round(launches[0].elapsed(), 3)
        action()

    def protect(self, fault: Fault, launches: list[Launch]) -> None:
        points = []
        for launch in launches:  # what it resumed from; if it has not said yet, what it should resume from
            resume = parse_resume(launch.stderr())
            points.append(resume[1] if resume else (launch.expected_resume or [None, 0])[1])
        resumed = min(points)
        newer = {n: s for n, s in good_checkpoints(self.ckpt_dir(fault.run_name)).items() if s > resumed}
        if newer:
            self.watches.append(Watch(fault, newer))

    def fault_kill(self, fault: Fault, plan: PlannedFault, sig: signal.Signals) -> list[Launch]:
        launch = self.start(fault.run_name, f"{fault.kind}")
        self.strike(fault, [launch], self.moment(plan, [launch]), lambda: launch.send(sig))
        return [self.end(launch, self.args.launch_timeout)]

    def fault_group_signal(self, fault: Fault, plan: PlannedFault) -> list[Launch]:
        """SIGTERM or SIGINT to the launch's whole process group (its loader workers and ranks included)."""
        sig = signal.SIGINT if plan.signal == "SIGKILL" else signal.SIGTERM
        fault.detail["signal"] = sig.name
        return self.fault_kill(fault, plan, sig)

    def fault_default_name(self, fault: Fault, plan: PlannedFault) -> list[Launch]:
        """The run's command without ``--run_name`` (a scheduler's relaunch), SIGTERMed at the moment: it must be
        this run's launch (no other run directory appears), resume it and save."""
        before = {p.name for p in (self.chaos / "runs" / EXPERIMENT).glob("*")}
        launch = self.start(fault.run_name, fault.kind, named=False)
        self.strike(fault, [launch], self.moment(plan, [launch]), lambda: launch.send(signal.SIGTERM))
        ended = self.end(launch, self.args.launch_timeout)
        other = sorted({p.name for p in (self.chaos / "runs" / EXPERIMENT).glob("*")} - before - {fault.run_name})
        if other:
            fault.fail("one_mlflow_run", f"the launch without --run_name started run(s) {other}, not {fault.run_name}")
        return [ended]

    def fault_new_store(self, fault: Fault, plan: PlannedFault) -> list[Launch]:
        launch = self.start(fault.run_name, fault.kind)
        sig = signal.Signals[plan.signal]
        fault.detail["signal"] = plan.signal
        db = self.store.db
        if self.wait_until([launch], self.args.launch_timeout, until=db.exists) and db.exists():
            appeared = launch.elapsed()
            fault.detail["store_appeared_s"] = round(appeared, 3)
            self.strike(fault, [launch], appeared + 2.0 * plan.u, lambda: launch.send(sig))
        else:
            fault.struck = False
        self.end(launch, self.args.launch_timeout)
        schema = self.store.schema()
        fault.detail["schema_after"] = {"version": schema["version"], "tables": len(schema["tables"])}
        self.store_killed = fault
        return [launch]

    def probe_store(self, fault: Fault, plan: PlannedFault) -> None:
        """The relaunch after a store kill: it must open the store; it gets SIGKILL in its early phase.

        The first launch of a new run, killed once its MLflow run exists and before its first checkpoint:
        the launch after it must reopen that MLflow run, not start a second one. A store the relaunch
        cannot open is replaced (nothing of the run can be in it), so that the rest of the soak tests
        the other kinds instead of failing every launch on the same broken store.
        """
        probe = self.start(fault.run_name, "store-relaunch")
        if self.wait_until([probe], self.moment(PlannedFault(**{**asdict(plan), "phase": "early"}), [probe])):
            self.protect(fault, [probe])
            fault.detail["relaunch_killed_s"] = round(probe.elapsed(), 3)
            probe.send(signal.SIGKILL)
        self.end(probe, self.args.launch_timeout)
        fault.launches.append(probe.record())
        if probe.exit_code in (0, REQUEUE_EXIT_CODE, -signal.SIGTERM, -signal.SIGKILL) or not _STORE_ERROR.search(
                probe.stderr()):
            self.after_launch(probe, fault)
            return
        fault.fail("store_usable", f"the relaunch failed on the store the kill left (exit {probe.exit_code}): "
                                   f"{last_error(probe.stderr())}")
        self.after_launch(probe, fault)
        for suffix in ("", "-journal", "-wal", "-shm"):
            Path(f"{self.store.db}{suffix}").unlink(missing_ok=True)
        # a store made by MLflow in one uninterrupted process, so that the next kinds meet a sound one
        create = "import mlflow, sys; mlflow.MlflowClient(sys.argv[1]).search_experiments()"
        subprocess.run([sys.executable, "-c", create, f"sqlite:///{self.store.db}"], env=self.env(self.chaos),
                       capture_output=True, check=False)
        fault.detail["store_replaced"] = True
        self.store_killed = None

    def fault_disk(self, fault: Fault, plan: PlannedFault) -> list[Launch]:
        launch = self.start(fault.run_name, fault.kind)
        moment = self.moment(plan, [launch])

        def fill() -> None:
            fault.detail["filled_bytes"] = self.disk.fill()

        try:
            self.strike(fault, [launch], moment, fill)
            # it should fail at its next write; if it keeps running past its expected end, stop it
            deadline = self.reference["startup_s"] + self.reference["steps"] * self.reference["step_s"] + 30
            if not launch.wait(max(deadline - launch.elapsed(), 1.0)):
                fault.detail["still_running_after_s"] = round(launch.elapsed(), 1)
                launch.send(signal.SIGTERM)
            self.end(launch, self.args.launch_timeout)
        finally:
            self.disk.free()
        return [launch]

    def fault_corrupt(self, fault: Fault, plan: PlannedFault) -> list[Launch]:
        launches: list[Launch] = []
        directory = self.ckpt_dir(fault.run_name)

        def ready() -> bool:
            good = good_checkpoints(directory) if any(directory.glob("*.meta.json")) else {}
            return len(good) >= 2 and any(n.startswith("step=") for n in good)

        if not ready():  # a setup launch, stopped by SIGTERM once two checkpoints verify
            setup = self.start(fault.run_name, "corrupt-setup")
            while setup.alive() and not ready():
                time.sleep(0.1)
            setup.send(signal.SIGTERM)
            launches.append(self.end(setup, self.args.launch_timeout))
            self.after_launch(setup, fault)
        target = newest_good(directory, CHECKPOINT_PATTERN)
        if target is None or len(good_checkpoints(directory)) < 2:
            fault.struck = False
            fault.detail["not_applied"] = "fewer than two good checkpoints"
            return launches
        before = newest_good(directory)
        for watch in self.watches:
            watch.items.pop(target[0], None)
        fault.detail.update(corrupt(directory / target[0], plan.corrupt_mode, plan.cut))
        fault.moment_s = 0.0  # between launches
        fault.detail.update({"target": target[0], "target_step": target[1], "explicit": plan.explicit})
        fault.furthest_step = before[1] if before else None
        for pending in self.awaiting:
            pending.corrupted_after = True
        self.awaiting.append(fault)
        if plan.explicit:
            explicit = self.start(fault.run_name, "corrupt-explicit", ["--ckpt_path", str(directory / target[0])])
            # refused at once after start-up, or stopped once it should have
            if not explicit.wait(self.reference["startup_s"] + 30):
                explicit.send(signal.SIGTERM)
            self.end(explicit, self.args.launch_timeout)
            launches.append(explicit)
            named = f"--ckpt_path naming the {CORRUPTED[plan.corrupt_mode]} checkpoint"
            if explicit.decided:
                fault.fail("clean_exit", f"{named} was loaded and trained on (to step {explicit.furthest_step}, "
                                         f"exit {explicit.exit_code}), not refused with exit 2")
            elif explicit.exit_code != USAGE_EXIT_CODE or explicit.traceback:
                fault.fail("clean_exit", f"{named}: exit {explicit.exit_code}"
                           f"{' with a traceback' if explicit.traceback else ''} (expected a one-line error and "
                           f"exit 2): {last_error(explicit.stderr())}")
            self.after_launch(explicit, fault, resolve=False)
        launch = self.start(fault.run_name, "corrupt")
        if self.wait_until([launch], self.moment(plan, [launch])):  # then stop it with a notice
            self.protect(fault, [launch])
            fault.detail["stopped_at_s"] = round(launch.elapsed(), 3)
            launch.send(signal.SIGTERM)
        self.end(launch, self.args.launch_timeout)
        launches.append(launch)
        newest_then = (launch.expected_resume or [None, 0])[1]
        if launch.resumed_path is not None and newest_then < target[1] and target[0] not in launch.skipped_corrupt:
            fault.fail("resumed_from_newest", f"the launch did not say it skipped the {CORRUPTED[plan.corrupt_mode]} "
                                              f"{target[0]}")
        return launches

    def fault_double(self, fault: Fault, plan: PlannedFault) -> list[Launch]:
        first = self.start(fault.run_name, "double-a")
        second = self.start(fault.run_name, "double-b")
        pair = [first, second]
        # the fault is the second launch: strike only once one of the pair has answered (a refusal), since on a
        # loaded machine the imports alone can outlast the planned moment and a signal would pre-empt the refusal
        self.wait_until(pair, self.args.launch_timeout, until=lambda: not all(x.alive() for x in pair))
        self.strike(fault, pair, max(self.moment(plan, pair), first.elapsed()),
                    lambda: [x.send(signal.SIGTERM) for x in pair if x.alive()])
        for launch in pair:
            self.end(launch, self.args.launch_timeout)
        codes = [x.exit_code for x in pair]
        # (which launch logged which step cannot be told apart: both write to the same MLflow run)
        refused = [x for x in pair if x.exit_code == USAGE_EXIT_CODE and not x.signals and x.error_line]
        fault.detail["refused"] = [x.label for x in refused]
        fault.detail["refusal"] = refused[0].error_line[:300] if refused else None
        if len(refused) != 1:
            fault.fail("double_launch_refused", f"exit codes {codes}, signals {[x.signals for x in pair]}: "
                       f"{'both ran' if not refused else 'both refused'}")
        return pair

    @staticmethod
    def rank_pid(launch: Launch, rank: int = 1) -> int | None:
        """The pid of the rank Lightning's launcher started as ``rank`` (a child of the launching process)."""
        import psutil

        assert launch.proc is not None
        for child in psutil.Process(launch.proc.pid).children():
            try:
                if child.environ().get("LOCAL_RANK") == str(rank):
                    return child.pid
            except psutil.Error:
                continue
        return None

    def fault_skew(self, fault: Fault, plan: PlannedFault) -> list[Launch]:
        launch = self.start(fault.run_name, fault.kind, ["--spot.every_minutes", "0.002"])
        done = threading.Event()

        def skew() -> None:  # rank 1 stopped 20 ms of every 50 until the moment
            while not done.is_set() and launch.alive():
                pid = self.rank_pid(launch)
                if pid is None:
                    done.wait(0.05)
                    continue
                while not done.is_set() and launch.alive():
                    try:
                        os.kill(pid, signal.SIGSTOP)
                        time.sleep(0.02)
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        return
                    done.wait(0.03)

        skewer = threading.Thread(target=skew, daemon=True)
        skewer.start()

        def stop() -> None:
            done.set()
            skewer.join()
            launch.send(signal.SIGTERM)

        self.strike(fault, [launch], self.moment(plan, [launch]), stop)
        done.set()
        skewer.join()
        return [self.end(launch, self.args.launch_timeout)]

    def fault_freeze(self, fault: Fault, plan: PlannedFault) -> list[Launch]:
        grace_s = 5.0
        launch = self.start(fault.run_name, fault.kind, ["--spot.notice_grace_s", str(grace_s)])

        def freeze() -> None:
            pid = self.rank_pid(launch)
            if pid is None:
                fault.struck = False
                return
            os.kill(pid, signal.SIGSTOP)
            fault.detail["frozen_pid"] = pid
            time.sleep(2.0)  # rank 0 waits in a collective by now
            if launch.alive():
                assert launch.proc is not None
                os.kill(launch.proc.pid, signal.SIGTERM)  # the launching process alone, as a supervisor would
                launch.signals.append(["SIGTERM", round(launch.elapsed(), 3)])
                fault.detail["sigterm_at_s"] = round(launch.elapsed(), 3)

        self.strike(fault, [launch], self.moment(plan, [launch]), freeze)
        ended = self.end(launch, self.args.launch_timeout)
        sent = fault.detail.get("sigterm_at_s")
        if sent is not None and ended.exit_code == REQUEUE_EXIT_CODE:
            took = ended.wall_s - sent if ended.wall_s is not None else None
            fault.detail["notice_to_gone_s"] = took
            if took is not None and took > grace_s + 15:
                fault.fail("clean_exit", f"the hung job took {took:.1f} s to end after the SIGTERM "
                                         f"(notice_grace_s {grace_s:.0f} + 15)")
            if "rank(s) 1 stopped answering" not in ended.stderr():
                fault.fail("clean_exit", "the hung job ended without an 'atscale: hang:' line naming rank 1: "
                                         f"{last_error(ended.stderr())}")
        return [ended]

    def fault_outage(self, fault: Fault, plan: PlannedFault) -> list[Launch]:
        """The bucket fails every request for 2-10 s from the planned moment, then comes back.

        A truncate/flip draw picks the way it fails (``reset``: connections cut; ``503``: ServiceUnavailable), the
        cut draw the duration; one time in three the launch gets SIGTERM half-way through the outage (its notice
        save cannot be uploaded). It is then waited for: it must finish, stop as signalled, or exit with a one-line
        error; the bucket's pointer must still name a complete checkpoint (checked after every launch).
        """
        assert self.bucket is not None
        mode = "reset" if plan.corrupt_mode == "truncate" else "503"
        duration = round(2.0 + 8.0 * plan.cut, 2)
        fault.detail.update({"mode": mode, "planned_s": duration, "sigterm_during": plan.explicit})
        launch = self.start(fault.run_name, fault.kind)
        try:
            self.strike(fault, [launch], self.moment(plan, [launch]), lambda: self.bucket.down(mode))
            if fault.struck:
                started = launch.elapsed()
                if plan.explicit and self.wait_until([launch], started + duration / 2):
                    launch.send(signal.SIGTERM)
                self.wait_until([launch], started + duration)
        finally:
            self.bucket.up()
        if fault.struck:
            fault.detail["outage_s"] = self.bucket.outages[-1][1]
        deadline = (self.reference["startup_s"] + self.reference["steps"] * self.reference["step_s"] + duration
                    + 60 * (1 + self.reference["steps"] // self.args.every))  # an upload may wait out its retries
        if not launch.wait(max(deadline - launch.elapsed(), 1.0)):
            fault.detail["still_running_after_s"] = round(launch.elapsed(), 1)
            launch.send(signal.SIGTERM)
        self.end(launch, self.args.launch_timeout)
        fault.detail["upload_errors"] = launch.stderr().count("Could not upload checkpoint")
        return [launch]

    def fault_damaged(self, fault: Fault, plan: PlannedFault) -> list[Launch]:
        """64 bytes flipped in the training chunk the run reads last, before the launch (one time in three) or in
        its start-up (before it reads a training chunk): it must stop with exit 65 and one line naming the chunk.
        Then the prepared bytes go back, as a user puts them back after "prepare the data again", and the next
        launch, the same command, must resume (``no_requeue_loop`` in :meth:`after_launch`)."""
        assert self.dataset is not None
        dataset, a = self.dataset, self.args
        name = dataset.target(a.epochs, a.batches, 2 if a.ddp else 1)
        fault.detail.update({"target": name, "when": "before the launch" if plan.explicit else "in its start-up"})

        def damage() -> None:
            fault.detail.update(dataset.damage(name, plan.cut))

        if plan.explicit:
            damage()
            launch = self.start(fault.run_name, fault.kind)
            self.protect(fault, [launch])
            fault.moment_s = 0.0
        else:
            launch = self.start(fault.run_name, fault.kind)
            self.strike(fault, [launch], self.moment(plan, [launch]), damage)
        self.end(launch, a.launch_timeout)
        if "flipped" in fault.detail:
            dataset.repair(name)
            fault.detail["repaired"] = True
            fault.detail["line"] = (data_stop_line(launch.stderr()) or "")[:300]
            first = dataset.first_step(name, launch.resumed_from or 0, a.epochs, a.batches, 2 if a.ddp else 1)
            fault.detail["first_damaged_step"] = first
            if not launch.hung:
                for invariant, why in judge_damaged(launch.exit_code, launch.stderr(), str(dataset.folder), name,
                                                    launch.furthest_step, first):
                    fault.fail(invariant, f"{launch.label}: {why}")
        return [launch]

    def fault_replaced(self, fault: Fault, plan: PlannedFault) -> list[Launch]:
        """A notice at a drawn step of what is left (``--spot.drill_steps``: a real SIGTERM after that step, exit 75
        once its checkpoint, which holds the data's index digest, is saved; at a planned moment the digits run, 16 ms
        a step, often ended first). Then the data at the URL is replaced by the set split with another seed: the same
        command must be refused (exit 2, both digests named) before a step, the MLflow run left KILLED. The original
        then goes back for the next launch."""
        assert self.dataset is not None
        dataset = self.dataset
        done = (self.expected_resume(fault.run_name) or ("", 0))[1]
        left = self.reference["steps"] - done - 1
        if left < 1:
            fault.struck = False
            fault.detail["not_applied"] = f"no step left to stop the run after (resumes at {done})"
            return []
        drill = done + 1 + int(plan.u * left)
        fault.detail["drill_step"] = drill
        first = self.end(self.start(fault.run_name, f"{fault.kind}-stop", ["--spot.drill_steps", f"[{drill}]"]),
                         self.args.launch_timeout)
        self.protect(fault, [first])
        if first.exit_code not in (REQUEUE_EXIT_CODE, 0) and not first.hung:
            fault.fail("clean_exit", f"{first.label} exited {first.exit_code} after its notice at step {drill} "
                                     f"(expected 75): {last_error(first.stderr())}")
        if first.exit_code != REQUEUE_EXIT_CODE:
            fault.struck = False
            fault.detail["not_applied"] = f"the stopped launch exited {first.exit_code}, not 75 after a notice save"
            return [first]
        now, began = dataset.replace()
        fault.moment_s = 0.0  # between launches
        fault.detail.update({"index_digest": now, "began_with": began})
        try:
            second = self.end(self.start(fault.run_name, fault.kind), self.args.launch_timeout)
            statuses = [r["status"] for r in self.store.runs(fault.run_name)]
        finally:
            dataset.restore()
        fault.detail.update({"mlflow_status": statuses, "line": (data_stop_line(second.stderr()) or "")[:300]})
        if not second.hung:
            for invariant, why in judge_replaced(second.exit_code, second.stderr(), str(dataset.folder), now, began,
                                                 second.furthest_step, statuses):
                fault.fail(invariant, f"{second.label}: {why}")
        return [first, second]

    def check_pointer(self, run_name: str, fault: Fault) -> None:
        """``--store s3``: the bucket's ``latest.json`` names a checkpoint whose record and objects all verify."""
        if self.bucket is None:
            return
        url = self.ckpt_url(run_name)
        pointer = self.bucket.pointer(url)
        if pointer is None:
            return
        _, why = self.bucket.verified(url, pointer["name"])
        if why is not None:
            fault.fail("pointer_complete", f"{url}/latest.json names {pointer['name']} (step "
                                           f"{pointer.get('global_step')}), which is not complete: {why}")

    # ------------------------------------------------------------ bookkeeping after a launch
    def after_launch(self, launch: Launch, current: Fault, resolve: bool = True, own: bool = False,
                     observe: bool = True) -> None:
        """Checks every launch gets: resume decision, MLflow run count, watched checkpoints; resolves faults.

        What a launch does wrong is blamed on the fault that it is the relaunch after (``awaiting``), unless
        it is the fault's own doing (``own``: the second of a double launch).
        """
        run = self.runs[-1]
        blame = self.awaiting[-1] if self.awaiting and not own else current
        if launch.exit_code == 0:
            run.finished = True
        if not launch.hung and EXIT_WATCH_LINE in launch.stderr():  # ended by its own exit watch (recipes.run.shutdown)
            current.fail("clean_exit", f"{launch.label} did not finish exiting and was ended by its exit watch; "
                                       f"it was at:\n{hung_where(launch.stderr())}")
        if launch.hung:
            current.fail("clean_exit", f"{launch.label} did not exit within {self.args.launch_timeout:.0f} s "
                                       f"(signals {launch.signals}); killed"
                                       + (f"; it was at:\n{launch.hung_where}" if launch.hung_where else ""))
        expected = launch.expected_resume
        if launch.decided and launch.exit_code != USAGE_EXIT_CODE and "--ckpt_path" not in launch.extra:
            got = launch.resumed_from
            want = expected[1] if expected else 0
            if got != want:
                blame.fail("resumed_from_newest", f"{launch.label} resumed from step {got} "
                           f"({launch.resumed_path or 'no checkpoint'}), but {expected[0] if expected else 'none'} "
                           f"(step {want}) verified when it started")
        count = len(self.store.runs(run.name))
        if count > max(run.mlflow_runs, 1):
            blame.fail("one_mlflow_run", f"{launch.label} created MLflow run #{count} named {run.name!r}")
        run.mlflow_runs = max(run.mlflow_runs, count)
        if self.store_killed is not None and self.store_killed is not current and launch.exit_code not in (
                0, REQUEUE_EXIT_CODE) and not launch.signals and _STORE_ERROR.search(launch.stderr()[-4000:]):
            self.store_killed.fail("store_usable", f"{launch.label} failed on the store (exit {launch.exit_code}): "
                                                   f"{last_error(launch.stderr())}")
        stopped_on = data_stop_line(launch.stderr()) if self.dataset is not None else None
        if stopped_on and launch.label not in DATA_KINDS:  # the soak had put the prepared data back
            blame.fail("no_requeue_loop", f"{launch.label} met damaged or other data again after the soak put the "
                                          f"prepared data back (exit {launch.exit_code}): {stopped_on[:300]}")
        if observe:  # once per launch, or once for two launched together
            self.observe(run.name)
            self.check_pointer(run.name, blame)
        if resolve and launch.decided and launch.exit_code != USAGE_EXIT_CODE:
            for fault in self.awaiting:
                fault.next_resumed_from = launch.resumed_from
                fault.time_to_resume_s = launch.first_step_s
                fault.next_launch_wall_s = launch.wall_s
                base = fault.resumable_after if fault.corrupted_after and fault.kind != "corrupt" \
                    else launch.resumed_from
                if fault.furthest_step is not None and base is not None:
                    fault.lost_steps = max(fault.furthest_step - base, 0)
                elif fault.lost_steps is None:
                    fault.lost_steps = 0
            self.awaiting = []

    def observe(self, run_name: str) -> None:
        now = good_checkpoints(self.ckpt_dir(run_name))
        for watch in list(self.watches):
            if watch.fault.run_name != run_name:
                continue
            for name, step in list(watch.items.items()):
                if name in now:
                    continue
                if pruned_by_policy(name, step, now):
                    del watch.items[name]
                    continue
                watch.fault.fail("no_checkpoint_lost", f"{name} (step {step}) verified when the fault struck; "
                                 f"now {'missing' if not (self.ckpt_dir(run_name) / name).exists() else 'corrupt'} "
                                 f"(good now: {sorted(now)})")
                del watch.items[name]
            watch.observations_left -= 1
            if watch.observations_left <= 0 or not watch.items:
                self.watches.remove(watch)

    def expected_codes(self, fault: Fault) -> set[int]:
        sigterm = {REQUEUE_EXIT_CODE, -signal.SIGTERM, 0}
        sigint = {REQUEUE_EXIT_CODE, SIGINT_EXIT_CODE, -signal.SIGINT, 0}  # 130 or -2 before training took it
        return {"sigterm": sigterm, "corrupt": sigterm, "default_name": sigterm,
                "group_signal": sigint | sigterm, "double_launch": sigterm | {USAGE_EXIT_CODE},
                "sigkill": {-signal.SIGKILL, 0}, "new_store_kill": sigterm | {-signal.SIGKILL},
                "bucket_outage": sigterm | {USAGE_EXIT_CODE}, "skewed_rank": sigterm,
                "frozen_rank": {REQUEUE_EXIT_CODE, 0}}.get(fault.kind, set())

    def inject(self, index: int, plan: PlannedFault) -> Fault:
        run = self.runs[-1]
        fault = Fault(index, plan.kind, run.name, plan.phase)
        run.faults.append(index)
        self.faults.append(fault)
        if plan.kind in self.skipped_kinds:
            fault.struck = False
            fault.detail["skipped"] = self.skipped_kinds[plan.kind]
            return fault
        if plan.kind in ("sigterm", "sigkill"):
            launches = self.fault_kill(fault, plan, signal.SIGTERM if plan.kind == "sigterm" else signal.SIGKILL)
        elif plan.kind == "new_store_kill":
            launches = self.fault_new_store(fault, plan)
        elif plan.kind == "disk_full":
            launches = self.fault_disk(fault, plan)
        elif plan.kind == "corrupt":
            launches = self.fault_corrupt(fault, plan)
        elif plan.kind == "double_launch":
            launches = self.fault_double(fault, plan)
        elif plan.kind == "bucket_outage":
            launches = self.fault_outage(fault, plan)
        elif plan.kind == "skewed_rank":
            launches = self.fault_skew(fault, plan)
        elif plan.kind == "frozen_rank":
            launches = self.fault_freeze(fault, plan)
        elif plan.kind == "group_signal":
            launches = self.fault_group_signal(fault, plan)
        elif plan.kind == "default_name":
            launches = self.fault_default_name(fault, plan)
        elif plan.kind == "chunk_damaged":
            launches = self.fault_damaged(fault, plan)
        elif plan.kind == "dataset_replaced":
            launches = self.fault_replaced(fault, plan)
        else:
            raise ValueError(plan.kind)
        struck = [x for x in launches if x.label not in ("corrupt-setup", "corrupt-explicit")]
        fault.launches = [x.record() for x in launches]
        fault.exit_codes = [x.exit_code for x in struck]
        allowed = self.expected_codes(fault)
        for launch in struck:
            if allowed and launch.exit_code not in allowed and not launch.hung:
                fault.fail("clean_exit", f"{launch.label} exited {launch.exit_code}"
                           f"{' with a traceback' if launch.traceback else ''} (expected one of {sorted(allowed)}): "
                           f"{last_error(launch.stderr())}")
            elif plan.kind in ("disk_full", "bucket_outage") and launch.traceback:
                what = "on the full disk" if plan.kind == "disk_full" else "in the bucket outage"
                fault.fail("clean_exit", f"{launch.label} ended in a Python traceback (exit {launch.exit_code}) "
                                         f"{what}, not a one-line error: {last_error(launch.stderr())}")
            elif plan.kind == "group_signal" and (launch.traceback or "killed by signal" in launch.stderr()):
                fault.fail("clean_exit", f"{launch.label}: a signal to the process group ended it in a traceback "
                                         f"(exit {launch.exit_code}): {last_error(launch.stderr())}")
            elif plan.kind == "bucket_outage" and launch.exit_code == USAGE_EXIT_CODE and not launch.error_line:
                fault.fail("clean_exit", f"{launch.label} exited 2 without an 'error:' line: "
                                         f"{last_error(launch.stderr())}")
        if plan.kind != "corrupt":
            steps = [x.furthest_step for x in struck if x.furthest_step is not None]
            fault.furthest_step = max(steps) if steps else None
            bounds = [x.unlogged_max for x in struck]
            fault.unlogged_max = None if None in bounds else sum(b or 0 for b in bounds)
            for number, launch in enumerate(struck):
                self.after_launch(launch, fault, own=number > 0, observe=number == len(struck) - 1)
            fault.resumable_after = (newest_good(self.ckpt_dir(run.name)) or ("", 0))[1]
            self.awaiting.append(fault)
            if plan.kind == "new_store_kill" and fault.struck:
                self.probe_store(fault, plan)
        else:
            fault.resumable_after = (newest_good(self.ckpt_dir(run.name)) or ("", 0))[1]
            for launch in struck:
                self.after_launch(launch, fault)
        return fault

    # ------------------------------------------------------------ finishing a run
    def finish(self, run: RunState) -> None:
        """Relaunch until the run ends (at most 3 launches), then check it against the reference."""
        last = self.faults[-1] if self.faults else Fault(-1, "none", run.name, None)
        for attempt in range(0 if run.finished else 3):
            launch = self.end(self.start(run.name, "finish"), self.args.launch_timeout)
            run.finish_launches.append(launch.record())
            self.after_launch(launch, last)
            if launch.exit_code == 0:
                break
            if attempt == 0:
                run.fail("finished", f"the first launch after the last fault exited {launch.exit_code}"
                         f"{' with a traceback' if launch.traceback else ''}: {last_error(launch.stderr())}")
        self.observe(run.name)
        self.watches = [w for w in self.watches if w.fault.run_name != run.name]
        self.awaiting = []
        self.check_weights(run)
        self.check_history(run)
        self.check_ledger(run)
        mlflow_runs = self.store.runs(run.name)
        run.checks["mlflow_runs"] = mlflow_runs
        if len(mlflow_runs) != 1 or mlflow_runs[0]["status"] != "FINISHED":
            run.fail("one_mlflow_run", f"{len(mlflow_runs)} MLflow runs named {run.name!r}: "
                     f"{[r['status'] for r in mlflow_runs]} (expected one, FINISHED)")

    def check_history(self, run: RunState) -> None:
        """The finished run's metric history against the reference's (see ``metric_history`` in faults.py)."""
        import fnmatch

        from recipes.reproduce import DEFAULT_IGNORE

        if any(f.detail.get("store_replaced") for f in self.faults if f.run_name == run.name):
            run.checks["history"] = "exempt: the store was replaced"
            return

        def compared(history: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
            return {k: v for k, v in history.items() if not any(fnmatch.fnmatch(k, p) for p in DEFAULT_IGNORE)}

        expected = compared(Store(Path(self.reference["workdir"]) / "mlflow.db").history("reference"))
        got = compared(self.store.history(run.name))
        different = sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))
        run.checks["history"] = {"keys": len(expected), "points": sum(map(len, expected.values())),
                                 "keys_different": different}
        for key in different[:5]:
            want, have = dict(expected.get(key, [])), dict(got.get(key, []))
            missing = sorted(set(want) - set(have))
            extra = sorted(set(have) - set(want))
            changed = sorted(s for s in set(want) & set(have) if want[s] != have[s])
            run.fail("metric_history", f"{key}: steps missing {missing[:8]}, extra {extra[:8]}, other values at "
                                       f"{changed[:8]} (of {len(want)} points)")

    def check_ledger(self, run: RunState) -> None:
        """The run's goodput ledger against its faults and launches (``recipes/soak/ledger.py``)."""
        if any(f.detail.get("store_replaced") for f in self.faults if f.run_name == run.name):
            run.checks["ledger"] = "exempt: the store was replaced"
            return
        launches = [launch for launch in self.launches if launch.run_name == run.name]
        faults = [f for f in self.faults if f.run_name == run.name]
        run.checks["ledger"], problems = check_ledger(self.store.final_metrics(run.name), launches, faults)
        for problem in problems:
            run.fail("ledger", problem)

    def check_weights(self, run: RunState) -> None:
        import torch

        # what a relaunch would resume from: the newest good step=*.ckpt, or a best-* of a later step when the
        # soak corrupted the last step=*.ckpt of a run that had already ended (same step, same weights)
        ours = newest_good(self.ckpt_dir(run.name), CHECKPOINT_PATTERN)
        resumable = newest_good(self.ckpt_dir(run.name))
        if resumable is not None and (ours is None or resumable[1] > ours[1]):
            ours = resumable
        ref = self.reference["final"]
        run.checks["final_checkpoint"] = list(ours) if ours else None
        if ours is None:
            run.fail("bitwise_equal", "no good step=*.ckpt at the end")
            return
        if ours[1] != ref[1]:
            run.fail("bitwise_equal", f"ended at step {ours[1]}, the reference at {ref[1]}")
        a = torch.load(self.ckpt_dir(run.name) / ours[0], map_location="cpu", weights_only=False)["state_dict"]
        b = torch.load(self.ckpt_dir("reference", Path(self.reference["workdir"])) / ref[0], map_location="cpu",
                       weights_only=False)["state_dict"]
        different = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))
        run.checks["tensors"] = len(b)
        run.checks["tensors_different"] = different
        if different:
            run.fail("bitwise_equal", f"{len(different)} of {len(b)} tensors differ from the reference: "
                     f"{different[:5]}")
        if self.bucket is not None:
            self.check_bucket_weights(run, b, ref[1])

    def check_bucket_weights(self, run: RunState, reference: dict[str, Any], step: int) -> None:
        """``--store s3``: what a new machine would resume from (the bucket's pointer) is the final reference."""
        import io

        import torch

        url = self.ckpt_url(run.name)
        newest = self.bucket.newest(url) if self.bucket is not None else None
        run.checks["bucket_checkpoint"] = list(newest) if newest else None
        if newest is None:
            run.fail("bitwise_equal", f"no complete checkpoint in {url} at the end")
            return
        if newest[1] != step:
            run.fail("bitwise_equal", f"the bucket's newest complete checkpoint {newest[0]} is at step {newest[1]}, "
                                      f"the reference ended at {step}")
        data = self.bucket.fs().cat_file(f"{url[len('s3://'):]}/{newest[0]}")
        ours = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)["state_dict"]
        different = sorted(k for k in ours.keys() | reference.keys()
                           if k not in ours or k not in reference or not torch.equal(ours[k], reference[k]))
        run.checks["bucket_tensors_different"] = different
        if different:
            run.fail("bitwise_equal", f"{url}/{newest[0]}: {len(different)} of {len(reference)} tensors differ "
                                      f"from the reference: {different[:5]}")

    def new_run(self) -> RunState:
        """The next run, named as its command names it (see :meth:`arguments`)."""
        token = len(self.runs) + 1
        name = command_run_name(self.arguments(token))
        self.tokens[name] = token
        run = RunState(name)
        self.runs.append(run)
        return run

    # ------------------------------------------------------------ the whole soak
    def run(self, plan: Sequence[tuple[int, PlannedFault]], progress: Progress | None = None,
            task: Any = None) -> None:
        """Drive runs through ``plan`` (``(index, fault)`` pairs), finishing and checking each run."""
        a = self.args
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.chaos / "runs").mkdir(parents=True, exist_ok=True)
        if self.dataset is not None:
            self.dataset.install()
        if "disk_full" in {p.kind for _, p in plan}:
            reason = self.disk.mount()
            if reason:
                self.skipped_kinds["disk_full"] = reason
                self.console.print(f"[yellow]disk_full faults skipped: {reason}[/]")
        try:
            self.new_run()
            for index, planned in plan:
                if self.stop.is_set():
                    break
                run = self.runs[-1]
                if run.finished or len(run.faults) >= a.faults_per_run:
                    self.finish(run)
                    self.new_run()
                if progress is not None and task is not None:
                    progress.update(task, description=f"fault {index + 1}: {planned.kind} ({self.runs[-1].name})")
                fault = self.inject(index, planned)
                if progress is not None and task is not None:
                    progress.advance(task)
                self.console.print(self.fault_line(fault), highlight=False)
            if not self.stop.is_set():
                self.finish(self.runs[-1])
        finally:
            self.kill_all()
            self.disk.unmount()
            if self.bucket is not None:
                self.bucket.up()

    def kill_all(self) -> None:
        """SIGKILL every launch still running (an interrupted soak leaves no training behind)."""
        for launch in self.launches:
            launch.send(signal.SIGKILL)

    @staticmethod
    def fault_line(fault: Fault) -> str:
        moment = f"@{fault.moment_s:.2f}s" if fault.moment_s is not None else "(not struck)"
        verdict = "held" if fault.held else "FAILED: " + "; ".join(p["detail"] for p in fault.problems)
        return (f"fault {fault.index + 1} {fault.kind} {fault.phase or ''} {moment} on {fault.run_name}: "
                f"exit {fault.exit_codes} -> {verdict}")

    def store_problems(self) -> tuple[list[str], list[str], dict[str, Any]]:
        """(runs left RUNNING, schema problems, schema summary) of this soak's store."""
        running = [r for r in self.store.runs() if r["status"] == "RUNNING"]
        schema, ref_schema = self.store.schema(), self.reference.get("schema", {})
        missing = sorted(set(ref_schema.get("tables", [])) - set(schema["tables"]))
        broken = [] if schema["version"] == ref_schema.get("version") and not missing else [
            f"{self.store.db}: schema version {schema['version']} (reference {ref_schema.get('version')}), "
            f"tables missing: {missing}"]
        left = [f"{self.store.db}: {len(running)} run(s) RUNNING: {running}"] if running else []
        return left, broken, {"db": str(self.store.db), "version": schema["version"], "tables": len(schema["tables"])}
