"""Chaos soak: one digits run driven through seeded random faults, relaunched after each, then checked.

A benchmark of the recipe's fault tolerance, not a CI test::

    python -m recipes.bench chaos --faults 10 --out chaos.json        # 4-7 min on the shared 2-core machine
    python -m recipes.bench chaos --faults 100 --chains 2 --out chaos.json  # two runs at once, one per core
    python -m recipes.bench chaos --faults 10 --seed 7 --ddp          # every launch with configs/strategy/ddp.yaml
    python -m recipes.bench chaos --faults 3 --kinds sigterm,sigkill,corrupt

A launch costs what ``recipes.fit`` costs to start (imports, MLflow: 12 s on an idle 2-core machine,
25-30 s on a busy one) plus the moment of its fault; a fault averages 1.6 launches (setup, ``--ckpt_path``
and double launches, a finishing launch every ``--faults-per-run``). Measured on the 2-core machine
shared with other work: ``--faults 10`` in 256 s (17 launches, load average 2-3) and 408 s (load 5-7);
``--faults 10 --chains 2`` in 234 s (load 2-4). So ``--faults 100`` takes about 40 min there; the
second chain only pays where the second core is otherwise idle.

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

Fault kinds (``--kinds``; the first ones of the schedule cover every kind, the rest are drawn at
random; every random choice comes from ``--seed`` and is made before the first launch). A *moment*
is seconds from a launch's start, drawn uniformly from one of three phases, chosen at random (one
for each state of the run's durable record): start-up (imports and the MLflow store, before the
launch's MLflow run is open: 0 to the time the reference launch wrote its ``config.yaml``, which the
CLI does as training sets up), early (from this launch's own write of it to its first periodic save)
or training (from its first step to its expected last save, from the reference run's step time
and the steps it has left):

- ``new_store_kill``: the first launch on the new MLflow store gets SIGKILL or SIGTERM 0-2 s after
  ``mlflow.db`` appears (creation and migration of the store); only ever the first fault. The relaunch
  must be able to use the store (if it cannot, the store is replaced by a sound one so that the other
  kinds can still be tested) and is itself SIGKILLed in its early phase: the run's first checkpoint
  does not exist yet, its MLflow run does.
- ``sigterm`` / ``sigkill``: the launch's process group is signalled at the moment.
- ``disk_full``: the run directory root is a small tmpfs mounted for the soak; at the moment it is
  filled to the last byte; the launch is waited for (SIGTERM if it is still running when it should
  have ended), then the disk is freed. Skipped, and said so, where ``mount`` is not permitted.
- ``corrupt``: between launches the newest good ``step=*.ckpt`` is truncated or has bytes flipped
  (if fewer than two good checkpoints exist, a setup launch runs until they do and is stopped by
  SIGTERM). One time in three the next launch first names it with ``--ckpt_path`` (it must be
  refused with exit 2 and a one-line error); then a plain launch must skip it and is stopped by a
  SIGTERM at a training-phase moment.
- ``double_launch``: the same command twice at once; the second must be refused with exit 2; the
  survivor is stopped by SIGTERM at a training-phase moment.

- ``bucket_outage`` (``--store s3`` only): every launch's run root is ``s3://atscale-chaos/...`` on moto's S3
  server on 127.0.0.1, reached through a proxy in the soak; at the moment the proxy fails every request, new and
  in flight, for 2-10 s (``reset``: connections cut; ``503``: ServiceUnavailable), one time in three with a
  SIGTERM half-way (the notice save uploads into the outage); then the bucket comes back and the launch is
  waited for (exit 0, 75, or 2 with one ``error:`` line when the bucket was down at its start; no traceback).

With ``--store s3`` every other kind runs on the object-storage run too (the staging directory is local), the
expected resume point is what the CLI picks between the bucket and the staging directory, and two more checks
apply: ``pointer_complete`` after every launch, and ``bitwise_equal`` on what the bucket's pointer names.

Invariants (each fault's problems name the one they break; the exit status is 1 if any breaks):

- ``finished``: after its last fault, a run's next launch exits 0;
- ``bitwise_equal``: ``torch.equal`` on every tensor of the state_dict of the newest good
  ``step=*.ckpt`` (or of a ``best-*`` checkpoint of a later step, when the soak corrupted the last
  ``step=*.ckpt`` of a run that had ended: what a relaunch resumes from), against the reference
  run's newest ``step=*.ckpt``, and the same global step;
- ``one_mlflow_run``: exactly one MLflow run with the run's name, status FINISHED (and no launch
  creates a second one on the way);
- ``no_run_left_running``: no run of the experiment is RUNNING at the end;
- ``resumed_from_newest``: every launch that decides what to resume from (its "Resuming from ...
  (step N" line, or training from step 0 without one) takes the newest checkpoint that verifies
  when it starts (the soak checks records and hashes as the CLI does); a corrupt one is skipped;
- ``no_checkpoint_lost``: a checkpoint whose record verified when a fault struck and that is newer
  than what the struck launch resumed from is still there and verifies after that launch ended and
  after the next launch ended, unless the run's own pruning policy allows its removal at that point
  (a ``step=*`` checkpoint: ``SpotCheckpoint.keep`` newer good ``step=*`` checkpoints exist; a
  ``best-*`` one: a newer good ``best-*`` exists, as ``save_top_k=1``). Checkpoints the soak
  corrupts itself are exempt;
- ``clean_exit``: no launch hangs; exit codes are those of the kind (SIGTERM: 75 after a notice
  save or -15 before the handlers are installed; SIGKILL: -9; 0 when the run ended first); no
  Python traceback where a one-line error is due (full disk, corrupt checkpoint);
- ``double_launch_refused``: one of two simultaneous launches exits 2 before training, the other runs;
- ``store_usable``: the MLflow store has the reference store's schema version and tables, and
  no launch after a store kill fails on it.
- ``pointer_complete`` (``--store s3``): after every launch, the bucket's ``latest.json`` names a checkpoint
  whose record and every object are there with the recorded size and SHA-256 (read straight from moto).

Per fault the JSON (``--out``) holds the kind, the moment, the exit code(s), the lost work in steps
(the furthest step the struck launch logged to MLflow's ``train/loss`` minus the step the next
launch resumed from, from its stderr; when the soak corrupted a checkpoint in between, the newest
good step right after the fault instead; a relaunch that finds the run already complete counts as
resuming from its final step) and the time to resume (the next launch's start to its first
logged training step, from MLflow's timestamps; ``null`` if it was stopped before one, its wall
time is kept).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import os
import random
import re
import select
import shutil
import signal
import socket
import sqlite3
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from callbacks.spot import CHECKPOINT_PATTERN, REQUEUE_EXIT_CODE, SpotCheckpoint
from callbacks.storage import ckpt_store
from recipes import compat
from recipes.common import USAGE_EXIT_CODE

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

REPO = Path(__file__).resolve().parents[1]
KINDS = ("new_store_kill", "sigterm", "sigkill", "disk_full", "corrupt", "double_launch", "bucket_outage")
#: Kinds that need an object-storage run root (``--store s3``).
STORE_KINDS = ("bucket_outage",)
STORES = ("local", "s3")
EXPERIMENT = "digits"
#: How many ``step=*`` checkpoints the run keeps (SpotCheckpoint's default; the soak does not change it).
KEEP = inspect.signature(SpotCheckpoint).parameters["keep"].default
INVARIANTS = ("finished", "bitwise_equal", "one_mlflow_run", "no_run_left_running", "resumed_from_newest",
              "no_checkpoint_lost", "clean_exit", "double_launch_refused", "store_usable", "pointer_complete")
_RESUME = re.compile(r"Resuming from (\S+) \(step (\d+)")
_COMPLETE = re.compile(r"is already complete \(finished at step (\d+)")
_STORE_ERROR = re.compile(r"sqlalchemy|alembic|no such table|database is locked|schema", re.IGNORECASE)
_POLL_S = 0.02
_T = TypeVar("_T")
CORRUPTED = {"truncate": "truncated", "flip": "byte-flipped"}


# --------------------------------------------------------------------------- the plan
@dataclass
class PlannedFault:
    """One fault as drawn from the seed before anything runs."""

    kind: str
    phase: str  # "startup", "early" or "training": where in a launch its moment falls
    u: float  # position inside the phase, in [0, 1)
    signal: str  # new_store_kill: SIGKILL or SIGTERM
    corrupt_mode: str  # corrupt: "truncate" or "flip"
    explicit: bool  # corrupt: first name the corrupt file with --ckpt_path
    cut: float  # corrupt: truncate to this fraction of the size / seed of the flipped offsets


def plan_faults(n: int, kinds: Sequence[str], seed: int) -> list[PlannedFault]:
    """``n`` faults: ``new_store_kill`` first if asked for, then every other kind once (shuffled), then random.

    Every fault draws the same random values whatever its kind, so a seed names one plan.
    """
    rng = random.Random(seed)
    rest = [k for k in kinds if k != "new_store_kill"]
    order = ["new_store_kill"] if "new_store_kill" in kinds else []
    cover = list(rest)
    rng.shuffle(cover)
    order += cover
    while rest and len(order) < n:
        order.append(rng.choice(rest))
    plan = []
    for kind in order[:n]:
        phase = rng.choice(("startup", "early", "training"))
        u, sig, mode, explicit, cut = (rng.random(), rng.choice(("SIGKILL", "SIGTERM")),
                                       rng.choice(("truncate", "flip")), rng.random() < 1 / 3, rng.random())
        if kind in ("corrupt", "double_launch"):
            phase = "training"  # the launch must get as far as deciding (skip, refuse) before it is stopped
        plan.append(PlannedFault(kind, phase, u, sig, mode, explicit, cut))
    return plan


# --------------------------------------------------------------------------- launches
@dataclass
class Launch:
    """One ``python -m recipes.fit`` process (group) and what it left behind."""

    label: str
    run_name: str
    extra: list[str]
    started: float  # time.time() at start
    expected_resume: list[Any] | None  # [checkpoint name, step] that verified when it started; None: none did
    out: str
    err: str
    t0: float = field(default=0.0, repr=False)
    proc: subprocess.Popen | None = field(default=None, repr=False)
    exit_code: int | None = None
    wall_s: float | None = None
    hung: bool = False
    hung_where: str = ""  # hung: where its threads were (hung_where)
    signals: list[list[Any]] = field(default_factory=list)  # [signal name, seconds from start]
    resumed_from: int | None = None  # step of its "Resuming from" line
    resumed_path: str | None = None
    decided: bool = False  # printed a resume line, or trained (from step 0 then)
    first_step_s: float | None = None  # start -> first train/loss logged
    furthest_step: int | None = None  # steps completed by the furthest train/loss it logged
    traceback: bool = False
    error_line: str | None = None
    skipped_corrupt: list[str] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, sig: signal.Signals) -> None:
        """Signal the launch's process group (only while its leader is unreaped: the group id is then its own)."""
        if self.proc is None or self.proc.returncode is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
            self.signals.append([sig.name, round(self.elapsed(), 3)])
        except ProcessLookupError:
            pass

    def wait(self, timeout: float) -> bool:
        """Wait for the exit up to ``timeout`` s; True if it exited."""
        assert self.proc is not None
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def stderr(self) -> str:
        try:
            return Path(self.err).read_text(errors="replace")
        except OSError:
            return ""

    def record(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("t0", "proc")}


