"""The sweep's Optuna study in a database: create or join it, claim trials, and hand interrupted ones back.

A study holds exactly ``--trials`` trials from the start: the process that creates it enqueues them all as
WAITING (the first ones with ``--enqueue``'s fixed parameters), so however many processes on however many
machines join, no trial is made twice and the count is exact. A process claims the lowest WAITING trial
(Optuna's ``Study.ask``: its WAITING -> RUNNING transition, which fails for all but one claimant) and samples
its parameters only then, with the history so far. A trial stopped by a notice goes back to WAITING with its
parameters: whoever claims it next resumes the same run.

A trial whose process died without saying so (SIGKILL, a lost machine) is handed back the same way. Its
liveness is Optuna's heartbeat (``RDBStorage.record_heartbeat``, stamped with the database's clock, so machines
whose clocks disagree still agree on its age) beside an owner token (host, pid). What Optuna lacks is written
here: its stale trials are failed (``optuna.storages.fail_stale_trials``; FAIL is final) and retried as new
trials (``RetryHeartbeatStaleTrialCallback``) under a new number, so a sweep would outgrow ``--trials`` and the
copy would start a new run instead of resuming the same trial's run from its checkpoints; so a stale trial goes
back to WAITING as itself. And a heartbeat knows no process: the owner token finds a dead sweep process on this
host at once (a relaunch right after a SIGKILL resumes its trials), not after the grace period.

Creating, growing and claiming happen under a lock for the whole study: a file lock beside a sqlite
database (a sqlite study lives on one machine; pysqlite reads before it locks, so Optuna's claim alone is
not atomic there), a PostgreSQL advisory lock (or MySQL's ``GET_LOCK``) otherwise.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import socket
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from filelock import FileLock
from optuna.exceptions import DuplicatedStudyError, ExperimentalWarning
from optuna.trial import TrialState

from recipes.run.common import UsageError
from recipes.run.compat import stale_heartbeat_trial_ids

__all__ = ["HEARTBEAT_S", "OWNER_ATTR", "claim_trial", "heartbeat", "make_pruner", "make_sampler", "open_storage",
           "open_study", "release", "stale_trials", "study_lock", "trial_id"]

#: Trial system attr: which process runs the trial (host, pid); its heartbeat is Optuna's.
OWNER_ATTR = "atscale.owner"
#: Seconds between the heartbeats a sweep process records for each trial it runs.
HEARTBEAT_S = 10
#: Study user attrs: the settings every process must share, the planned trial count, the parent MLflow run.
SETTINGS_ATTR = "atscale.settings"
TRIALS_ATTR = "atscale.trials"
PARENT_RUN_ATTR = "atscale.mlflow_parent_run_id"
#: Trial user attrs the sweep and the trial's pruning callback write.
RUN_NAME_ATTR = "run_name"
RUN_ID_ATTR = "mlflow_run_id"
PRUNED_ATTR = "pruned_at_epoch"
ATTEMPTS_ATTR = "attempts"
SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "halving", "none")


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """An Optuna RDB storage at ``url``; :class:`UsageError` naming the URL when it cannot be used.

    Optuna creates its tables in a new database: several processes doing so at once collide (all but one
    fail on PostgreSQL's unique catalog entries), so the creation holds a lock (advisory on PostgreSQL, a file
    beside a sqlite database), and a collision with a program that does not take it (Optuna's dashboard, a
    notebook's ``load_study``) is retried: the tables then exist.
    """
    from recipes.run.tracking import redact

    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite:"):
        kwargs = {"connect_args": {"timeout": 60}}  # wait for another process's write instead of failing
    else:
        kwargs = {"pool_pre_ping": True}
    for attempt in range(5):
        try:
            with _schema_lock(url):
                return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
        except Exception as err:  # sqlalchemy's many errors: a bad URL, a missing driver, a refused connection
            created_elsewhere = type(err).__name__ in ("IntegrityError", "ProgrammingError") or (
                type(err).__name__ == "OperationalError" and "already exists" in str(err))  # sqlite's word for it
            if created_elsewhere and attempt < 4:
                time.sleep(0.2 * (attempt + 1))  # another process was creating the tables: they exist now
                continue
            message = " ".join(str(err).split())[:300]
            raise UsageError(f"--storage {redact(url)}: cannot open it ({type(err).__name__}: {message})") from None
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _schema_lock(url: str) -> Iterator[None]:
    """Hold the database while Optuna creates (or checks) its tables: an advisory lock on PostgreSQL, the
    study lock file beside a sqlite database."""
    if url.startswith("sqlite:"):
        with _sqlite_file_lock(url):
            yield
        return
    if not url.startswith(("postgresql:", "postgresql+", "postgres:")):
        yield
        return
    import sqlalchemy
    from sqlalchemy.pool import NullPool

    engine = sqlalchemy.create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": _lock_key("optuna-schema")})
            try:
                yield
            finally:
                conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": _lock_key("optuna-schema")})
    finally:
        engine.dispose()


@contextlib.contextmanager
def _sqlite_file_lock(url: str) -> Iterator[None]:
    """The lock file beside a sqlite database, held exclusively (nothing to hold for an in-memory one)."""
    path = _sqlite_lock_path(url)
    if path is None:
        yield
        return
    with FileLock(path):
        yield


def _sqlite_lock_path(url: str) -> Path | None:
    database = url.split(":///", 1)[-1].split("?", 1)[0]
    return Path(database + ".atscale-lock") if database and database != ":memory:" else None


def _lock_key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"atscale-sweep:{name}".encode()).digest()[:8], "big", signed=True)


@contextlib.contextmanager
def study_lock(storage: optuna.storages.RDBStorage, url: str, name: str) -> Iterator[None]:
    """Hold the study ``name`` for creating, growing or claiming (module docstring)."""
    if url.startswith("sqlite:"):
        with _sqlite_file_lock(url):
            yield
        return
    import sqlalchemy

    dialect = storage.engine.dialect.name
    key = _lock_key(name)
    with storage.engine.connect() as conn:
        if dialect == "postgresql":
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": key})
            unlock = ("SELECT pg_advisory_unlock(:k)", {"k": key})
        elif dialect in ("mysql", "mariadb"):
            conn.execute(sqlalchemy.text("SELECT GET_LOCK(:k, 600)"), {"k": str(key)})
            unlock = ("SELECT RELEASE_LOCK(:k)", {"k": str(key)})
        else:
            raise UsageError(f"--storage: a {dialect} database is not supported (sqlite, postgresql or mysql)")
        conn.commit()
        try:
            yield
        finally:
            conn.execute(sqlalchemy.text(unlock[0]), unlock[1])
            conn.commit()


def make_sampler(kind: str, seed: int, number: int) -> optuna.samplers.BaseSampler:
    """The sampler of trial ``number``: seeded by ``(seed, number)``, so two processes never draw alike.

    TPE and random sampling keep no state between trials but their random generator (TPE reads the
    history from the storage each time), so a sampler per trial loses nothing and makes each trial's draw
    a function of the seed, its number and the history.
    """
    trial_seed = (seed * 1_000_003 + number) % 2**32
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=trial_seed)
    # constant liar: trials running in parallel count as bad guesses, so TPE does not suggest them again
    return optuna.samplers.TPESampler(seed=trial_seed, constant_liar=True)


def make_pruner(kind: str, startup_trials: int, warmup_epochs: int) -> optuna.pruners.BasePruner:
    """``median``: stop a trial worse than the median of the finished ones at the same epoch (after
    ``startup_trials`` finished and ``warmup_epochs`` epochs); ``halving``: successive halving from epoch
    ``warmup_epochs``; ``none``: never."""
    if kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=warmup_epochs)
    if kind == "halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=max(1, warmup_epochs + 1))
    return optuna.pruners.NopPruner()


def _changed(stored: Mapping[str, Any], settings: Mapping[str, Any]) -> list[str]:
    return [k for k in sorted(set(stored) | set(settings)) if stored.get(k) != settings.get(k)]


def open_study(storage: optuna.storages.RDBStorage, url: str, name: str, direction: str,
               settings: Mapping[str, Any], trials: int, enqueue: Sequence[Mapping[str, Any]]
               ) -> tuple[optuna.Study, bool]:
    """Create the study ``name`` with ``trials`` WAITING trials, or join it; returns ``(study, created)``.

    Raises:
        UsageError: the study exists with other settings (the message names them), or with more trials
            planned than ``trials``.
    """
    settings = json.loads(json.dumps(settings))
    with study_lock(storage, url, name):
        try:
            study = optuna.create_study(storage=storage, study_name=name, direction=direction)
            created = True
        except DuplicatedStudyError:
            study = optuna.load_study(storage=storage, study_name=name)
            created = False
        if created:
            study.set_user_attr(SETTINGS_ATTR, settings)
        stored = study.user_attrs.get(SETTINGS_ATTR)
        if stored is None:
            raise UsageError(f"--name {name}: the study exists in the storage but was not made by recipes.sweep")
        changed = _changed(stored, settings)
        if changed:
            shown = "; ".join(f"{k}: {json.dumps(stored.get(k))} -> {json.dumps(settings.get(k))}" for k in changed)
            raise UsageError(f"sweep {name!r} was started with other settings ({shown}); relaunch with the "
                             "original ones to continue it, or choose a new --name")
        planned = int(study.user_attrs.get(TRIALS_ATTR, 0))
        if trials < planned:
            raise UsageError(f"--trials {trials}: sweep {name!r} already plans {planned} trials; pass --trials "
                             f"{planned} (or more) to continue it")
        for index in range(planned, trials):
            study.enqueue_trial(dict(enqueue[index]) if index < len(enqueue) else {})
        if trials > planned:
            study.set_user_attr(TRIALS_ATTR, trials)
    return study, created


def owner_token() -> dict[str, Any]:
    """This process, as a trial's owner attr names it."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def trial_id(storage: optuna.storages.BaseStorage, study: optuna.Study, number: int) -> int:
    """The storage's id of trial ``number`` of ``study`` (what the storage's methods take)."""
    return storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study.study_name), number)


