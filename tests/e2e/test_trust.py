"""What atscale trusts, on the real CLI: a run's record never executes, names stay inside the runs root,
a checkpoint never takes over another run's MLflow record, and no secret is printed or stored.

Each test is the attack (or the careless mistake) as a person would make it: a real MLflow sqlite store,
real artifacts, ``python -m recipes.*`` subprocesses where the process itself matters (exit codes, signals,
what it prints), the tool's ``main`` in this process where it does not. Payload tests assert that the
marker file the payload would create does not exist, not only the exit code.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import CONFIGS, cli_env, client_for, seed_mlflow_db

DIGITS = str(CONFIGS / "digits.yaml")


def _tool(workdir: Path, module: str, *args: str, env: dict[str, str] | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` in ``workdir``, output captured."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=workdir, env=env or cli_env(workdir),
                          capture_output=True, text=True, timeout=timeout)


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