def last_error(stderr: str) -> str:
    """The last ``SomeError: message`` line of a traceback (or the last line), for one-line reports."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit): ", line)]
    return (errors or lines or [""])[-1][:240]


_THREAD_DUMP = re.compile(
    r"^(Current thread|Thread) 0x[0-9a-f]+[^\n]*\(most recent call first\):\n((?:  File [^\n]*\n?)*)", re.MULTILINE)
_FRAME = re.compile(r'  File "([^"]+)", line (\d+) in (\S+)')


#: What a launch's exit watch prints before it ends a process whose exit hangs (recipes.shutdown).
EXIT_WATCH_LINE = "error: the process did not finish exiting within"


def hung_where(stderr: str, frames: int = 4) -> str:
    """Where each thread of a hung launch was, from the faulthandler dump SIGABRT made: one line per thread.

    The current thread (the one the signal interrupted, the main thread in practice) comes first; each line lists
    its innermost ``frames`` frames as ``file:line in function``, innermost first. Empty when there is no dump.
    """
    lines = []
    for match in _THREAD_DUMP.finditer(stderr):
        calls = [f"{'/'.join(Path(file).parts[-2:])}:{line} in {func}"
                 for file, line, func in _FRAME.findall(match.group(2))[:frames]]
        label = "current thread" if match.group(1) == "Current thread" else "thread"
        lines.append(f"{label}: {' < '.join(calls) or '(no Python frames)'}")
    return "\n".join(sorted(lines, key=lambda line: not line.startswith("current")))


def parse_resume(stderr: str) -> tuple[str, int] | None:
    """``(checkpoint, step)`` of the CLI's "Resuming from X (step N" line, or None."""
    match = _RESUME.search(stderr)
    return (match.group(1), int(match.group(2))) if match else None