def claim_trial(study: optuna.Study, storage: optuna.storages.RDBStorage, url: str,
                sampler: Callable[[int], optuna.samplers.BaseSampler] | None = None) -> optuna.Trial | None:
    """Claim the lowest WAITING trial for this process (WAITING -> RUNNING), or None if none is left.

    ``sampler(number)``, when given, becomes the study's sampler before the trial is asked for (it samples the
    trial's parameters).
    """
    with study_lock(storage, url, study.study_name):
        waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        if not waiting:
            return None  # never ask(): with no trial waiting it would add one past --trials
        if sampler is not None:
            study.sampler = sampler(waiting[0].number)
        # pops the lowest WAITING trial: every claimant holds this lock, so the one seen above
        trial = study.ask()
        tid = trial_id(storage, study, trial.number)
        heartbeat(storage, tid)
        storage.set_trial_system_attr(tid, OWNER_ATTR, owner_token())
        return trial


def heartbeat(storage: optuna.storages.RDBStorage, trial_id: int) -> None:
    """Say that this process still runs the trial (Optuna's heartbeat: the database's clock)."""
    storage.record_heartbeat(trial_id)


def release(storage: optuna.storages.RDBStorage, trial_id: int) -> None:
    """Hand a stopped trial back (RUNNING -> WAITING): its parameters and run stay; the next claimant resumes it."""
    storage.set_trial_system_attr(trial_id, OWNER_ATTR, None)
    storage.set_trial_state_values(trial_id, state=TrialState.WAITING)


