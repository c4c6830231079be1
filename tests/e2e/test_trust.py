"""What atscale trusts, on the real CLI: a run's record never executes, names stay inside the runs root,
a checkpoint never takes over another run's MLflow record, and no secret is printed or stored.

Each test is the attack (or the careless mistake) as a person would make it: a real MLflow sqlite store,
real artifacts, ``python -m recipes.*`` subprocesses where the process itself matters (exit codes, signals,
what it prints), the tool's ``main`` in this process where it does not. Payload tests assert that the
marker file the payload would create does not exist, not only the exit code.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from callbacks.storage import ckpt_store
from tests.conftest import CONFIGS, FAST, cli_env, client_for, run_fit, run_module, runs_of, seed_mlflow_db, start_fit

DIGITS = str(CONFIGS / "digits.yaml")


def _tool(workdir: Path, module: str, *args: str, env: dict[str, str] | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` in ``workdir``, output captured."""
    return run_module(module, *args, cwd=workdir, env=env, timeout=timeout)


# ------------------------------------------------------------------------------- 1. records never run


def _record(workdir: Path, config_text: str) -> str:
    """A FINISHED MLflow run whose ``config.yaml`` artifact is ``config_text`` (as a teammate could upload it)."""
    seed_mlflow_db(workdir)
    client = client_for(workdir)
    run = client.create_run(client.create_experiment("shared"), run_name="victim")
    files = workdir / "record"
    files.mkdir(exist_ok=True)
    (files / "config.yaml").write_text(config_text)
    (files / "manifest.json").write_text(json.dumps({"world_size": 1, "data_fingerprint": None}))
    client.log_artifact(run.info.run_id, str(files / "config.yaml"))
    client.log_artifact(run.info.run_id, str(files / "manifest.json"))
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def _digits_record(**changes: object) -> str:
    config = yaml.safe_load(Path(DIGITS).read_text())
    config.update({"experiment": "shared", "run_name": "victim"})
    config.update(changes)
    return yaml.safe_dump(config)


def test_reproduce_dry_run_never_runs_a_popen_in_the_record(tmp_path: Path) -> None:
    run_id = _record(tmp_path, _digits_record(
        data={"class_path": "subprocess.Popen", "init_args": {"args": ["touch", "pwned"]}}))
    result = _tool(tmp_path, "recipes.reproduce", run_id, "--dry_run")
    time.sleep(0.5)  # a Popen would have had the time to run touch
    assert not (tmp_path / "pwned").exists()
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()[-1:]
    assert "Traceback" not in result.stderr
    assert line.startswith(f"error: run {run_id}'s config.yaml names code from outside the project "
                           "(data.class_path: 'subprocess.Popen')")
    assert "Nothing was imported or run." in line


@pytest.mark.parametrize("changes, named", [
    # a trusted-looking place, an untrusted class
    ({"trainer": {"callbacks": [{"class_path": "os.system", "init_args": {"command": "touch pwned"}}]}},
     "trainer.callbacks[0].class_path: 'os.system'"),
    # a trusted package's class that calls whatever it is given
    ({"trainer": {"callbacks": [{"class_path": "lightning.pytorch.callbacks.LambdaCallback",
                                 "init_args": {"on_fit_start": "os.abort"}}]}},
     "'lightning.pytorch.callbacks.LambdaCallback'"),
    # a callable given as a string where a signature takes one
    ({"trainer": {"strategy": {"class_path": "lightning.pytorch.strategies.DDPStrategy",
                               "init_args": {"ddp_comm_hook": "subprocess.getoutput"}}}},
     "trainer.strategy.init_args.ddp_comm_hook: 'subprocess.getoutput'"),
])
def test_reproduce_refuses_every_untrusted_name_before_importing_it(tracked: Path, capsys: pytest.CaptureFixture,
                                                                    changes: dict, named: str) -> None:
    from recipes.reproduce import main

    run_id = _record(tracked, _digits_record(**changes))
    assert main([run_id, "--dry_run"]) == 2
    assert not (tracked / "pwned").exists()
    err = capsys.readouterr().err
    assert named in err and "Nothing was imported or run." in err
    assert len(err.strip().splitlines()) == 1