def parse_complete(output: str) -> tuple[str, int] | None:
    """``("<complete>", step)`` when the CLI said the run had already finished (it then trains nothing)."""
    match = _COMPLETE.search(output)
    return ("<complete>", int(match.group(1))) if match else None


# --------------------------------------------------------------------------- observation
class Store:
    """Read-only observation of the MLflow sqlite store through ``mlflow.MlflowClient``; never creates or migrates it.

    A client on ``sqlite:///<db>`` creates a missing store and migrates one below MLflow's schema head (a
    store a launch was killed in the middle of making), which would be the soak repairing what it tests.
    So :meth:`client` builds one only once the store exists at the head revision (:meth:`schema`); until
    then a read returns nothing for that poll. (At the head the client's one write is MLflow's default
    experiment, where a launch was killed before adding it: what the next launch adds too.) A read the
    client fails (the store locked) is retried, then returns nothing; its errors are noted in ``errors``.
    The client's engine is built once per store and must not pool connections: a pooled sqlite connection
    keeps reading a store that was deleted and replaced, so :func:`soak` runs in :func:`observer_pool`.
    """

    def __init__(self, db: Path) -> None:
        self.db = db
        self.uri = f"sqlite:///{db}"
        self.errors: list[str] = []

    def client(self) -> MlflowClient | None:
        """A client on the store, or None while it is missing or not at MLflow's schema head."""
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        if self.schema()["version"] != compat.mlflow_schema_head():
            return None
        try:
            return MlflowClient(self.uri)
        except MlflowException as err:
            self.errors.append(str(err))
            return None

    def _read(self, read: Callable[[MlflowClient], list[_T]]) -> list[_T]:
        """``read(client)``; [] while the store cannot be read (see the class), after retries when it is locked."""
        from mlflow.exceptions import MlflowException

        for _ in range(10):
            client = self.client()
            if client is None:
                return []
            try:
                return read(client)
            except MlflowException as err:
                self.errors.append(str(err))
                time.sleep(0.2)
        return []

    def runs(self, name: str | None = None) -> list[dict[str, str]]:
        """Active runs of the experiment (named ``name``), oldest first: ``run_id``, ``name``, ``status``."""
        from mlflow.entities import ViewType

        def read(client: MlflowClient) -> list[dict[str, str]]:
            experiment = client.get_experiment_by_name(EXPERIMENT)
            if experiment is None:
                return []
            where = f"attributes.run_name = '{name}'" if name is not None else ""
            return [{"run_id": r.info.run_id, "name": r.info.run_name, "status": r.info.status}
                    for r in _search_runs(client, [experiment.experiment_id], where, ViewType.ACTIVE_ONLY)]
        return self._read(read)

    def train_steps(self, name: str, since_s: float) -> list[tuple[int, int]]:
        """(step, timestamp ms) of every train/loss of runs named ``name`` logged at or after ``since_s``."""
        from mlflow.entities import ViewType

        def read(client: MlflowClient) -> list[tuple[int, int]]:
            ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
            runs = _search_runs(client, ids, f"attributes.run_name = '{name}'", ViewType.ALL)
            points = [(int(m.step), int(m.timestamp)) for r in runs
                      for m in client.get_metric_history(r.info.run_id, "train/loss")]
            return sorted((p for p in points if p[1] >= int(since_s * 1000)), key=lambda p: p[1])
        return self._read(read)

    def schema(self) -> dict[str, Any]:
        """Whether the store exists, its alembic revision (None: none yet) and its tables, read-only.

        Raw SQL on sqlite's catalog and alembic's version table: MLflow has no public API that reports a
        store's revision or tables (its client checks them, and migrates a store below the head).
        """
        tables = sorted(r[0] for r in self._sql("SELECT name FROM sqlite_master WHERE type = 'table'"))
        version = self._sql("SELECT version_num FROM alembic_version") if "alembic_version" in tables else []
        return {"exists": self.db.exists(), "version": version[0][0] if version else None, "tables": tables}

    def _sql(self, sql: str) -> list[tuple]:
        """Rows of ``sql``; [] when the store or the table does not exist or it stays unreadable (noted)."""
        if not self.db.exists():
            return []
        mode = "ro"
        for _ in range(50):
            try:
                conn = sqlite3.connect(f"file:{self.db}?mode={mode}", uri=True, timeout=30)
                try:
                    return list(conn.execute(sql))
                finally:
                    conn.close()
            except sqlite3.Error as err:
                text = str(err)
                if "no such table" in text:
                    return []
                if "readonly" in text or "read-only" in text:  # a hot journal to roll back: as any client does
                    mode = "rw"
                self.errors.append(text)
                time.sleep(0.2)
        return []


