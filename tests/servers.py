"""Real servers on 127.0.0.1: moto S3 (lenient and strict), an MLflow tracking server, and a team's tracking
server (a throwaway PostgreSQL with ``mlflow server`` in front of it, artifacts proxied to moto).

Everything runs as a subprocess in its own process group, so checkpoint code under test talks HTTP to a real
endpoint exactly as it would to AWS, and teardown can stop a server together with any children it spawned.
Test modules import the fixtures by name::

    from tests.servers import moto_s3, moto_s3_strict, mlflow_server, s3fs_fresh  # noqa: F401
    from tests.servers import postgres, team_server  # noqa: F401

PostgreSQL comes from the operating system (Debian's ``postgresql`` package: its binaries live in
``/usr/lib/postgresql/<version>/bin``, not on PATH; ``initdb`` on PATH or ``ATSCALE_PG_BINDIR`` win). PostgreSQL
refuses to run as root, so when the tests run as root the server runs as the ``postgres`` system user (made by
that package), else as ``nobody``, or as ``ATSCALE_PG_USER``; its data directory is a fresh folder under the
system temp dir (pytest's own temp dirs are private to root) owned by that user. Without the binaries (or the
``psycopg`` driver) the PostgreSQL tests skip with the reason, except under CI (``CI`` set), where they fail:
``.ci/run`` installs the package.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

HOST = "127.0.0.1"
REGION = "us-east-1"
WRONG_ACCESS_KEY_ID = "AKIAWRONGWRONGWRONG1"

# Readiness polls go straight to 127.0.0.1, whatever HTTP(S)_PROXY the environment sets.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the kernel picks it; a race with others is unlikely)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def log_tail(log: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a server log, for error messages."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError as err:
        return f"<no log at {log}: {err}>"


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without AWS_*/MLFLOW_*/moto auth settings, plus ``extra``: no config leaks in."""
    drop = ("AWS_", "MLFLOW_", "INITIAL_NO_AUTH_ACTION_COUNT")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def stop_process(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM the process group of ``proc``, SIGKILL it if it has not exited after ``timeout`` seconds.

    The group is signalled only while ``proc`` is unreaped, so its pid (= the group id) cannot have been reused.
    """
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def start_process(cmd: list[str], env: dict[str, str], log: Path, ready_url: str, timeout: float,
                  cwd: Path | None = None) -> subprocess.Popen:
    """Start ``cmd`` in a new process group, output to ``log``, and wait until ``ready_url`` answers HTTP 200.

    Raises RuntimeError with the log's tail if the process exits first or is not ready within ``timeout`` s.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with _DIRECT.open(ready_url, timeout=2) as resp:
                if resp.status == 200:
                    return proc
        except (urllib.error.URLError, OSError):  # HTTPError is a URLError: not ready yet either
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{shlex.join(cmd)} exited with {proc.returncode} before {ready_url} answered; "
                               f"{log}:\n{log_tail(log)}")
        if time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError(f"{shlex.join(cmd)} not ready at {ready_url} after {timeout:.0f} s; "
                               f"{log}:\n{log_tail(log)}")
        time.sleep(0.2)


def _start_with_port(make_cmd: Callable[[int], list[str]], ready_path: str, env: dict[str, str], log: Path,
                     timeout: float, cwd: Path | None = None, attempts: int = 3) -> tuple[subprocess.Popen, str]:
    """``start_process`` on a fresh free port, retried on a new port if the server dies (e.g. port taken)."""
    for attempt in range(1, attempts + 1):
        port = free_port()
        base = f"http://{HOST}:{port}"
        try:
            return start_process(make_cmd(port), env, log, base + ready_path, timeout, cwd), base
        except RuntimeError:
            if attempt == attempts or "Address already in use" not in log_tail(log):
                raise
    raise AssertionError("unreachable")


@dataclass
class S3Server:
    """A running moto S3 endpoint.

    ``env`` is what a client process needs to reach it through the standard AWS/MLflow variables only.
    ``admin_env`` holds credentials that the server accepts; ``client()``, ``make_bucket`` and ``keys`` use it,
    falling back to ``env`` (the strict server's ``env`` deliberately carries credentials it rejects).
    """

    endpoint: str
    env: dict[str, str]
    admin_env: dict[str, str] | None = None
    log: Path | None = None

    def client(self) -> Any:
        """A boto3 S3 client for this endpoint with working credentials."""
        import boto3

        creds = self.admin_env or self.env
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"])

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (fine if it already exists) and return the name."""
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """All object keys in ``bucket`` under ``prefix``, across every page of ListObjectsV2, sorted."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))


def _s3_env(endpoint: str, key_id: str, secret: str) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": key_id,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL": endpoint,
        "MLFLOW_S3_ENDPOINT_URL": endpoint,
    }