def test_reproduce_refuses_a_project_class_in_the_wrong_place(tracked: Path, capsys: pytest.CaptureFixture) -> None:
    """A trusted package's class where its type does not fit (a model as the datamodule): the fit parser says no."""
    from recipes.reproduce import main

    run_id = _record(tracked, _digits_record(data={"class_path": "recipes.classifier.ImageClassifier"}))
    assert main([run_id, "--dry_run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"error: run {run_id}: the record's config.yaml does not parse as a recipes.fit config: ")
    assert "data" in err and err.endswith("Nothing was run.")


def test_reproduce_refuses_a_python_yaml_tag_in_one_line(tracked: Path, capsys: pytest.CaptureFixture) -> None:
    from recipes.reproduce import main

    text = _digits_record() + "payload: !!python/object/apply:os.system [touch pwned]\n"
    run_id = _record(tracked, text)
    assert main([run_id, "--dry_run"]) == 2
    assert not (tracked / "pwned").exists()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"error: run {run_id}'s record is not plain YAML/JSON (ConstructorError: ")
    assert err.endswith("nothing of it was run.")


def test_reproduce_dry_run_accepts_the_projects_own_config(tracked: Path, capsys: pytest.CaptureFixture) -> None:
    from recipes.reproduce import main

    run_id = _record(tracked, _digits_record())
    assert main([run_id, "--dry_run", "--run_name", "again"]) == 0
    out = capsys.readouterr()
    assert f"Rerunning run {run_id} (victim) as 'again'" in out.out
    assert "data fingerprint: not computed here" not in out.err  # the project's datamodule is built, as before


# ------------------------------------------------------------- in-process launches of recipes.fit


@pytest.fixture
def fit_here(tracked: Path, monkeypatch: pytest.MonkeyPatch):
    """``recipes.run.cli.run_cli`` in this process, as ``python -m recipes.fit`` would run it in ``tracked``.

    The CLI sets environment variables for the ranks it would start and takes SIGINT/SIGTERM: both are
    put back after the test.
    """
    from recipes.run.cli import run_cli
    from recipes.run.lock import RunLock

    saved_env = dict(os.environ)
    saved_handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    locks: list[RunLock] = []
    acquire = RunLock.acquire

    def acquire_and_remember(lock: RunLock) -> None:
        acquire(lock)
        locks.append(lock)

    monkeypatch.setattr(RunLock, "acquire", acquire_and_remember)

    def fit(*args: str) -> int:
        code = run_cli(["--config", DIGITS, *FAST, "--log_model", "false", *args])
        for lock in locks:  # released as at the process's end
            lock.release()
        return code

    yield fit
    os.environ.clear()
    os.environ.update(saved_env)
    for signum, handler in saved_handlers.items():
        signal.signal(signum, handler)


def _tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


# --------------------------------------------------------------- 2. names stay inside the runs root


@pytest.mark.parametrize("flag, value", [
    ("--run_name", "../.."),  # wrote .lock, config.yaml, manifest.json, checkpoints/ into the working directory
    ("--run_name", "."),  # made the experiment's folder a run directory
    ("--run_name", "a/../../b"),
    ("--run_name", ""),
    ("--experiment", "../../x"),  # wrote outside the runs root
    ("--experiment", ""),  # a traceback
])
def test_a_name_that_leaves_the_runs_root_exits_2_naming_it(fit_here, tracked: Path, capsys: pytest.CaptureFixture,
                                                           flag: str, value: str) -> None:
    before = _tree(tracked.parent)
    assert fit_here(flag, value, "--trainer.max_steps", "1") == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {flag} {value!r} is not a valid name: expected one name of 1-128 letters, digits and "
                   ". _ - + = @, starting with a letter or digit (no '/', no '..': it names a directory inside the "
                   "runs root).")
    assert _tree(tracked.parent) == before  # nothing written, in the runs root or beside it
    assert runs_of(tracked, "digits") == []


