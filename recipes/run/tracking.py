"""The MLflow side of a run that no kill, race or URL can break: the store, the run's identity, no secrets kept.

- :func:`tracking_uri`: ``MLFLOW_TRACKING_URI`` (else ``sqlite:///mlflow.db``) without credentials; a
  ``user:password@`` in it moves to MLflow's own ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``
  (HTTP basic auth), a lone ``TOKEN@`` to ``MLFLOW_TRACKING_TOKEN`` (a bearer token), so the URI can be
  logged and printed.
- :func:`check_server`: an HTTP server answers its health endpoint, a database store (PostgreSQL, MySQL,
  ...) answers a query, a sqlite store's folder exists, any other store opens; else one line naming the store,
  its password masked.
- :func:`ensure_store`: a new sqlite store is created and migrated under a temporary name and then
  linked into place, so concurrent first launches do not race in MLflow's schema migration and a kill
  at any moment leaves either no store or a complete one (MLflow migrates a new store in place, and
  a half-migrated one refuses every later run); on a full disk it leaves nothing and says so in one line.
- :func:`confirm_metrics`: once training returns, every metric point is in the store or the run fails,
  resumable (a full store refused MLflow's last flush after Lightning had marked the run FINISHED); a
  relaunch names the ``train/*`` points its history still lacks (:func:`lost_steps`).
- :func:`find_run`: the MLflow run that a run directory belongs to, by the ``atscale.run_dir`` tag
  set when the run is created, so a relaunch after a kill before the first checkpoint continues it.
- :func:`redact`: passwords in URLs replaced by ``***`` in any text that is stored or printed;
  :func:`mask_userinfo` masks a lone token too.

Imports no torch or Lightning (the tools that do not train use it too).
"""

from __future__ import annotations

import base64
import itertools
import logging
import os
import re
import secrets
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# RUN_DIR_TAG (where a run's files live) is defined in keys.py; its importers may take it from here too
from callbacks.analysis.keys import RUN_DIR_TAG, TRAIN_PREFIX
from recipes.run.errors import MetricsRefused, StoreFull, out_of_space, space_reason

log = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"

#: A URL's scheme and userinfo. The authority ends at the first ``/``, ``?`` or ``#`` (or, in free text, a space); the
#: userinfo is everything in it before its LAST ``@``: how urllib3 (hence requests, botocore's and MLflow's HTTP
#: clients) and ``urllib.parse`` split it, so a password holding an ``@`` is masked whole, never cut at its first ``@``.
_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#\s]*)@")


class TrackingError(Exception):
    """The tracking store cannot be used as configured (reported as one line, exit code 2)."""


def _mask_password(match: re.Match[str]) -> str:
    user, colon, _ = match["userinfo"].partition(":")
    return f"{match['scheme']}{user}:***@" if colon else match[0]


