"""recipes.run.tracking: secrets redacted, credentials as basic auth, a store made whole, runs found by location."""

from __future__ import annotations

import base64
import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest

from recipes.run import tracking

REPO = Path(__file__).resolve().parents[4]


@pytest.mark.parametrize(("text", "expected"), [
    ("http://user:pw@host:8/x", "http://user:***@host:8/x"),
    ("--spot.metadata_url=https://a:b%40c@h/", "--spot.metadata_url=https://a:***@h/"),
    ("s3://bucket/runs", "s3://bucket/runs"),
    ("http://user@host/", "http://user@host/"),
    ("two http://a:1@x and ftp://b:2@y", "two http://a:***@x and ftp://b:***@y"),
])
def test_redact(text: str, expected: str) -> None:
    assert tracking.redact(text) == expected


def test_redact_value_walks_containers() -> None:
    assert tracking.redact_value({"a": ["http://u:p@h"], "b": 3}) == {"a": ["http://u:***@h"], "b": 3}


def test_tracking_uri_moves_credentials_to_mlflows_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://alice:p%40ss@mlflow.example:5000/prefix")
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    assert tracking.tracking_uri() == "https://mlflow.example:5000/prefix"
    assert (tracking.os.environ["MLFLOW_TRACKING_USERNAME"], tracking.os.environ["MLFLOW_TRACKING_PASSWORD"]) == \
        ("alice", "p@ss")
    assert tracking.os.environ["MLFLOW_TRACKING_URI"] == "https://mlflow.example:5000/prefix"


def test_tracking_uri_default_and_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking.tracking_uri() == "sqlite:///mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////tmp/x.db")
    assert tracking.tracking_uri() == "sqlite:////tmp/x.db"


@pytest.fixture
def basic_auth_health() -> Iterator[str]:
    """A loopback server whose /health answers 200 only to alice:secret (401 otherwise)."""
    expected = "Basic " + base64.b64encode(b"alice:secret").decode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path == "/health" and self.headers.get("Authorization") == expected
            self.send_response(200 if ok else 401)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_check_server_sends_basic_auth(basic_auth_health: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "secret")
    tracking.check_server(basic_auth_health)  # no error
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "wrong")
    with pytest.raises(tracking.TrackingError) as refused:
        tracking.check_server(basic_auth_health)
    assert str(refused.value) == (f"MLflow tracking server {basic_auth_health} refused the credentials (HTTP 401); "
                                  "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD.")
    assert "wrong" not in str(refused.value)


def test_uri_with_password_works_end_to_end_against_basic_auth(basic_auth_health: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    host = basic_auth_health.removeprefix("http://")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:secret@{host}")
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    tracking.check_server(tracking.tracking_uri())


def test_sqlite_path() -> None:
    assert tracking.sqlite_path("sqlite:///mlflow.db") == Path("mlflow.db")
    assert tracking.sqlite_path("sqlite:////abs/m.db") == Path("/abs/m.db")
    assert tracking.sqlite_path("sqlite://") is None
    assert tracking.sqlite_path("http://h") is None


@pytest.mark.e2e
def test_ensure_store_creates_a_complete_store_once(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'sub' / 'm.db'}"
    assert tracking.ensure_store(uri) is True
    assert tracking.ensure_store(uri) is False
    assert [e.name for e in mlflow.MlflowClient(uri).search_experiments()] == ["Default"]
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["m.db"]


@pytest.mark.e2e
def test_ensure_store_removes_the_debris_of_a_dead_creator(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    debris = tmp_path / f".m.db.creating-{tracking.socket.gethostname()}-{int(dead.stdout)}-abcdef"
    debris.write_bytes(b"half a migration")
    alive = tmp_path / f".m.db.creating-{tracking.socket.gethostname()}-{tracking.os.getpid()}-fedcba"
    alive.write_bytes(b"someone else's, in progress")
    tracking.ensure_store(f"sqlite:///{tmp_path / 'm.db'}")
    assert not debris.exists() and alive.exists()


@pytest.mark.e2e
def test_concurrent_creators_agree_on_one_store(tmp_path: Path) -> None:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from recipes.run import tracking; "
            "print(tracking.ensure_store(sys.argv[2]))")
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(REPO), uri], stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    outputs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outputs.count("True") == 1 and outputs.count("False") == 3
    assert [e.name for e in mlflow.MlflowClient(uri).search_experiments()] == ["Default"]