def _search_runs(client: MlflowClient, experiment_ids: list[str], where: str, view: int) -> list[Run]:
    """Every run ``client.search_runs`` finds, page after page, oldest first."""
    runs: list[Run] = []
    token = None
    while True:
        page = client.search_runs(experiment_ids, where, view, order_by=["attributes.start_time ASC"],
                                  page_token=token)
        runs += page
        token = page.token
        if not token:
            return runs


@contextlib.contextmanager
def observer_pool() -> Iterator[None]:
    """MLflow's engines made meanwhile in this process open a connection per session (``NullPool``; see
    :class:`Store`). Entered before the soak's threads start and left after they end: it sets the process's
    environment (``MLFLOW_SQLALCHEMYSTORE_POOLCLASS``, which the launches do not inherit: :meth:`Soak.env`)."""
    from mlflow.environment_variables import MLFLOW_SQLALCHEMYSTORE_POOLCLASS

    key = MLFLOW_SQLALCHEMYSTORE_POOLCLASS.name
    before = os.environ.get(key)
    os.environ[key] = "NullPool"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def good_checkpoints(directory: Path) -> dict[str, int]:
    """``{name: step}`` of the checkpoints in ``directory`` whose record verifies (size and SHA-256)."""
    out = {}
    for path in ckpt_store.candidates(directory):
        record = ckpt_store.read_record(path)
        if record is not None:
            out[path.name] = record.global_step
    return out


def newest_good(directory: Path, pattern: str = "*") -> tuple[str, int] | None:
    """The checkpoint the CLI would resume from: newest good by step, then save time."""
    record = ckpt_store.newest_good(directory, pattern)
    return (record.path.name, record.global_step) if record is not None else None


