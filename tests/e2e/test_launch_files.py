"""The launch files in configs/launch/: each one parses with its tool's own loader, and its launch semantics,
imitated on the real CLI, end in final weights bitwise equal to an uninterrupted run.

- SkyPilot (``skypilot.yaml``): loaded by ``sky.Task.from_yaml`` (SkyPilot conflicts with this project's pins
  of click and uvicorn, so it lives in its own virtualenv: ``ATSCALE_SKYPILOT_PYTHON``, else
  ``.venv-skypilot/bin/python``, which ``.ci/run`` makes). Imitated: the task's ``run`` script under bash with
  its ``envs``; the spot VM is reclaimed (SIGTERM to every process, the grace period, SIGKILL); the managed-job
  controller's decision; the same script on a brand-new machine.
- Kubernetes (``kubernetes-job.yaml``): every document deserialized into the Kubernetes Python client's models
  (``V1Secret``, ``V1Job``) and serialized back unchanged (the client drops fields it does not know: a typo
  would not survive the round trip). Imitated: the container's command with its Secret-backed environment in a
  fresh pod folder; the kubelet's SIGTERM, ``terminationGracePeriodSeconds``, SIGKILL; the Job controller's
  ``podFailurePolicy`` decision; a replacement pod in a fresh folder.
- SLURM (``slurm.sbatch``): the ``#SBATCH`` lines parsed and checked (sbatch itself needs a cluster).
  Imitated: the batch script under bash with a job's SLURM environment (1 node, 2 tasks), an ``srun`` that
  starts one process per task with its SLURM_PROCID/LOCALID/NODEID (and kills the step when a task fails, as
  ``--kill-on-bad-exit`` does), an ``scontrol`` that records the requeue; SIGUSR1 to every task, the 90 s lead
  time, SIGKILL; the same script again as the requeued job.

Machines are fresh folders holding a link to this repository's configs (an image or a checkout).
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from callbacks.spot import REQUEUE_EXIT_CODE
from tests.conftest import (
    FAST,
    REPO,
    assert_bitwise_equal,
    client_for,
    final_weights,
    free_port,
    remote_final_weights,
    run_fit,
    runs_of,
    seed_mlflow_db,
)
from tests.servers import S3Server, moto_s3, s3fs_fresh  # noqa: F401 - fixtures

LAUNCH = REPO / "configs" / "launch"
SKYPILOT, KUBERNETES, SLURM = LAUNCH / "skypilot.yaml", LAUNCH / "kubernetes-job.yaml", LAUNCH / "slurm.sbatch"
#: The tests' recipe: the launch files' own, shortened to 2 epochs (45 steps each) and quiet.
TINY = ("--trainer.max_epochs", "2", "--trainer.log_every_n_steps", "1", *FAST)
EXAMPLE_RUNS_ROOT = "s3://my-bucket/runs"


# ------------------------------------------------------------------------------------------------ helpers
def machine(path: Path) -> Path:
    """A fresh machine's working copy: an empty folder with the repository's configs in it."""
    path.mkdir(parents=True)
    (path / "configs").symlink_to(REPO / "configs", target_is_directory=True)
    return path


def base_env(tracking_uri: str, **extra: str) -> dict[str, str]:
    """This process's environment minus scheduler/tracking/AWS variables, the repo importable, plus ``extra``."""
    drop = ("ATSCALE_", "SLURM_", "MLFLOW_", "AWS_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update({"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                "MLFLOW_TRACKING_URI": tracking_uri,
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"})
    env.update(extra)
    return env


def exit_code(returncode: int) -> int:
    """A container's/shell's exit code: 128 + N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def wait_for_checkpoint(folder: Path, proc: subprocess.Popen, timeout: float = 600) -> None:
    """Until a periodic checkpoint has been written under ``folder`` (training is under way)."""
    deadline = time.monotonic() + timeout
    while not list(folder.glob("**/checkpoints/step=*.meta.json")):
        assert proc.poll() is None, f"exited with {proc.returncode} before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.05)


def terminate(proc: subprocess.Popen, grace: float, sig: int = signal.SIGTERM, group: bool = False,
              pids: list[int] | None = None) -> tuple[int, float]:
    """Send ``sig`` (to ``pids``, the process group, or the process), wait ``grace`` s, then SIGKILL the group.

    Returns the exit code and the seconds from the signal to the exit.
    """
    start = time.monotonic()
    if pids:
        for pid in pids:
            os.kill(pid, sig)
    elif group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    return exit_code(proc.returncode), time.monotonic() - start


def bucket_final_weights(s3: S3Server, checkpoints_url: str, scratch: Path,
                         monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The newest checkpoint in the bucket, downloaded and verified with the bucket's credentials."""
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    return remote_final_weights(checkpoints_url, scratch)


def spot_metrics(tracking_uri: str, experiment: str, run_name: str) -> dict[str, list[float]]:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{run_name}'")
    assert len(runs) == 1, [r.info.run_name for r in runs]  # one MLflow run per run name, across launches
    assert runs[0].info.status == "FINISHED"
    return {key: [m.value for m in client.get_metric_history(runs[0].info.run_id, key)]
            for key in ("spot/interruptions", "spot/notice_to_saved_s", "spot/upload_s")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The launch files' recipe (digits, TINY), one process, never interrupted: its final weights."""
    workdir = machine(tmp_path_factory.mktemp("reference") / "m")
    seed_mlflow_db(workdir)
    result = run_fit(workdir, "--config", "configs/digits.yaml", *TINY, "--run_name", "ref", "--log_model", "false",
                     # this session's PATH: nothing here runs a shell script, and a launch forks from the zygote
                     env=base_env(f"sqlite:///{workdir / 'mlflow.db'}", PATH=os.environ.get("PATH", "")), timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return final_weights(workdir, "ref")


# ------------------------------------------------------------------------------------------------ SkyPilot
def skypilot_python() -> str | None:
    candidate = os.environ.get("ATSCALE_SKYPILOT_PYTHON") or str(REPO / ".venv-skypilot" / "bin" / "python")
    return candidate if Path(candidate).is_file() else None


_SKY_LOAD = textwrap.dedent("""
    import json, sys
    import sky
    task = sky.Task.from_yaml(sys.argv[1])
    (res,) = list(task.resources)
    print(json.dumps({"name": task.name, "run": task.run, "setup": task.setup, "envs": task.envs,
                      "workdir": task.workdir, "use_spot": res.use_spot, "accelerators": res.accelerators,
                      "job_recovery": res.job_recovery, "disk_size": res.disk_size, "version": sky.__version__}))
""")


@pytest.mark.e2e  # two ~5 s imports of SkyPilot in its own virtualenv
def test_skypilot_task_loads_with_skypilot(tmp_path: Path) -> None:
    python = skypilot_python()
    if python is None:
        if os.environ.get("CI"):
            pytest.fail("SkyPilot's virtualenv is missing (.ci/run makes .venv-skypilot): this must not skip in CI")
        pytest.skip("SkyPilot not installed: python3 -m venv .venv-skypilot && .venv-skypilot/bin/pip install "
                    "skypilot (or set ATSCALE_SKYPILOT_PYTHON)")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "LC_ALL": "C.UTF-8"}  # no ~/.sky of ours

    def load(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run([python, "-c", _SKY_LOAD, str(path)], env=env, capture_output=True, text=True,
                              timeout=300)

    result = load(SKYPILOT)
    assert result.returncode == 0, result.stderr[-3000:]
    task = json.loads(result.stdout.strip().splitlines()[-1])
    assert task["name"] == "atscale-digits"
    assert task["use_spot"] is True and task["accelerators"] == {"A100": 1}
    assert task["job_recovery"] == {"strategy": "EAGER_NEXT_REGION", "recover_on_exit_codes": [REQUEUE_EXIT_CODE],
                                    "max_restarts_on_errors": 0}
    assert task["envs"]["RUN_NAME"] == "digits-spot-001" and task["envs"]["RUNS_ROOT"].startswith("s3://")
    assert '--run_name "$RUN_NAME"' in task["run"] and '--runs_root "$RUNS_ROOT"' in task["run"]
    # the loader validates: a misspelt key is refused (so the file above passed a real schema check)
    bad = yaml.safe_load(SKYPILOT.read_text())
    bad["resources"]["use_spott"] = bad["resources"].pop("use_spot")
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    refused = load(tmp_path / "bad.yaml")
    assert refused.returncode != 0 and "use_spott" in refused.stderr, refused.stderr[-2000:]


def skypilot_controller(job_recovery: dict, preempted: bool, code: int, restarts_on_errors: int) -> str:
    """What SkyPilot's managed-job controller does after a launch (sky/jobs/controller.py, 0.14).

    A preempted cluster is always recovered; a job that failed on a live cluster is recovered when its exit
    code is in ``recover_on_exit_codes`` (not counted), or while ``max_restarts_on_errors`` allows (counted).
    """
    if preempted:
        return "recover"
    if code == 0:
        return "succeeded"
    if code in job_recovery.get("recover_on_exit_codes", []):
        return "recover"
    if restarts_on_errors < job_recovery.get("max_restarts_on_errors", 0):
        return "restart-on-error"
    return "failed"


def test_skypilot_controller_decisions_of_the_task() -> None:
    recovery = yaml.safe_load(SKYPILOT.read_text())["resources"]["job_recovery"]
    assert skypilot_controller(recovery, preempted=True, code=137, restarts_on_errors=0) == "recover"
    # a cloud notice answered while the VM still runs: saved, exit 75, relaunched without counting an error
    assert skypilot_controller(recovery, preempted=False, code=REQUEUE_EXIT_CODE, restarts_on_errors=0) == "recover"
    assert skypilot_controller(recovery, preempted=False, code=2, restarts_on_errors=0) == "failed"
    assert skypilot_controller(recovery, preempted=False, code=0, restarts_on_errors=0) == "succeeded"


@pytest.mark.e2e
@pytest.mark.slow(covered_by="tests/e2e/test_launch_files.py::test_kubernetes_job_imitated_resumes_exactly")
def test_skypilot_preemption_imitated_resumes_exactly(reference: dict, moto_s3: S3Server, s3fs_fresh: None,
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = yaml.safe_load(SKYPILOT.read_text())
    bucket = moto_s3.make_bucket("atscale-skypilot")
    runs_root = f"s3://{bucket}/runs"
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"  # stands in for the team's server: outlives the machines
    seed_mlflow_db(tmp_path)
    # sky jobs launch ... --env RUNS_ROOT=... --env MLFLOW_TRACKING_URI=... --env FIT_ARGS=...
    envs = {**task["envs"], "RUNS_ROOT": runs_root, "MLFLOW_TRACKING_URI": tracking, "FIT_ARGS": shlex.join(TINY)}
    run_name = envs["RUN_NAME"]
    grace = 30.0  # GCP's preemption notice, the shortest of the clouds': SIGTERM, then the VM is gone

    def launch(n: int) -> subprocess.Popen:
        home = tmp_path / f"home-{n}"
        (home / "atscale-venv" / "bin").mkdir(parents=True)  # what the task's setup made: the venv to activate
        (home / "atscale-venv" / "bin" / "activate").write_text(
            f'export PATH="{Path(sys.executable).parent}:$PATH"\n')
        workdir = machine(tmp_path / f"machine-{n}")  # the task's workdir, synced to the new VM
        env = base_env(tracking, HOME=str(home), **moto_s3.env, **envs)
        return subprocess.Popen(["bash", "-c", task["run"]], cwd=workdir, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)

    decisions = []
    first = launch(1)
    wait_for_checkpoint(tmp_path / "machine-1", first)
    time.sleep(random.Random(18).uniform(0.0, 0.5))  # somewhere in epoch 1
    code, took = terminate(first, grace, group=True)  # the VM shuts down: every process gets SIGTERM
    stderr = first.stderr.read()
    assert code == REQUEUE_EXIT_CODE and took < grace, stderr[-3000:]
    assert f"uploaded to {runs_root}/digits/{run_name}/checkpoints" in stderr
    decisions.append(skypilot_controller(task["resources"]["job_recovery"], True, code, 0))
    shutil.rmtree(tmp_path / "machine-1")  # the VM and its disk are gone

    second = launch(2)
    _, stderr = second.communicate(timeout=900)
    assert second.returncode == 0, stderr[-4000:]
    assert f"Resuming from {runs_root}/digits/{run_name}/checkpoints/step=" in stderr
    decisions.append(skypilot_controller(task["resources"]["job_recovery"], False, second.returncode, 0))
    assert decisions == ["recover", "succeeded"]

    assert_bitwise_equal(reference, bucket_final_weights(moto_s3, f"{runs_root}/digits/{run_name}/checkpoints",
                                                         tmp_path / "download", monkeypatch))
    metrics = spot_metrics(tracking, "digits", run_name)
    assert metrics["spot/interruptions"] == [1.0]


# ------------------------------------------------------------------------------------------------ Kubernetes
def kubernetes_documents() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(KUBERNETES.read_text()) if doc}


def test_kubernetes_job_deserializes_into_the_client_models() -> None:
    client = pytest.importorskip("kubernetes.client")
    api = client.ApiClient()
    docs = kubernetes_documents()
    assert sorted(docs) == ["Job", "Secret"]
    for kind, doc in docs.items():
        model = api.deserialize(json.dumps(doc), f"V1{kind}", "application/json")
        assert type(model).__name__ == f"V1{kind}"
        assert api.sanitize_for_serialization(model) == doc  # nothing unknown, nothing mistyped, nothing lost
    # the round trip catches a misspelt field (the client drops it)
    typo = copy.deepcopy(docs["Job"])
    typo["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 120
    model = api.deserialize(json.dumps(typo), "V1Job", "application/json")
    assert api.sanitize_for_serialization(model) != typo

    # the API server's rules the client models do not check (batch/v1 Job validation)
    job = docs["Job"]["spec"]
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    assert job["podReplacementPolicy"] == "Failed"  # the only value allowed with a podFailurePolicy
    container_names = {c["name"] for c in pod["containers"]}
    for rule in job["podFailurePolicy"]["rules"]:
        assert rule["action"] in {"Ignore", "FailJob", "Count", "FailIndex"}
        assert ("onExitCodes" in rule) != ("onPodConditions" in rule)
        if "onExitCodes" in rule:
            assert rule["onExitCodes"]["operator"] in {"In", "NotIn"}
            assert rule["onExitCodes"]["containerName"] in container_names
            assert 0 not in rule["onExitCodes"]["values"]
    # credentials only from the Secret, and every key it is asked for exists there
    secret_keys = set(docs["Secret"]["stringData"])
    (train,) = pod["containers"]
    refs = [e["valueFrom"]["secretKeyRef"] for e in train["env"] if "valueFrom" in e]
    assert {r["key"] for r in refs} == secret_keys and {r["name"] for r in refs} == {"atscale-credentials"}
    assert not [e for e in train["env"] if "value" in e]
    args = train["args"]
    assert args[args.index("--runs_root") + 1].startswith("s3://")
    assert args[args.index("--run_name") + 1] == "digits-k8s-001"
    # a replacement pod mounts a fresh emptyDir: staging never outlives the pod
    assert args[args.index("--staging_root") + 1] in {m["mountPath"] for m in train["volumeMounts"]}


def pod_failure_policy(job_spec: dict, container: str, code: int, conditions: tuple[str, ...] = ()) -> str:
    """The Job controller's action for a failed pod: the first matching rule's, else Count."""
    for rule in job_spec.get("podFailurePolicy", {}).get("rules", []):
        on_codes = rule.get("onExitCodes")
        if on_codes is not None:
            if on_codes.get("containerName", container) != container:
                continue
            inside = code in on_codes["values"]
            if inside == (on_codes["operator"] == "In"):
                return rule["action"]
        for pattern in rule.get("onPodConditions", []):
            if pattern["type"] in conditions:
                return rule["action"]
    return "Count"


def test_kubernetes_pod_failure_policy_decisions() -> None:
    job = kubernetes_documents()["Job"]["spec"]
    assert pod_failure_policy(job, "train", REQUEUE_EXIT_CODE) == "Ignore"
    assert pod_failure_policy(job, "train", 137, ("DisruptionTarget",)) == "Ignore"  # evicted, no time to save
    assert pod_failure_policy(job, "train", 2) == "FailJob"
    assert pod_failure_policy(job, "train", 1) == "Count"
    assert pod_failure_policy(job, "train", 137) == "Count"  # killed without a disruption: a failure


@pytest.mark.e2e
def test_kubernetes_job_imitated_resumes_exactly(reference: dict, moto_s3: S3Server, s3fs_fresh: None, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    docs = kubernetes_documents()
    job = docs["Job"]["spec"]
    pod = job["template"]["spec"]
    (container,) = pod["containers"]
    grace = float(pod["terminationGracePeriodSeconds"])
    bucket = moto_s3.make_bucket("atscale-k8s")
    runs_root = f"s3://{bucket}/runs"
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"  # stands in for the team's server
    seed_mlflow_db(tmp_path)
    # the Secret, as `kubectl create secret` would hold it for this cluster (moto's credentials)
    secret = {"AWS_ACCESS_KEY_ID": moto_s3.env["AWS_ACCESS_KEY_ID"],
              "AWS_SECRET_ACCESS_KEY": moto_s3.env["AWS_SECRET_ACCESS_KEY"], "MLFLOW_TRACKING_URI": tracking}
    assert set(secret) == set(docs["Secret"]["stringData"])
    run_name = container["args"][container["args"].index("--run_name") + 1]

    def start_pod(n: int) -> tuple[subprocess.Popen, Path]:
        pod_dir = machine(tmp_path / f"pod-{n}")
        mounts = {m["mountPath"]: str(pod_dir / m["name"]) for m in container["volumeMounts"]}
        args = [mounts.get(a, a) for a in container["args"]]
        args = [runs_root if a == EXAMPLE_RUNS_ROOT else a for a in args]
        env = {e["name"]: secret[e["valueFrom"]["secretKeyRef"]["key"]] for e in container["env"]}
        # the cluster's own environment: where S3 is (a real cluster reaches AWS without these)
        env.update({k: v for k, v in moto_s3.env.items() if k not in env})
        proc = subprocess.Popen([*container["command"], *args, *TINY], cwd=pod_dir, env=base_env(tracking, **env),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        return proc, pod_dir

    failures, actions = 0, []
    first, pod_dir = start_pod(1)
    wait_for_checkpoint(pod_dir, first)
    time.sleep(random.Random(75).uniform(0.0, 0.5))  # somewhere in epoch 1
    code, took = terminate(first, grace)  # the kubelet: SIGTERM to the container's PID 1, grace, SIGKILL
    stderr = first.stderr.read()
    assert code == REQUEUE_EXIT_CODE, stderr[-3000:]
    # out before the SIGKILL (17 s here once, on a machine with load 10: the save, then MLflow and teardown)
    assert took < grace, f"{took:.1f} s from SIGTERM to exit; grace {grace:.0f} s"
    actions.append(pod_failure_policy(job, container["name"], code))
    failures += actions[-1] == "Count"
    shutil.rmtree(pod_dir)  # the pod is deleted with its emptyDir volumes

    second, pod_dir = start_pod(2)  # the replacement pod, maybe on another node
    _, stderr = second.communicate(timeout=900)
    assert second.returncode == 0, stderr[-4000:]
    assert f"Resuming from {runs_root}/digits/{run_name}/checkpoints/step=" in stderr
    assert actions == ["Ignore"] and failures == 0 <= job["backoffLimit"]

    assert_bitwise_equal(reference, bucket_final_weights(moto_s3, f"{runs_root}/digits/{run_name}/checkpoints",
                                                         tmp_path / "download", monkeypatch))
    metrics = spot_metrics(tracking, "digits", run_name)
    assert metrics["spot/interruptions"] == [1.0]
    # the measured save (write + upload) is far inside the grace period the Job grants
    (saved,), (uploaded,) = metrics["spot/notice_to_saved_s"], metrics["spot/upload_s"]
    assert saved + uploaded < grace / 10, (saved, uploaded, grace)


# ------------------------------------------------------------------------------------------------ SLURM
def sbatch_options(script: str) -> dict[str, str]:
    """The ``#SBATCH`` options of a batch script, as sbatch reads them: only before the first command."""
    options: dict[str, str] = {}
    for line in script.splitlines()[1:]:
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break  # sbatch stops reading directives at the first command
        match = re.match(r"#SBATCH\s+(.*)", stripped)
        if match:
            for token in shlex.split(match.group(1), comments=True):
                key, _, value = token.partition("=")
                assert key.startswith("--"), f"use long options: {token}"
                assert key not in options, f"{key} given twice"
                options[key] = value
    return options


def test_slurm_script_directives() -> None:
    script = SLURM.read_text()
    assert script.startswith("#!/bin/bash\n")
    opts = sbatch_options(script)
    assert opts["--signal"] == "USR1@90"  # to every task (no B: prefix), 90 s before the limit
    assert "--requeue" in opts and opts["--requeue"] == ""
    assert opts["--open-mode"] == "append"
    assert (opts["--nodes"], opts["--ntasks-per-node"], opts["--gpus-per-node"]) == ("2", "8", "8")
    hours, minutes, seconds = (int(x) for x in opts["--time"].split(":"))
    assert hours * 3600 + minutes * 60 + seconds > 90
    assert "--ntasks" not in opts  # the task count comes from nodes x ntasks-per-node
    # every directive is above the first command, so none is ignored
    first_command = next(i for i, line in enumerate(script.splitlines()[1:])
                         if line.strip() and not line.lstrip().startswith("#"))
    assert all(i < first_command for i, line in enumerate(script.splitlines()[1:]) if line.startswith("#SBATCH"))
    # srun starts the tasks; devices and nodes follow the allocation; extra arguments pass through
    srun = " ".join(line.strip().rstrip("\\") for line in script.splitlines()[first_command:])
    assert re.search(r"\bsrun\b.*python -m recipes\.fit", srun)
    # not --kill-on-bad-exit: every rank exits 75 after a notice save, and the first out would kill rank 0
    # before its `scontrol requeue` (the imitation below fails with it: srun ends 137, no requeue)
    assert "--kill-on-bad-exit=0" in srun
    assert '--trainer.num_nodes "$SLURM_JOB_NUM_NODES"' in srun
    assert '--trainer.devices "$SLURM_NTASKS_PER_NODE"' in srun and '"$@"' in srun
    result = subprocess.run(["bash", "-n", str(SLURM)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


_FAKE_SRUN = textwrap.dedent("""\
    #!{python}
    # srun, one node: one process per task, with the task's SLURM variables; --kill-on-bad-exit kills the step
    # when a task exits non-zero. Task pids go to $SRUN_PIDS (the test signals them, as SLURM does).
    import os, subprocess, sys, time
    args = sys.argv[1:]
    kill_on_bad_exit = False
    while args and args[0].startswith("-"):
        option = args.pop(0)
        kill_on_bad_exit = option in ("-K", "--kill-on-bad-exit", "--kill-on-bad-exit=1")
    ntasks = int(os.environ["SLURM_NTASKS"])
    procs = []
    for rank in range(ntasks):
        env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0",
                   SLURM_STEP_ID="0", SLURM_STEPID="0")
        procs.append(subprocess.Popen(args, env=env))
    with open(os.environ["SRUN_PIDS"], "a") as out:
        out.write(" ".join(str(p.pid) for p in procs) + "\\n")
    codes = [None] * ntasks
    while None in codes:
        for i, p in enumerate(procs):
            if codes[i] is None and p.poll() is not None:
                codes[i] = p.returncode
                if p.returncode != 0 and kill_on_bad_exit:
                    for other in procs:
                        if other.poll() is None:
                            other.kill()
        time.sleep(0.05)
    bad = [c for c in codes if c != 0]
    sys.exit(0 if not bad else (bad[0] if bad[0] > 0 else 128 - bad[0]))
""")

_FAKE_SCONTROL = textwrap.dedent("""\
    #!/bin/sh
    # scontrol: `show hostnames LIST` prints this machine; `requeue JOB` is recorded for the test.
    case "$1" in
      show) echo 127.0.0.1 ;;
      requeue) echo "$@" >> "$SCONTROL_LOG" ;;
      *) echo "fake scontrol: $*" >&2; exit 1 ;;
    esac
""")


@pytest.mark.e2e
@pytest.mark.slow(covered_by="tests/e2e/test_launch_files.py::test_kubernetes_job_imitated_resumes_exactly")
def test_slurm_requeue_imitated_resumes_exactly(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(_FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "scontrol").write_text(_FAKE_SCONTROL)
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    lead = float(sbatch_options(SLURM.read_text())["--signal"].split("@")[1])
    submit = machine(tmp_path / "submit")  # the shared filesystem the job was submitted from
    (submit / "logs").mkdir()
    seed_mlflow_db(submit)
    tracking = f"sqlite:///{submit / 'mlflow.db'}"

    def job(job_id: int, restart: int) -> subprocess.Popen:
        env = base_env(tracking, SLURM_JOB_ID=str(job_id), SLURM_JOB_NAME="atscale-digits",
                       SLURM_JOB_NUM_NODES="1", SLURM_NNODES="1", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2",
                       SLURM_JOB_NODELIST="localhost", SLURM_NODELIST="localhost", SLURM_CPUS_PER_TASK="1",
                       SLURM_RESTART_COUNT=str(restart), SLURM_SUBMIT_DIR=str(submit),
                       MASTER_PORT=str(free_port()), SRUN_PIDS=str(tmp_path / f"pids-{job_id}-{restart}"),
                       SCONTROL_LOG=str(tmp_path / "scontrol.log"))
        env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
        log = open(submit / "logs" / f"atscale-digits-{job_id}.out", "a")  # --open-mode=append
        with log:
            return subprocess.Popen(["bash", str(SLURM), *TINY], cwd=submit, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def log_of(job_id: int) -> str:
        return (submit / "logs" / f"atscale-digits-{job_id}.out").read_text(errors="replace")

    reference = job(9001, 0)  # uninterrupted, the same script and task layout
    assert reference.wait(900) == 0, log_of(9001)[-4000:]

    first = job(4242, 0)
    wait_for_checkpoint(submit / "runs" / "digits" / "slurm-4242", first)
    time.sleep(random.Random(90).uniform(0.0, 0.5))
    pids = [int(p) for p in (tmp_path / "pids-4242-0").read_text().split()]
    assert len(pids) == 2
    code, took = terminate(first, lead, signal.SIGUSR1, pids=pids)  # SIGUSR1 to every task; the limit 90 s on
    assert code == REQUEUE_EXIT_CODE, log_of(4242)[-4000:]
    assert took < lead
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]

    second = job(4242, 1)  # the requeued job: same id, same script, same arguments
    assert second.wait(900) == 0, log_of(4242)[-4000:]
    text = log_of(4242)
    assert "job 4242 (restart 0) on 1 node(s), rendezvous 127.0.0.1:" in text
    assert "job 4242 (restart 1) on 1 node(s)" in text and "Resuming from " in text
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]  # no second requeue

    assert_bitwise_equal(final_weights(submit, "slurm-9001"), final_weights(submit, "slurm-4242"))
    runs = {r.info.run_name: r for r in runs_of(submit, "digits")}
    assert sorted(runs) == ["slurm-4242", "slurm-9001"]  # one MLflow run per run name
    assert {r.info.status for r in runs.values()} == {"FINISHED"}
    client = client_for(submit)
    interruptions = client.get_metric_history(runs["slurm-4242"].info.run_id, "spot/interruptions")
    assert [m.value for m in interruptions] == [1.0]
    assert runs["slurm-4242"].data.params["trainer.num_nodes"] == "1"