def redact(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@`` URL in it replaced by ``***``.

    A lone ``scheme://name@`` is left as it is (it reads as a user name); where a URL is known to
    carry a secret there, use :func:`mask_userinfo`.
    """
    return _URL_USERINFO.sub(_mask_password, text)


def mask_userinfo(text: str) -> str:
    """``text`` with the whole userinfo of every URL in it replaced by ``***`` (``http://TOKEN@host`` included)."""
    return _URL_USERINFO.sub(lambda m: f"{m['scheme']}***@", text)


def has_credentials(url: str) -> bool:
    """Whether ``url`` carries credentials (``scheme://user[:password]@...``)."""
    return _URL_USERINFO.match(url.strip()) is not None


def run_page_url(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    """The run's page in the MLflow UI of an HTTP tracking server (credentials left out); None for a file store.

    MLflow prints it itself each time a run ends (twice for one fit: Lightning's finalize and the deferred
    model); the CLI turns that off and shows it once, in its end table.
    """
    parts = urllib.parse.urlsplit(tracking_uri)
    if parts.scheme not in ("http", "https"):
        return None
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{parts.port}"
    base = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def redact_value(value: Any) -> Any:
    """``value`` (strings, lists, dicts of them) with :func:`redact` applied to every string inside."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, (list, tuple)):
        return type(value)(redact_value(v) for v in value)
    if isinstance(value, dict):
        return {k: redact_value(v) for k, v in value.items()}
    return value


def tracking_uri() -> str:
    """The tracking URI the run uses, without credentials (they move to MLflow's basic-auth variables).

    ``http://user:password@host`` is what many users try first; MLflow's client reads basic-auth
    credentials from ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``. The environment is
    updated so that ranks started later inherit the clean URI and the credentials.
    """
    uri = os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return uri
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, colon, password = userinfo.partition(":")
    # http://TOKEN@host (no colon) is a token, not a user name: sent as a bearer token, never a run's user
    moved = (("MLFLOW_TRACKING_USERNAME", user), ("MLFLOW_TRACKING_PASSWORD", password)) if colon else (
        ("MLFLOW_TRACKING_TOKEN", user),)
    for key, value in moved:
        if value and not os.environ.get(key):
            os.environ[key] = urllib.parse.unquote(value)
    clean = urllib.parse.urlunsplit(parts._replace(netloc=host))
    os.environ["MLFLOW_TRACKING_URI"] = clean
    return clean


#: Tracking stores that are a database server (SQLAlchemy URIs): checked with one query before the run.
DATABASE_SCHEMES = ("postgresql", "mysql", "mssql")


def check_database(uri: str, timeout: float = 5.0) -> None:
    """Fail early (one line, password masked) when a database tracking store does not take a connection.

    One connection attempt with a timeout: MLflow's own store retries an unreachable database for about
    100 s (ten attempts, backing off) and then ends in a traceback.
    """
    try:
        import sqlalchemy

        scheme = uri.split(":", 1)[0].split("+", 1)[0]
        connect_args = {"connect_timeout": int(max(1, timeout))} if scheme in ("postgresql", "mysql") else {}
        engine = sqlalchemy.create_engine(uri, connect_args=connect_args, poolclass=sqlalchemy.pool.NullPool)
        try:
            with engine.connect():
                pass
        finally:
            engine.dispose()
    except Exception as err:  # the driver's own errors (OperationalError, a missing driver, ...): any of them
        reason = " ".join(redact(str(err)).split())[:300] or type(err).__name__
        raise TrackingError(f"MLflow tracking store {redact(uri)} cannot be used ({type(err).__name__}: {reason}); "
                            "start the database or fix MLFLOW_TRACKING_URI.") from None


def check_local_store(uri: str) -> None:
    """Fail early (one line naming the store) when a store that is not a server cannot be opened as configured.

    A sqlite store's folder must exist: MLflow would create any missing folders, wherever a mistyped URI
    points (``sqlite:////nonexistent/dir/x.db`` made ``/nonexistent/dir``). Any other store (``file:``, a
    scheme MLflow does not know, a plugin's) is opened once: whatever MLflow refuses it with, by any exception,
    is said in one line before a run is opened, not as a traceback from the middle of the launch.
    """
    db = sqlite_path(uri)
    if db is not None:
        folder = db.parent
        if not folder.is_dir():
            raise TrackingError(f"MLflow tracking store {redact(uri)}: folder {folder} does not exist; create it or "
                                "fix MLFLOW_TRACKING_URI.")
        if db.is_dir():
            raise TrackingError(f"MLflow tracking store {redact(uri)}: {db} is a folder, not a database file; fix "
                                "MLFLOW_TRACKING_URI.")
        return
    if uri.startswith("sqlite:"):  # in-memory sqlite: MLflow's own business
        return
    import mlflow

    try:
        mlflow.MlflowClient(tracking_uri=uri)  # builds the store: an unknown scheme, a refused file store
    except Exception as err:  # MLflow's own refusals (MlflowException), a missing registry entry (KeyError), OSError
        reason = " ".join(redact(str(err)).split()).split(". ", 1)[0][:300] or type(err).__name__
        raise TrackingError(f"MLflow tracking store {redact(uri)} cannot be used ({type(err).__name__}: {reason}); "
                            "set MLFLOW_TRACKING_URI to sqlite:///mlflow.db, a database or an http(s):// "
                            "server.") from None


def check_server(uri: str, timeout: float = 5.0) -> None:
    """Fail early when an HTTP tracking server does not answer its health endpoint (with basic auth or the
    bearer token if set), a database store does not answer a query, or a local store cannot be opened
    (:func:`check_local_store`)."""
    if uri.split(":", 1)[0].split("+", 1)[0] in DATABASE_SCHEMES:
        check_database(uri)
        return
    if not uri.startswith(("http://", "https://")):
        check_local_store(uri)
        return
    request = urllib.request.Request(f"{uri.rstrip('/')}/health")
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user or password:
        token = base64.b64encode(f"{user or ''}:{password or ''}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    elif os.environ.get("MLFLOW_TRACKING_TOKEN"):
        request.add_header("Authorization", f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            if response.status == 200:
                return
            reason = f"HTTP {response.status}"
    except urllib.error.HTTPError as err:
        reason = f"HTTP {err.code}"
        if err.code in (401, 403):
            raise TrackingError(f"MLflow tracking server {redact(uri)} refused the credentials ({reason}); set "
                                "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD.") from None
    except (OSError, ValueError) as err:
        reason = redact(str(getattr(err, "reason", err)))
    raise TrackingError(f"MLflow tracking server {redact(uri)} is unreachable ({reason}); "
                        "start it or fix MLFLOW_TRACKING_URI.")


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (``None`` for other stores and in-memory sqlite)."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix) or uri[len(prefix):] in ("", ":memory:"):
        return None
    return Path(uri[len(prefix):].split("?", 1)[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_attempts(db: Path) -> None:
    """Delete the temporary stores of creators on this host that died (a kill during a first launch)."""
    host = socket.gethostname()
    prefix = f".{db.name}.creating-"
    for path in db.parent.glob(f"{prefix}*"):
        try:  # .<name>.creating-<host>-<pid>-<random>[-journal]
            owner_host, pid, _ = path.name[len(prefix):].rsplit("-", 2) if not path.name.endswith("-journal") \
                else path.name[len(prefix):-len("-journal")].rsplit("-", 2)
        except ValueError:
            continue
        if owner_host == host and pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)


def ensure_store(uri: str) -> bool:
    """Make sure a sqlite store exists, created whole or not at all; True if this call created it.

    MLflow creates and migrates a new sqlite database in place: several processes doing so at once
    crash in the migration, and a kill in the middle leaves a store that every later run refuses
    ("out-of-date database schema"). Here the store is migrated under a temporary name next to it and
    then hard-linked into place: ``link`` fails if another process won the race (its store is used),
    and the final name only ever names a complete database. Other stores are left to MLflow.

    Raises:
        TrackingError: the store cannot be made here (a bad folder: the input's fault).
        StoreFull: its disk has no room for it (the machine's fault); nothing of it is left behind.
    """
    db = sqlite_path(uri)
    if db is None or db.exists():
        return False
    try:
        db.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        _raise_if_full(uri, err)
        raise TrackingError(f"cannot create the MLflow store {uri}: {err.strerror or err}") from err
    _remove_stale_attempts(db)
    tmp = db.with_name(f".{db.name}.creating-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}")
    import mlflow  # heavy: only when a store is really made

    try:
        store_uri = f"sqlite:///{tmp.resolve()}"
        # creates and migrates it; the connections left open only keep the unlinked file's inode alive
        mlflow.MlflowClient(tracking_uri=store_uri).search_experiments(max_results=1)
        try:
            os.link(tmp, db)
            created = True
        except FileExistsError:  # another launch made it first
            created = False
    except Exception as err:  # SQLite's "database or disk is full" comes as MLflow's and SQLAlchemy's errors
        _raise_if_full(uri, err)
        if not isinstance(err, OSError):
            raise
        raise TrackingError(f"cannot create the MLflow store {uri}: {err.strerror or err}") from err
    finally:
        for leftover in tmp.parent.glob(f"{tmp.name}*"):  # the database and any journal beside it
            leftover.unlink(missing_ok=True)
    return created


def _raise_if_full(uri: str, err: BaseException) -> None:
    full = out_of_space(err)
    if full is not None:
        raise StoreFull(redact(uri), space_reason(full)) from err


def artifact_location(uri: str, experiment: str) -> str | None:
    """Where a new experiment's artifacts go: beside a SQLite store's file (``mlruns/<experiment>``), else the
    store's own default (a server's artifact root, a database's).

    MLflow's default for a SQLite store is ``./mlruns`` of the working directory at the experiment's creation:
    one store's artifacts ended up in whichever folder each launch happened to start from.
    """
    path = sqlite_path(uri)
    if path is None:
        return None
    return (path.resolve().parent / "mlruns" / urllib.parse.quote(experiment, safe="")).as_uri()


def ensure_experiment(client: Any, name: str) -> str:
    """The id of experiment ``name``, created if missing (its artifacts beside a SQLite store's file).

    Launches started at once on a new store all find no experiment and all create it: MLflow refuses all but
    one (a UNIQUE constraint), and the others take the one that won.
    """
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location(client.tracking_uri, name))
    except MlflowException:
        found = client.get_experiment_by_name(name)  # created by another launch between the two calls
        if found is None:
            raise
        return found.experiment_id


def find_run(client: Any, experiment: str, location: str) -> str | None:
    """The id of the newest MLflow run of ``experiment`` tagged as living at ``location``, if any.

    Raises:
        ValueError: ``location`` holds both quote characters, which no MLflow filter can say.
    """
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    # common.quoted's rule (common imports this module): MLflow reads no escaped quote, so quote with the other kind
    if "'" in location and '"' in location:
        raise ValueError(f"{location!r}: a run directory with both ' and \" cannot be searched for in MLflow.")
    quote = '"' if "'" in location else "'"
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_DIR_TAG}` = {quote}{location}{quote}",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def start_system_metrics(run_id: str, resume: bool) -> Any:
    """MLflow's system-metrics sampler, started; a continued run's samples carry on from its last sample's step."""
    from recipes.run.compat import system_metrics_monitor

    monitor = system_metrics_monitor(run_id, sampling_interval=10, samples_before_logging=1, resume_logging=resume)
    if monitor is not None:
        monitor.start()
    return monitor


def flush_async_metrics() -> None:
    """Wait until MLflow's async queue (of the current tracking URI's store) has written every metric."""
    import mlflow

    try:
        mlflow.flush_async_logging()
    except Exception as err:  # the store itself may be what failed; the run's outcome stands
        log.error("Could not flush the MLflow metrics still queued: %s", err)


def confirm_metrics(logger: Any, every: int, trained: int, continued: bool) -> None:
    """After training, on the process that logs: every metric point in the store, or the run fails resumable.

    MLflow's async queue writes its last points as the run ends, after Lightning's ``finalize`` has marked it
    FINISHED; a store that refuses them (a full disk) left a "finished" run without them, and its relaunch found
    nothing to do. ``logger`` is the CLI's ``ResumableMLFlowLogger``: its ``unconfirmed()`` sees each write's
    outcome, and the newest checkpoint's record carries the refused points (``callbacks.checkpoint_io.PublishGate``).
    A continued run (a relaunch) then checks its history for points that nothing restored: :func:`lost_points`.

    Raises:
        MetricsRefused: the store refused a write; its ``__cause__`` is the store's error.
    """
    unconfirmed = getattr(logger, "unconfirmed", None)
    if unconfirmed is None:
        return
    flush_async_metrics()
    _, refused = unconfirmed()
    if refused is not None:
        raise MetricsRefused(f"the tracking store refused the run's last metric points ({refused})") from refused
    if continued:
        lost = lost_points(logger.experiment, logger.run_id, every, trained)
        if lost:
            log.warning("%s", lost)


#: Keys :func:`lost_points` checks: those training logs every ``log_every_n_steps`` steps.
LOGGED_EVERY_STEP_PREFIX = TRAIN_PREFIX


def lost_steps(history: Mapping[str, Iterable[int]], every: int, trained: int) -> dict[str, list[int]]:
    """The logging steps before ``trained`` that each key logged at every logging step lacks.

    Lightning logs training metrics at the steps ``s`` with ``(s + 1) % every == 0`` (``log_every_n_steps``), and
    at the step a run stops (off that cadence: not counted). A key counts as logged at every logging step when two
    of its points are at consecutive ones; a key logged once an epoch (its points an epoch apart) or with a single
    point is not judged.
    """
    lost: dict[str, list[int]] = {}
    if every < 1:
        return lost
    for key, steps in history.items():
        held = sorted({s for s in steps if (s + 1) % every == 0})
        if not any(b - a == every for a, b in itertools.pairwise(held)):
            continue
        missing = sorted(set(range(every - 1, trained, every)) - set(held))
        if missing:
            lost[key] = missing
    return lost


def lost_points(client: Any, run_id: str, every: int, trained: int, shown: int = 10) -> str | None:
    """One warning naming the keys and steps of ``train/*`` points the run's history lacks (:func:`lost_steps`),
    or ``None``: points the store lost that no checkpoint's record kept, which a relaunch cannot log again."""
    keys = [k for k in client.get_run(run_id).data.metrics if k.startswith(LOGGED_EVERY_STEP_PREFIX)]
    lost = lost_steps({k: [m.step for m in client.get_metric_history(run_id, k)] for k in sorted(keys)}, every,
                      trained)
    if not lost:
        return None

    def steps(missing: list[int]) -> str:
        more = f" and {len(missing) - shown} more" if len(missing) > shown else ""
        return f"step{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing[:shown]))}{more}"

    return ("Metric points that the tracking store lost could not be restored (no checkpoint's record kept them): "
            + "; ".join(f"{key} at {steps(missing)}" for key, missing in lost.items()) + ".")