def pruned_by_policy(name: str, step: int, now: dict[str, int], keep: int = KEEP) -> bool:
    """Whether the run's own pruning may have removed checkpoint ``name`` given the good ones ``now``."""
    if name.startswith("step="):
        return sum(1 for n, s in now.items() if n.startswith("step=") and s > step) >= keep
    if name.startswith("best-"):
        return any(n.startswith("best-") and s > step for n, s in now.items())
    return False


def corrupt(path: Path, mode: str, cut: float) -> dict[str, Any]:
    """Truncate ``path`` to a fraction of its size, or flip 64 of its bytes at seeded offsets."""
    size = path.stat().st_size
    if mode == "truncate":
        new_size = int(size * cut * 0.9)
        os.truncate(path, new_size)
        return {"mode": "truncate", "size": size, "new_size": new_size}
    rng = random.Random(cut)
    offsets = sorted(rng.sample(range(size), min(64, size)))
    with open(path, "r+b") as handle:
        for offset in offsets:
            handle.seek(offset)
            byte = handle.read(1)
            handle.seek(offset)
            handle.write(bytes([byte[0] ^ 0xFF]))
    return {"mode": "flip", "size": size, "flipped": len(offsets)}


class Disk:
    """A tmpfs mounted over the runs root, so that the soak can fill it (root or CAP_SYS_ADMIN only)."""

    def __init__(self, root: Path, size_mb: int) -> None:
        self.root, self.size_mb = root, size_mb
        self.mounted = False
        self.ballast = root / ".chaos-ballast"

    def mount(self) -> str | None:
        """Mount it; the reason it could not be, or None."""
        self.root.mkdir(parents=True, exist_ok=True)
        if shutil.which("mount") is None:
            return "no mount command"
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m,mode=0755", "tmpfs",
                                 str(self.root)], capture_output=True, text=True)
        if result.returncode != 0:
            return f"mount -t tmpfs not permitted: {(result.stderr or result.stdout).strip()[:200]}"
        self.mounted = True
        return None

    def fill(self) -> int:
        """Write ballast until the filesystem is full; bytes written."""
        written = 0
        with open(self.ballast, "ab", buffering=0) as handle:
            for chunk in (1 << 20, 1 << 12, 1):
                block = b"\0" * chunk
                try:
                    while True:
                        written += handle.write(block)
                except OSError:
                    continue
        return written

    def free(self) -> None:
        self.ballast.unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.mounted:
            self.free()
            if subprocess.run(["umount", str(self.root)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(self.root)], capture_output=True)
            self.mounted = False