def _process_gone(owner: Any) -> bool:
    """Whether the owner token names a process of this host that has ended (Optuna's heartbeat knows no process)."""
    if not isinstance(owner, Mapping) or owner.get("host") != socket.gethostname() or owner.get("pid") == os.getpid():
        return False
    try:
        os.kill(int(owner.get("pid", 0)), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError, OverflowError):
        pass
    return False


def _stale_heartbeats(storage: optuna.storages.RDBStorage, study: optuna.Study, stale_after_s: float) -> set[int]:
    """The ids of the study's RUNNING trials whose Optuna heartbeat is older than ``stale_after_s``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)  # heartbeat_interval: experimental since Optuna 2.9
        watch = optuna.storages.RDBStorage(storage.url, engine_kwargs=storage.engine_kwargs,
                                           skip_compatibility_check=True, skip_table_creation=True,
                                           heartbeat_interval=HEARTBEAT_S,
                                           grace_period=max(1, math.ceil(stale_after_s)))
    try:
        # Optuna's public fail_stale_trials FAILs the trials it finds (final), where a sweep hands them back to
        # WAITING as themselves (module docstring): the finding alone goes through recipes/run/compat.py
        return stale_heartbeat_trial_ids(watch, storage.get_study_id_from_name(study.study_name))
    finally:
        watch.engine.dispose()


def stale_trials(study: optuna.Study, storage: optuna.storages.RDBStorage, url: str, stale_after_s: float,
                 mine: set[int]) -> list[int]:
    """Hand back RUNNING trials whose process is gone (a dead pid on this host, or no Optuna heartbeat for
    ``stale_after_s``, whole seconds); returns their numbers."""
    handed: list[int] = []
    with study_lock(storage, url, study.study_name):
        stale = _stale_heartbeats(storage, study, stale_after_s)
        now = time.time()
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if trial.number in mine:
                continue
            tid = trial_id(storage, study, trial.number)
            owner = trial.system_attrs.get(OWNER_ATTR)
            # no owner: its claimant died inside claim_trial, maybe before its first heartbeat (which Optuna
            # then never finds stale): its start is its last sign of life
            unclaimed = owner is None and trial.datetime_start is not None and \
                now - trial.datetime_start.timestamp() > stale_after_s
            if tid in stale or _process_gone(owner) or unclaimed:
                release(storage, tid)
                handed.append(trial.number)
    return handed