def test_the_root_as_a_run_name_is_refused_before_anything_is_written() -> None:
    """``--run_name /`` wrote into the filesystem root as root: checked without launching (a regression would
    write there again)."""
    from recipes.run.common import UsageError
    from recipes.run.context import check_name

    for bad in ("/", "/etc", "..", "a\\..\\b", "x\0y", "a" * 129, " lead", "-flag"):
        with pytest.raises(UsageError, match=r"is not a valid name: expected one name of 1-128"):
            check_name("--run_name", bad)
    for good in ("cc", "exp-42", "20261203-135519-ab12", "slurm-12-3", "orig-repro-20261203-1400", "lr=3e-4", "a.b"):
        assert check_name("--run_name", good) == good


# ----------------------------------------- 3. a checkpoint never takes over another run's MLflow record


def test_ckpt_path_of_another_run_starts_this_runs_own_record(fit_here, tracked: Path, capsys: pytest.CaptureFixture,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    assert fit_here("--run_name", "cc", "--trainer.max_steps", "11") == 0
    client = client_for(tracked)
    (cc,) = runs_of(tracked, "digits")
    client.set_terminated(cc.info.run_id, "KILLED")  # as a run stopped at step 11 of 90 is
    cc = client.get_run(cc.info.run_id)
    ckpt = tracked / "runs/digits/cc/checkpoints/step=00000011.ckpt"
    assert ckpt.exists()
    capsys.readouterr()

    assert fit_here("--run_name", "other", "--ckpt_path", str(ckpt), "--trainer.max_steps", "13") == 0
    runs = {r.info.run_name: r for r in runs_of(tracked, "digits")}
    assert set(runs) == {"cc", "other"}
    after = runs["cc"]
    assert (after.info.status, after.info.end_time) == ("KILLED", cc.info.end_time)  # cc's record untouched
    assert after.data.metrics == cc.data.metrics
    other = runs["other"]
    assert other.info.status == "FINISHED"
    assert other.data.tags["atscale.run_dir"] == str((tracked / "runs/digits/other").resolve())
    assert client.get_metric_history(cc.info.run_id, "epoch")[-1].step < 11
    # other's own checkpoints name other's record, never cc's
    assert ckpt_store.newest_good(tracked / "runs/digits/other/checkpoints").extra["mlflow_run_id"] == \
        other.info.run_id
    assert f"was written by another run's MLflow record ({cc.info.run_id}): digits/other continues from it as a " \
           "new MLflow run in sqlite:///" in caplog.text

    # relaunching cc continues cc (it ran 11 of its steps), it is not "already complete"
    assert fit_here("--run_name", "cc", "--trainer.max_steps", "12") == 0
    out = capsys.readouterr()
    assert "already complete" not in out.out
    assert client.get_run(cc.info.run_id).info.status == "FINISHED"
    assert len(runs_of(tracked, "digits")) == 2


def test_a_moved_run_directory_still_continues_its_own_record(fit_here, tracked: Path) -> None:
    """Same experiment and run name, the folder moved: still the run it is launched as (kept from before)."""
    assert fit_here("--run_name", "mv", "--trainer.max_steps", "3") == 0
    (tracked / "runs").rename(tracked / "moved")
    assert fit_here("--run_name", "mv", "--runs_root", "moved", "--trainer.max_steps", "4") == 0
    (run,) = runs_of(tracked, "digits")
    assert run.info.status == "FINISHED"
    record = ckpt_store.newest_good(tracked / "moved/digits/mv/checkpoints")
    assert (record.global_step, record.extra["mlflow_run_id"]) == (4, run.info.run_id)


# ------------------------------------------------------------ 5. resume against a store without the run


def test_resume_against_a_store_without_the_run_says_so_in_one_line(fit_here, tracked: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture) -> None:
    assert fit_here("--run_name", "r", "--trainer.max_steps", "3") == 0
    (first,) = runs_of(tracked, "digits")
    other_store = tracked / "other"
    other_store.mkdir()
    seed_mlflow_db(other_store)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{other_store / 'mlflow.db'}")
    capsys.readouterr()

    assert fit_here("--run_name", "r", "--trainer.max_steps", "4") == 2
    err = capsys.readouterr().err.strip()
    ckpt = "runs/digits/r/checkpoints/step=00000003.ckpt"
    assert err.splitlines()[-1] == (
        f"error: run digits/r would resume from {ckpt}, written by MLflow run {first.info.run_id}, which "
        f"sqlite:///{other_store / 'mlflow.db'} does not hold (was it launched against another tracking store?). "
        f"Set MLFLOW_TRACKING_URI to the store that holds it; or pass --ckpt_path {ckpt} to continue training from "
        "it as a new MLflow run in this store; or --fresh true to start over.")
    assert runs_of(other_store, "digits") == []

    # the way out it names: the checkpoint continues as this store's new record of the run
    assert fit_here("--run_name", "r", "--ckpt_path", ckpt, "--trainer.max_steps", "4") == 0
    (moved,) = runs_of(other_store, "digits")
    assert moved.info.status == "FINISHED" and moved.info.run_name == "r"
    assert moved.data.tags["atscale.run_dir"] == str((tracked / "runs/digits/r").resolve())
    record = ckpt_store.newest_good(tracked / "runs/digits/r/checkpoints")
    assert (record.global_step, record.extra["mlflow_run_id"]) == (4, moved.info.run_id)
    assert client_for(tracked).get_run(first.info.run_id).info.status == "FINISHED"


# ------------------------------------------------------------------------ 4. no secret printed or stored


class _MetadataServer:
    """GCP's ``instance/preempted`` on 127.0.0.1, answering ``FALSE`` to requests with basic auth bob:PASSWORD."""

    def __init__(self) -> None:
        import base64
        import http.server
        import threading

        self.authorized = 0
        self.refused = 0
        want = "Basic " + base64.b64encode(b"bob:PASSWORD").decode()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                ok = self.headers.get("Authorization") == want and self.path.endswith("/instance/preempted")
                if ok:
                    outer.authorized += 1
                else:
                    outer.refused += 1
                self.send_response(200 if ok else 401)
                self.end_headers()
                self.wfile.write(b"FALSE" if ok else b"")

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_metadata_url_credentials_are_sent_as_basic_auth_and_never_printed() -> None:
    from callbacks.utils.notices import NoticePoller, check_gcp

    server = _MetadataServer()
    try:
        url = f"http://bob:PASSWORD@127.0.0.1:{server.port}"
        assert check_gcp(url, timeout=5) is None  # the URL resolves, with its credentials as basic auth
        seen: list = []
        poller = NoticePoller("gcp", seen.append, base_url=url, interval_s=0.05)
        poller.start()
        time.sleep(0.5)
        poller.stop()
        assert (server.refused, poller.failures, seen) == (0, 0, [])
        assert server.authorized >= 2
    finally:
        server.close()


def test_spot_metadata_url_password_is_never_printed_or_stored(fit_here, tracked: Path, capsys: pytest.CaptureFixture,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    from tests.servers import free_port

    url = f"http://bob:PASSWORD@127.0.0.1:{free_port()}"  # nothing listens: the warning is printed
    assert fit_here("--run_name", "spotty", "--trainer.max_steps", "3", "--spot.provider", "gcp",
                    "--spot.metadata_url", url, "--spot.metadata_timeout_s", "0.2") == 0
    out = capsys.readouterr()
    assert "gcp interruption notices unavailable at http://***@127.0.0.1:" in caplog.text
    (run,) = runs_of(tracked, "digits")
    stored = [*run.data.params.values(), *run.data.tags.values(),
              (tracked / "runs/digits/spotty/config.yaml").read_text()]
    assert run.data.params["spot.metadata_url"] == url.replace("PASSWORD", "***")
    for text in (out.out, out.err, caplog.text, *stored):
        assert "PASSWORD" not in text


def test_runs_root_with_credentials_exits_2_and_creates_nothing(fit_here, tracked: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    before = _tree(tracked)
    root = f"file://u:PASSWORD@localhost{tracked}/runs"
    assert fit_here("--runs_root", root, "--trainer.max_steps", "1") == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --runs_root file://***@localhost{tracked}/runs: credentials in a storage URL would be "
                   "stored with the run and printed; give them through the store's own configuration (e.g. "
                   "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS), not in the URL.")
    assert _tree(tracked) == before
    assert runs_of(tracked, "digits") == []


def test_unreachable_database_store_exits_2_in_one_line_with_its_password_masked(
        fit_here, tracked: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from tests.servers import free_port

    port = free_port()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"postgresql://user:S3CRETpw@127.0.0.1:{port}/mlflow")
    assert fit_here("--run_name", "db", "--trainer.max_steps", "1") == 2
    out = capsys.readouterr()
    (line,) = out.err.strip().splitlines()
    assert line.startswith(f"error: MLflow tracking store postgresql://user:***@127.0.0.1:{port}/mlflow cannot be "
                           "used (")
    assert line.endswith("start the database or fix MLFLOW_TRACKING_URI.")
    assert "S3CRETpw" not in out.out + out.err
    assert not (tracked / "runs/digits/db").exists()


# ------------------------------------------------------------------------------ 7. smaller: two Ctrl-C


@pytest.mark.parametrize("after_setup_s", [0.0, 1.5])  # during the sanity check; in training
def test_two_ctrl_c_presses_exit_130_with_the_message_once(tmp_path: Path, after_setup_s: float) -> None:
    name = f"twice-{int(after_setup_s * 10)}"
    proc = start_fit(tmp_path, "--config", DIGITS, *FAST, "--log_model", "false", "--run_name", name,
                     "--trainer.max_steps", "100000", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        config = tmp_path / "runs/digits" / name / "config.yaml"  # written at setup
        deadline = time.monotonic() + 180
        while not config.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(after_setup_s)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.15)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert err.count("interrupted (SIGINT): the run stopped; relaunch the same command to resume it.") == 1
    assert "Traceback" not in err
    (run,) = runs_of(tmp_path, "digits")
    assert run.info.status == "KILLED"


def test_a_second_ctrl_c_swallowed_by_a_wrap_up_writers_library_still_exits_130(tmp_path: Path) -> None:
    """The fresh-clone CI's failure on d64cac4, made deterministic: the second press raised into matplotlib while
    the goodput plot was written; matplotlib's cleanup replaced the stop with a ValueError, the writer logged a
    failed plot, and the run ended as the first press's stop (exit 75)."""
    fault = json.dumps({"class_path": "tests.faults.SecondPressSwallowed", "init_args": {"step": 2}})
    result = run_fit(tmp_path, "--config", DIGITS, *FAST, "--run_name", "swallowed", "--trainer.max_steps", "1000",
                     "--log_model", "false", f"--trainer.callbacks+={fault}", timeout=300)
    assert result.returncode == 130, result.stderr[-3000:]
    assert result.stderr.count("interrupted (SIGINT): the run stopped; relaunch the same command to resume it.") == 1
    assert "Traceback" not in result.stderr
    (run,) = runs_of(tmp_path, "digits")
    assert run.info.status == "KILLED"


# ------------------------------------------------ a stop signal while a finished run wraps up


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_a_signal_while_a_finished_run_wraps_up_leaves_it_finished(tmp_path: Path, signal_name: str) -> None:
    """Training is over; the signal comes as MLflow's logger finalizes (after every callback gave signals back).

    It once raised into MLflow's shutdown of its metric queue: the finished run ended KILLED or FAILED, exited 75
    ("relaunch to resume" a run with nothing left to do), and could hang at exit. Now the wrap-up completes.
    """
    fault = json.dumps({"class_path": "tests.faults.SignalDuringWrapUp", "init_args": {"signal_name": signal_name}})
    result = run_fit(tmp_path, "--config", DIGITS, *FAST, "--run_name", "w", "--trainer.max_epochs", "1",
                     "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2",
                     "--log_model", "false", f"--trainer.callbacks+={fault}", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count(f"{signal_name} while the run was wrapping up: its training is over; finishing its "
                               "record, then exiting.") == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "interrupted (" not in result.stderr
    (run,) = runs_of(tmp_path, "digits")
    assert run.info.status == "FINISHED"
    # what the wrap-up logs is all there: the end-of-fit means, the bill, the baselines
    assert {"val/acc", "time/mean/step_s", "cost/usd", "baseline/linear_acc"} <= set(run.data.metrics)


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_a_signal_as_a_finished_run_exits_keeps_exit_code_0(tmp_path: Path, signal_name: str) -> None:
    """The run is recorded and the process is ending (an ``atexit`` handler sends the signal): exit 0, quietly.

    The CLI's handler stayed installed past the end: the signal raised inside the exit handlers (a traceback) or,
    once the interpreter had put the default action back, killed the process (-15 after a complete run).
    """
    fault = json.dumps({"class_path": "tests.faults.SignalDuringWrapUp",
                        "init_args": {"signal_name": signal_name, "moment": "exit"}})
    result = run_fit(tmp_path, "--config", DIGITS, *FAST, "--run_name", "x", "--trainer.max_steps", "2",
                     "--trainer.limit_val_batches", "0", "--log_model", "false", f"--trainer.callbacks+={fault}",
                     timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr[-3000:]
    (run,) = runs_of(tmp_path, "digits")
    assert run.info.status == "FINISHED"
    assert "atscale run — finished" in result.stdout


# ------------------------------------------------ 7. smaller: a SIGKILL while the model is being logged


def test_a_model_half_logged_by_a_killed_launch_is_marked_failed_by_the_relaunch(tmp_path: Path) -> None:
    from mlflow.entities import LoggedModelStatus

    # SIGKILL while MLflow writes the model: once it is made (PENDING), as its files start to upload
    args = ("--config", DIGITS, *FAST, "--run_name", "m", "--trainer.max_steps", "3",
            "--trainer.callbacks+=tests.faults.KillWhileLoggingModel", f"--trainer.callbacks.marker={tmp_path / 'k'}")
    env = cli_env(tmp_path)
    client = client_for(tmp_path)
    killed = run_fit(tmp_path, *args, env=env)
    assert killed.returncode == -signal.SIGKILL and (tmp_path / "k").exists(), killed.stderr[-3000:]
    experiment = client.get_experiment_by_name("digits")
    pending = [m for m in client.search_logged_models([experiment.experiment_id])
               if m.status == LoggedModelStatus.PENDING]
    assert len(pending) == 1, "the launch ended before its model was seen PENDING"
    (run,) = runs_of(tmp_path, "digits")
    assert pending[0].source_run_id == run.info.run_id

    relaunch = run_fit(tmp_path, *args, env=env)
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    models = {m.model_id: m.status for m in client.search_logged_models([run.info.experiment_id])}
    assert models.pop(pending[0].model_id) == LoggedModelStatus.FAILED
    assert list(models.values()) == [LoggedModelStatus.READY]
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    assert f"Model {pending[0].model_id} of MLflow run {run.info.run_id} was left half-logged" in relaunch.stderr