class Bucket:
    """A local object store for ``--store s3``: moto's S3 server on loopback, reached through a proxy that can fail.

    moto keeps its objects in memory, so stopping it would lose the bucket; instead every launch talks to
    a small TCP proxy in this process (``endpoint``), and an *outage* makes the proxy fail every request,
    new and in flight: ``reset`` cuts connections (the network is gone: botocore's EndpointConnectionError),
    ``503`` answers ``503 ServiceUnavailable`` (the service errs). The soak itself reads the bucket straight
    from moto (``direct``), so it can check the pointer while the launches see an outage.
    """

    NAME = "atscale-chaos"
    MODES = ("reset", "503")
    _ERROR = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>ServiceUnavailable</Code>"
              b"<Message>chaos soak: bucket outage</Message></Error>")

    def __init__(self, log: Path) -> None:
        self.log = log
        self.server: subprocess.Popen | None = None
        self.direct = ""
        self.endpoint = ""
        self.mode = "up"
        self.outages: list[list[Any]] = []  # [mode, seconds] of every outage so far
        self._listener: socket.socket | None = None
        self._fs: Any = None

    def env(self) -> dict[str, str]:
        """What a launch needs to reach the bucket (through the proxy) with the standard AWS variables only."""
        return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": self.endpoint}

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.NAME}", *parts])

    def start(self) -> None:
        """Start moto on a free port, create the bucket, open the proxy."""
        import urllib.request

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MLFLOW_"))}
        with open(self.log, "ab") as out:
            self.server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                           env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True)
        self.direct = f"http://127.0.0.1:{port}"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + 60
        while True:
            try:
                with opener.open(f"{self.direct}/moto-api/", timeout=2):
                    break
            except OSError:
                if self.server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not start; see {self.log}") from None
                time.sleep(0.2)
        self.fs().call_s3("create_bucket", Bucket=self.NAME)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name="bucket-proxy", daemon=True).start()

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self.server is not None and self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGTERM)
            try:
                self.server.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait(10)

    def fs(self) -> Any:
        """An s3fs filesystem straight on moto (not through the proxy): the soak's own view of the bucket."""
        if self._fs is None:
            import s3fs

            self._fs = s3fs.S3FileSystem(key="testing", secret="testing", skip_instance_cache=True,
                                         client_kwargs={"endpoint_url": self.direct, "region_name": "us-east-1"})
        return self._fs

    def down(self, mode: str) -> None:
        assert mode in self.MODES, mode
        self.mode = mode
        self.outages.append([mode, None])
        self._down_at = time.monotonic()

    def up(self) -> None:
        if self.mode != "up":
            self.outages[-1][1] = round(time.monotonic() - self._down_at, 3)
        self.mode = "up"

    # ------------------------------------------------------------ the proxy
    def _accept(self) -> None:
        listener = self._listener
        while listener is not None:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            target = self._pump if self.mode == "up" else self._refuse
            threading.Thread(target=target, args=(conn,), daemon=True).start()

    @staticmethod
    def _reset(sock: socket.socket) -> None:
        """Close with a TCP reset (SO_LINGER 0), as a vanished network path or a dead server does."""
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        except OSError:
            pass

    def _refuse(self, conn: socket.socket) -> None:
        if self.mode == "503":
            conn.settimeout(5)
            head = b""
            try:
                while b"\r\n\r\n" not in head and len(head) < 1 << 16:
                    chunk = conn.recv(1 << 16)
                    if not chunk:
                        break
                    head += chunk
                conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(self._ERROR) + self._ERROR)
            except OSError:
                pass
        self._reset(conn)

    def _pump(self, conn: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", int(self.direct.rsplit(":", 1)[1])), timeout=10)
        except OSError:
            self._reset(conn)
            return
        try:
            while self.mode == "up":  # an outage cuts connections in flight too (an upload half-sent)
                ready, _, _ = select.select([conn, upstream], [], [], 0.1)
                for sock in ready:
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    (upstream if sock is conn else conn).sendall(data)
        except OSError:
            pass
        finally:
            self._reset(conn)
            self._reset(upstream)

    # ------------------------------------------------------------ what the bucket holds
    def verified(self, url: str, name: str) -> tuple[dict[str, Any] | None, str | None]:
        """``(record, None)`` if checkpoint ``name`` under ``url`` is complete and every object matches its
        record's size and SHA-256; else ``(record or None, why not)``."""
        import hashlib

        fs, root = self.fs(), url[len("s3://"):]
        try:
            record = json.loads(fs.cat_file(f"{root}/{name}{ckpt_store.META_SUFFIX}"))
        except FileNotFoundError:
            return None, f"{name} has no record"
        for rel, want in record["files"].items():
            key = "/".join(p for p in (root, name, rel) if p)
            try:
                data = fs.cat_file(key)
            except FileNotFoundError:
                return record, f"{rel or name} is missing"
            if len(data) != want["size"] or hashlib.sha256(data).hexdigest() != want["sha256"]:
                return record, f"{rel or name} has {len(data)} bytes / a SHA-256 unlike its record's"
        return record, None

    def pointer(self, url: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.fs().cat_file(f"{url[len('s3://'):]}/latest.json"))
        except FileNotFoundError:
            return None

    def records(self, url: str) -> list[dict[str, Any]]:
        """Every checkpoint record under ``url``, newest (step, then save time) first; unverified."""
        fs, root = self.fs(), url[len("s3://"):]
        fs.invalidate_cache()
        try:
            metas = [p for p in fs.ls(root, detail=False, refresh=True) if p.endswith(ckpt_store.META_SUFFIX)]
        except FileNotFoundError:
            return []
        return sorted((json.loads(fs.cat_file(p)) for p in metas),
                      key=lambda r: (int(r["global_step"]), float(r["saved_at"])), reverse=True)

    def newest(self, url: str) -> tuple[str, int] | None:
        """What a launch resumes from in the bucket: the pointer's checkpoint if it verifies, else the newest
        record (by step, then save time) that does (as ``RemoteCheckpoints.fetch_newest_good``)."""
        self.fs().invalidate_cache()
        pointer = self.pointer(url)
        if pointer is not None and self.verified(url, pointer["name"])[1] is None:
            return pointer["name"], int(pointer["global_step"])
        for record in self.records(url):
            if self.verified(url, record["name"])[1] is None:
                return record["name"], int(record["global_step"])
        return None


# --------------------------------------------------------------------------- records
@dataclass
class Fault:
    """A fault as it happened."""

    index: int
    kind: str
    run_name: str
    phase: str | None
    moment_s: float | None = None  # seconds from the struck launch's start
    struck: bool = True  # False: the launch had ended before the moment
    exit_codes: list[int | None] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)
    launches: list[dict[str, Any]] = field(default_factory=list)
    furthest_step: int | None = None  # steps the struck launch(es) had logged
    resumable_after: int | None = None  # newest good step right after the fault (soak's view)
    next_resumed_from: int | None = None
    lost_steps: int | None = None
    time_to_resume_s: float | None = None
    next_launch_wall_s: float | None = None
    problems: list[dict[str, str]] = field(default_factory=list)
    corrupted_after: bool = field(default=False, repr=False)

    @property
    def held(self) -> bool:
        return not self.problems

    def fail(self, invariant: str, detail: str) -> None:
        assert invariant in INVARIANTS, invariant
        self.problems.append({"invariant": invariant, "detail": detail})