def _moto_cmd(port: int) -> list[str]:
    return [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)]


def _set_moto_auth(endpoint: str, free_requests: float) -> None:
    """moto's /moto-api/reset-auth: the next ``free_requests`` requests skip IAM checks (inf: all, 0: none).

    The body must not be sent as a form (urllib's default content type), or moto reads it as empty and fails.
    """
    req = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=str(free_requests).encode(),
                                 method="POST", headers={"Content-Type": "text/plain"})
    with _DIRECT.open(req, timeout=10) as resp:
        resp.read()


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A moto S3 server that accepts any credentials; ``env`` uses the conventional "testing" ones.

    Startup measured at ~0.5 s on the 2-core dev box.
    """
    import moto  # noqa: F401  (a dev dependency: if it is missing or broken, the S3 tests fail, never skip)

    log = tmp_path_factory.mktemp("moto-s3") / "moto.log"
    proc, endpoint = _start_with_port(_moto_cmd, "/moto-api/", clean_env(), log, timeout=30)
    try:
        yield S3Server(endpoint, _s3_env(endpoint, "testing", "testing"), log=log)
    finally:
        stop_process(proc)


@pytest.fixture(scope="session")
def moto_s3_strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A moto S3 server that enforces IAM authentication, so made-up credentials are rejected.

    The server runs with ``INITIAL_NO_AUTH_ACTION_COUNT=0`` (moto 5.2.5 reads it at import, and then checks the
    signature and IAM policy of every request). To have usable credentials, auth is lifted for a moment through
    /moto-api/reset-auth to create an IAM user with an allow-all policy and an access key (``admin_env``), then
    enforced again. ``env`` carries AWS_ACCESS_KEY_ID=AKIAWRONGWRONGWRONG1, which the server does not know.

    What s3fs raises with ``env`` (e.g. ``fs.pipe_file``): ``PermissionError("The AWS Access Key Id you provided
    does not exist in our records.")``, chained from botocore's ClientError with code ``InvalidAccessKeyId``
    (HTTP 403), even for a bucket that does not exist. With a known key but a wrong secret it is
    ``PermissionError("The request signature we calculated does not match the signature you provided. ...")``.
    """
    import boto3
    import moto  # noqa: F401  (a dev dependency: if it is missing or broken, the S3 tests fail, never skip)

    log = tmp_path_factory.mktemp("moto-s3-strict") / "moto.log"
    env = clean_env(INITIAL_NO_AUTH_ACTION_COUNT="0")
    proc, endpoint = _start_with_port(_moto_cmd, "/moto-api/", env, log, timeout=30)
    try:
        _set_moto_auth(endpoint, float("inf"))
        try:
            iam = boto3.client("iam", endpoint_url=endpoint, region_name=REGION, aws_access_key_id="bootstrap",
                               aws_secret_access_key="bootstrap")
            iam.create_user(UserName="atscale-admin")
            policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
            iam.put_user_policy(UserName="atscale-admin", PolicyName="allow-all", PolicyDocument=json.dumps(policy))
            key = iam.create_access_key(UserName="atscale-admin")["AccessKey"]
        finally:
            _set_moto_auth(endpoint, 0)
        yield S3Server(endpoint, _s3_env(endpoint, WRONG_ACCESS_KEY_ID, "wrong-secret-wrong-secret"),
                       admin_env=_s3_env(endpoint, key["AccessKeyId"], key["SecretAccessKey"]), log=log)
    finally:
        stop_process(proc)


@pytest.fixture
def s3fs_fresh() -> Iterator[None]:
    """Drop cached s3fs instances before and after the test: they keep the credentials/endpoint they were made with.

    fsspec caches filesystems by constructor arguments, and env-var credentials are not among them, so without this
    an instance from an earlier test (other server, other keys) would be reused.
    """
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()