@pytest.mark.e2e
def test_find_run_by_location(tmp_path: Path) -> None:
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    exp = client.create_experiment("e")
    assert tracking.find_run(client, "nope", "/a") is None
    older = client.create_run(exp, run_name="r", tags={tracking.RUN_DIR_TAG: "/runs/e/r"}).info.run_id
    client.create_run(exp, run_name="r", tags={tracking.RUN_DIR_TAG: "/other/e/r"})
    assert tracking.find_run(client, "e", "/runs/e/r") == older
    newer = client.create_run(exp, run_name="r", tags={tracking.RUN_DIR_TAG: "/runs/e/r"},
                              start_time=10**13).info.run_id
    assert tracking.find_run(client, "e", "/runs/e/r") == newer
    assert tracking.find_run(client, "e", "it's/quoted") is None
    quoted = client.create_run(exp, run_name="q", tags={tracking.RUN_DIR_TAG: "/home/o'brien/e/q"}).info.run_id
    assert tracking.find_run(client, "e", "/home/o'brien/e/q") == quoted  # MLflow reads no \' in a filter


def test_an_experiment_another_launch_creates_at_the_same_moment_is_taken_not_an_error(tmp_path: Path) -> None:
    from recipes.run.tracking import ensure_experiment

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    winner = mlflow.MlflowClient(uri)

    class _LateClient(mlflow.MlflowClient):
        """Looks before the other launch creates the experiment, creates after it did: the race, made exact."""

        looked = False

        def get_experiment_by_name(self, name: str):  # type: ignore[no-untyped-def]
            if not self.looked:
                self.looked = True
                self.created_by_other = winner.create_experiment(name)
                return None
            return super().get_experiment_by_name(name)

    late = _LateClient(uri)
    assert ensure_experiment(late, "digits") == late.created_by_other
    assert ensure_experiment(winner, "digits") == late.created_by_other  # found: nothing created
    assert [e.name for e in winner.search_experiments()] == ["digits", "Default"]


def test_a_new_experiments_artifacts_live_beside_its_sqlite_store_not_in_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's default is ``./mlruns`` of whatever folder a launch started from: one store's artifacts ended up
    spread over every folder a run was launched from (and a benchmark's in the repository, 2.4 GB)."""
    elsewhere = tmp_path / "launched-from"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    (tmp_path / "store").mkdir()
    client = mlflow.MlflowClient(uri)
    experiment_id = tracking.ensure_experiment(client, "digits")
    assert client.get_experiment(experiment_id).artifact_location == (tmp_path / "store" / "mlruns" / "digits").as_uri()
    run_id = client.create_run(experiment_id).info.run_id
    client.log_text(run_id, "x", "a.txt")
    assert (tmp_path / "store" / "mlruns" / "digits" / run_id / "artifacts" / "a.txt").read_text() == "x"
    assert not (elsewhere / "mlruns").exists()
    # the default store, mlflow.db in the working directory: beside it is where MLflow put them already
    local = mlflow.MlflowClient("sqlite:///mlflow.db")
    local_id = tracking.ensure_experiment(local, "digits")
    assert local.get_experiment(local_id).artifact_location == (elsewhere / "mlruns" / "digits").as_uri()


def test_artifact_location_of_each_kind_of_store() -> None:
    assert tracking.artifact_location("sqlite:////abs/m.db", "digits") == "file:///abs/mlruns/digits"
    assert tracking.artifact_location("sqlite:////abs/m.db", "team/run 1") == "file:///abs/mlruns/team%252Frun%25201"
    for uri in ("http://h:5000", "postgresql://u@h/db", "sqlite://", "sqlite:///:memory:"):
        assert tracking.artifact_location(uri, "digits") is None, uri  # the store's own default