@dataclass
class Watch:
    """Checkpoints that verified when fault ``fault`` struck and are newer than what its launch resumed from."""

    fault: Fault
    items: dict[str, int]
    observations_left: int = 2  # after the struck launch ended, and after the next launch ended


@dataclass
class RunState:
    name: str
    faults: list[int] = field(default_factory=list)
    finished: bool = False  # a launch exited 0
    mlflow_runs: int = 0
    finish_launches: list[dict[str, Any]] = field(default_factory=list)
    checks: dict[str, Any] = field(default_factory=dict)
    problems: list[dict[str, str]] = field(default_factory=list)

    def fail(self, invariant: str, detail: str) -> None:
        assert invariant in INVARIANTS, invariant
        self.problems.append({"invariant": invariant, "detail": detail})


# --------------------------------------------------------------------------- the soak
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
        self.watches: list[Watch] = []
        self.awaiting: list[Fault] = []  # faults whose next launch has not decided yet
        self.skipped_kinds: dict[str, str] = {}
        self.reference: dict[str, Any] = {}
        self.store_killed: Fault | None = None

    # ------------------------------------------------------------ commands
    def command(self, run_name: str, extra: Sequence[str] = ()) -> list[str]:
        a = self.args
        cmd = [sys.executable, "-m", "recipes.fit", "--config", str(self.repo / "configs/digits.yaml")]
        if a.ddp:
            cmd += ["--config", str(self.repo / "configs/strategy/ddp.yaml")]
        cmd += ["--trainer.max_epochs", str(a.epochs)]
        if a.batches:
            cmd += ["--trainer.limit_train_batches", str(a.batches)]
        cmd += ["--spot.every_n_steps", str(a.every), "--trainer.log_every_n_steps", "1", "--log_model", "false",
                "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                "--run_name", run_name, *extra]
        if self.bucket is not None:
            cmd += ["--runs_root", self.runs_url(run_name)]
        return cmd

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

    def start(self, run_name: str, label: str, extra: Sequence[str] = (), workdir: Path | None = None) -> Launch:
        workdir = workdir or self.chaos
        self.launch_count += 1
        stem = self.logs / f"{self.launch_count:04d}-{label.replace(' ', '_')}"
        expected = self.expected_resume(run_name, workdir)
        with open(f"{stem}.out", "wb") as out, open(f"{stem}.err", "wb") as err:
            started, t0 = time.time(), time.monotonic()
            proc = subprocess.Popen(self.command(run_name, extra), cwd=workdir, env=self.env(workdir),
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
        if not launch.hung and EXIT_WATCH_LINE in launch.stderr():  # ended by its own exit watch (recipes.shutdown)
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
        return {"sigterm": sigterm, "corrupt": sigterm, "double_launch": sigterm | {USAGE_EXIT_CODE},
                "sigkill": {-signal.SIGKILL, 0}, "new_store_kill": sigterm | {-signal.SIGKILL},
                "bucket_outage": sigterm | {USAGE_EXIT_CODE}}.get(fault.kind, set())

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
            elif plan.kind == "bucket_outage" and launch.exit_code == USAGE_EXIT_CODE and not launch.error_line:
                fault.fail("clean_exit", f"{launch.label} exited 2 without an 'error:' line: "
                                         f"{last_error(launch.stderr())}")
        if plan.kind != "corrupt":
            steps = [x.furthest_step for x in struck if x.furthest_step is not None]
            fault.furthest_step = max(steps) if steps else None
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
        mlflow_runs = self.store.runs(run.name)
        run.checks["mlflow_runs"] = mlflow_runs
        if len(mlflow_runs) != 1 or mlflow_runs[0]["status"] != "FINISHED":
            run.fail("one_mlflow_run", f"{len(mlflow_runs)} MLflow runs named {run.name!r}: "
                     f"{[r['status'] for r in mlflow_runs]} (expected one, FINISHED)")

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
        run = RunState(f"{self.prefix}-{len(self.runs) + 1}")
        self.runs.append(run)
        return run

    # ------------------------------------------------------------ the whole soak
    def run(self, plan: Sequence[tuple[int, PlannedFault]], progress: Progress | None = None,
            task: Any = None) -> None:
        """Drive runs through ``plan`` (``(index, fault)`` pairs), finishing and checking each run."""
        a = self.args
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.chaos / "runs").mkdir(parents=True, exist_ok=True)
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


def build_report(soaks: Sequence[Soak], plan: Sequence[PlannedFault]) -> dict[str, Any]:
    """One report over every chain: faults in plan order, runs, per-kind figures and the invariants."""
    first, args = soaks[0], soaks[0].args
    faults = sorted((f for soak in soaks for f in soak.faults), key=lambda f: f.index)
    runs = [run for soak in soaks for run in soak.runs]
    problems: dict[str, list[str]] = {name: [] for name in INVARIANTS}
    for fault in faults:
        for p in fault.problems:
            problems[p["invariant"]].append(f"fault {fault.index + 1} ({fault.kind}): {p['detail']}")
    for run in runs:
        for p in run.problems:
            problems[p["invariant"]].append(f"{run.name}: {p['detail']}")
    stores = []
    for soak in soaks:
        running, broken, summary = soak.store_problems()
        problems["no_run_left_running"] += running
        problems["store_usable"] += broken
        stores.append(summary)
    invariants = {name: {"ok": not found, "problems": found} for name, found in problems.items()}
    return {
        "settings": {"faults": args.faults, "seed": args.seed, "kinds": list(args.kinds), "chains": args.chains,
                     "faults_per_run": args.faults_per_run, "ddp": args.ddp, "store": args.store, "epochs": args.epochs,
                     "batches": args.batches, "every": args.every, "keep": KEEP, "repo": str(first.repo),
                     "workdir": str(first.root), "command": first.command("<run name>")[1:]},
        "skipped_kinds": {k: v for soak in soaks for k, v in soak.skipped_kinds.items()},
        "reference": {k: v for k, v in first.reference.items() if k != "schema"},
        "plan": [asdict(p) for p in plan],
        "faults": [{**{k: v for k, v in asdict(f).items() if k != "corrupted_after"}, "held": f.held} for f in faults],
        "runs": [asdict(r) for r in runs],
        "by_kind": by_kind(faults),
        "stores": stores,
        "launches": sum(len(soak.launches) for soak in soaks),
        "invariants": invariants,
        "ok": all(v["ok"] for v in invariants.values()),
    }


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


# --------------------------------------------------------------------------- summary
def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 3) if values else None