def start_mlflow_server(s3: S3Server, bucket: str, workdir: Path, backend_store_uri: str | None = None,
                        workers: int = 1, timeout: float = 90) -> tuple[subprocess.Popen, str]:
    """A real ``mlflow server`` on a free port with artifacts proxied to ``s3://<bucket>/mlartifacts``.

    ``backend_store_uri`` defaults to ``sqlite:///<workdir>/server.db``. Returns the process (stop it with
    ``stop_process``) and the tracking URL. The log is ``workdir/mlflow-server.log``.
    """
    s3.client().head_bucket(Bucket=bucket)  # fail here, not at the first artifact upload
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    backend = backend_store_uri or f"sqlite:///{workdir.resolve() / 'server.db'}"

    def cmd(port: int) -> list[str]:
        return [sys.executable, "-m", "mlflow", "server", "--host", HOST, "--port", str(port),
                "--backend-store-uri", backend, "--serve-artifacts",
                "--artifacts-destination", f"s3://{bucket}/mlartifacts", "--workers", str(workers)]

    # no job runner: MLflow's GenAI jobs (a huey consumer process per server, ~4 CPU-s to start) serve nothing here
    env = clean_env(**s3.env, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    return _start_with_port(cmd, "/health", env, workdir / "mlflow-server.log", timeout=timeout, cwd=workdir)


@pytest.fixture
def mlflow_server(moto_s3: S3Server) -> Iterator[Callable[[str, Path], str]]:
    """Factory: ``start(bucket, workdir) -> tracking URL`` of a real ``mlflow server`` that proxies artifacts to moto.

    The server stores runs in ``workdir/server.db``, logs to ``workdir/mlflow-server.log``, and writes artifacts to
    ``s3://<bucket>/mlartifacts/<experiment id>/<run id>/artifacts/...`` with the moto_s3 credentials; clients see
    ``mlflow-artifacts:/`` locations and need no S3 credentials. No host/CORS flags are needed: mlflow 3.17's
    security middleware allows Host 127.0.0.1 by default. Every server started is stopped at teardown.
    Startup (to /health = 200) measured at 7.5-9 s on the 2-core dev box, most of it creating the sqlite schema;
    the 90 s limit leaves room for a loaded machine.
    """
    procs: list[subprocess.Popen] = []

    def start(bucket: str, workdir: Path) -> str:
        proc, url = start_mlflow_server(moto_s3, bucket, workdir)
        procs.append(proc)
        return url

    try:
        yield start
    finally:
        for proc in procs:
            stop_process(proc)


# --- PostgreSQL --------------------------------------------------------------------------------------------------

PG_SUPERUSER = "atscale"


def _unavailable(reason: str) -> None:
    """Skip with ``reason`` on a developer's machine; fail under CI, where ``.ci/run`` must have installed it."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: .ci/run installs PostgreSQL and the dev extra; this must not skip)")
    pytest.skip(reason)


def pg_bindir() -> Path | None:
    """The folder of PostgreSQL's server binaries (initdb, postgres), or None when none is installed.

    In order: ``ATSCALE_PG_BINDIR``; ``initdb`` on PATH; ``pg_config --bindir``; the newest
    ``/usr/lib/postgresql/<version>/bin`` (where Debian's package puts them, off PATH).
    """
    candidates: list[Path] = []
    if os.environ.get("ATSCALE_PG_BINDIR"):
        candidates.append(Path(os.environ["ATSCALE_PG_BINDIR"]))
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                candidates.append(Path(out.stdout.strip()))
        except (OSError, subprocess.TimeoutExpired):
            pass

    def version(path: Path) -> tuple[int, ...]:
        return tuple(int(p) for p in path.parent.name.split(".") if p.isdigit())

    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
    for folder in candidates:
        if (folder / "initdb").is_file() and (folder / "postgres").is_file():
            return folder
    return None


def pg_run_user() -> pwd.struct_passwd | None:
    """The account PostgreSQL runs as: None (this one) unless we are root, which PostgreSQL refuses."""
    if os.geteuid() != 0:
        return None
    for name in (os.environ.get("ATSCALE_PG_USER"), "postgres", "nobody"):
        if not name:
            continue
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError("running as root and no user to run PostgreSQL as: set ATSCALE_PG_USER to an account")


@dataclass
class PostgresServer:
    """A running throwaway PostgreSQL on 127.0.0.1 (scram-sha-256 password auth over TCP)."""

    host: str
    port: int
    user: str
    password: str
    datadir: Path
    log: Path
    run_as: str  # the operating-system account the server runs as

    def uri(self, database: str = "postgres") -> str:
        """A SQLAlchemy URL, as ``mlflow server --backend-store-uri`` takes it.

        A plain ``postgresql://`` means the psycopg (3) driver to SQLAlchemy >= 2.1 (it was psycopg2 before):
        with only psycopg2 installed, mlflow server fails with "No module named 'psycopg'".
        """
        return f"postgresql://{self.user}:{self.password}@{self.host}:{self.port}/{database}"

    def connect(self, database: str = "postgres") -> Any:
        import psycopg

        return psycopg.connect(host=self.host, port=self.port, user=self.user, password=self.password,
                               dbname=database, connect_timeout=5)

    def create_database(self, name: str) -> str:
        """CREATE DATABASE ``name`` (a fresh, empty one) and return its URI."""
        conn = self.connect()
        try:
            conn.autocommit = True  # CREATE DATABASE cannot run in a transaction
            with conn.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()
        return self.uri(name)


def _as_user(user: pwd.struct_passwd | None) -> dict[str, Any]:
    """Popen arguments that run a child as ``user`` (no supplementary groups), or nothing for this user."""
    if user is None:
        return {}
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def _stop_postgres(proc: subprocess.Popen) -> None:
    """SIGINT is PostgreSQL's fast shutdown (roll back, disconnect clients, exit); SIGKILL after 15 s."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            pass
    stop_process(proc)


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL server: ``initdb`` into a fresh folder, ``postgres`` on a free loopback port.

    Only TCP on 127.0.0.1 with scram-sha-256 password authentication (as a real team's database would be reached),
    plus a unix socket inside the data folder. Durability is off (``fsync=off``): the data is thrown away.
    Measured on the 2-core dev box: initdb ~2 s, start ~0.5 s.
    """
    bindir = pg_bindir()
    if bindir is None:
        _unavailable("PostgreSQL server binaries not found (initdb/postgres; Debian: apt-get install postgresql)")
    try:
        import psycopg  # noqa: F401 - the driver SQLAlchemy 2.1 uses for postgresql:// URIs
    except ImportError:
        _unavailable("the psycopg driver is not installed (pip install -e '.[dev]', or pip install 'psycopg[binary]')")
    user = pg_run_user()
    root = Path(tempfile.mkdtemp(prefix="atscale-pg-"))
    datadir, sockdir, log = root / "data", root / "sock", root / "postgres.log"
    sockdir.mkdir()
    password = secrets.token_hex(16)
    pwfile = root / "pwfile"
    pwfile.write_text(password + "\n")
    if user is not None:
        for path in (root, sockdir, pwfile):
            os.chown(path, user.pw_uid, user.pw_gid)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "TZ": "UTC"}
    init = subprocess.run([str(bindir / "initdb"), "-D", str(datadir), "-U", PG_SUPERUSER, "--pwfile", str(pwfile),
                           "--auth-host=scram-sha-256", "--auth-local=trust", "-E", "UTF8", "--locale=C",
                           "--no-sync"], cwd=root, env=env, capture_output=True, text=True, timeout=120,
                          **_as_user(user))
    pwfile.unlink()
    if init.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"initdb failed ({init.returncode}):\n{init.stdout[-2000:]}\n{init.stderr[-2000:]}")
    proc: subprocess.Popen | None = None
    try:
        for attempt in range(1, 4):
            port = free_port()
            with open(log, "ab") as out:
                proc = subprocess.Popen(
                    [str(bindir / "postgres"), "-D", str(datadir), "-h", HOST, "-p", str(port),
                     "-k", str(sockdir), "-c", "fsync=off", "-c", "synchronous_commit=off",
                     "-c", "full_page_writes=off", "-c", "max_connections=200"],
                    cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True, **_as_user(user))
            server = PostgresServer(HOST, port, PG_SUPERUSER, password, datadir, log,
                                    user.pw_name if user else pwd.getpwuid(os.geteuid()).pw_name)
            deadline = time.monotonic() + 60
            while True:
                try:
                    server.connect().close()
                    break
                except Exception:  # psycopg.OperationalError until it accepts connections
                    if proc.poll() is not None or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
            if proc.poll() is None and time.monotonic() <= deadline:
                break
            _stop_postgres(proc)
            if attempt == 3 or "could not bind" not in log_tail(log):
                raise RuntimeError(f"PostgreSQL did not start (exit {proc.returncode}); {log}:\n{log_tail(log)}")
        yield server
    finally:
        if proc is not None:
            _stop_postgres(proc)
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class TeamServer:
    """A team's tracking server: ``mlflow server`` on a PostgreSQL database, artifacts proxied into a bucket."""

    tracking_uri: str
    backend_store_uri: str
    bucket: str
    s3: S3Server
    postgres: PostgresServer
    log: Path


@pytest.fixture(scope="session")
def team_server(postgres: PostgresServer, moto_s3: S3Server,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[TeamServer]:
    """``mlflow server --backend-store-uri postgresql://... --artifacts-destination s3://...`` on loopback.

    A fresh database ``mlflow`` on the ``postgres`` fixture, the bucket ``atscale-team`` on moto, 2 workers (the
    8-concurrent-runs test talks to it at once). Startup, mostly the schema migration on PostgreSQL, measured at
    15-80 s on the 2-core dev box (80 s under load); 300 s allows for a heavily loaded one.
    """
    backend = postgres.create_database("mlflow")
    bucket = moto_s3.make_bucket("atscale-team")
    workdir = tmp_path_factory.mktemp("team-server")
    proc, url = start_mlflow_server(moto_s3, bucket, workdir, backend_store_uri=backend, workers=2, timeout=300)
    try:
        yield TeamServer(url, backend, bucket, moto_s3, postgres, workdir / "mlflow-server.log")
    finally:
        stop_process(proc)