def by_kind(faults: Sequence[Fault]) -> dict[str, dict[str, Any]]:
    """Per kind: count, struck, held/failed, lost steps mean/max, time to resume mean/max, exit codes."""
    out: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(f.kind for f in faults):
        group = [f for f in faults if f.kind == kind]
        lost = [f.lost_steps for f in group if f.lost_steps is not None]
        resume = [f.time_to_resume_s for f in group if f.time_to_resume_s is not None]
        out[kind] = {"count": len(group), "struck": sum(f.struck for f in group),
                     "held": sum(f.held for f in group), "failed": sum(not f.held for f in group),
                     "lost_steps_mean": _mean(lost), "lost_steps_max": max(lost) if lost else None,
                     "time_to_resume_mean_s": _mean(resume), "time_to_resume_max_s": max(resume) if resume else None,
                     "exit_codes": sorted({str(c) for f in group for c in f.exit_codes})}
    return out


def print_report(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"Chaos soak — {len(report['faults'])} faults, seed {report['settings']['seed']}, "
                        f"{len(report['runs'])} run(s), {report['launches']} launches, {report['elapsed_s']:.0f} s")
    for column in ("kind", "faults", "struck", "held", "failed", "lost steps mean / max", "time to resume mean / max",
                   "exit codes"):
        table.add_column(column, justify="left" if column in ("kind", "exit codes") else "right")
    for kind, row in report["by_kind"].items():
        lost = "-" if row["lost_steps_mean"] is None else f"{row['lost_steps_mean']:.1f} / {row['lost_steps_max']}"
        resume = "-" if row["time_to_resume_mean_s"] is None else \
            f"{row['time_to_resume_mean_s']:.1f} s / {row['time_to_resume_max_s']:.1f} s"
        failed = f"[red]{row['failed']}[/]" if row["failed"] else "0"
        table.add_row(kind, str(row["count"]), str(row["struck"]), str(row["held"]), failed, lost, resume,
                      " ".join(row["exit_codes"]))
    console.print(table)
    checks = Table(title="Invariants")
    checks.add_column("invariant")
    checks.add_column("result")
    checks.add_column("first problems")
    for name, result in report["invariants"].items():
        checks.add_row(name, "[green]held[/]" if result["ok"] else f"[red]FAILED ({len(result['problems'])})[/]",
                       "\n".join(p[:300] for p in result["problems"][:3]))
    console.print(checks)
    for kind, reason in report["skipped_kinds"].items():
        console.print(f"[yellow]{kind} skipped: {reason}[/]")


# --------------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``chaos`` subcommand's options (``python -m recipes.bench chaos ...``)."""
    parser.add_argument("--faults", type=int, default=10, help="how many faults to inject")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice")
    parser.add_argument("--kinds", default=None,
                        help=f"comma-separated fault kinds (default: all of {', '.join(KINDS)}; "
                             f"{', '.join(STORE_KINDS)} only with --store s3)")
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
        args.kinds = ",".join(k for k in KINDS if store == "s3" or k not in STORE_KINDS)
    kinds = tuple(k.strip() for k in str(args.kinds).split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        return f"--kinds {args.kinds}: unknown {unknown or 'empty'}; known: {', '.join(KINDS)}"
    if store != "s3" and (need := [k for k in kinds if k in STORE_KINDS]):
        return f"--kinds {args.kinds}: {', '.join(need)} needs --store s3"
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
