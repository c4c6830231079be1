"""Shared test helpers: run the CLI as a user does (a real subprocess) against a sqlite MLflow store."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import Logger

from tests.forked import ForkedProcess, Zygote
from tests.servers import free_port  # noqa: F401 (the one free_port every test imports from here)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


_TEMPLATE_DB: Path | None = None


@pytest.fixture(scope="session", autouse=True)
def mlflow_template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty, migrated MLflow sqlite store, made once: migrating a new one takes seconds."""
    global _TEMPLATE_DB
    template = tmp_path_factory.getbasetemp() / "mlflow-template.db"
    mlflow.MlflowClient(f"sqlite:///{template}").search_experiments()
    _TEMPLATE_DB = template
    return template


def seed_mlflow_db(workdir: Path) -> None:
    """Give ``workdir`` a copy of the session's migrated, empty MLflow store, unless it has one."""
    if _TEMPLATE_DB is not None and not (workdir / "mlflow.db").exists():
        shutil.copy(_TEMPLATE_DB, workdir / "mlflow.db")


def mlflow_template_bytes() -> int:
    """Size of the session's migrated, empty MLflow store: grows with each MLflow release that adds tables."""
    assert _TEMPLATE_DB is not None, "the mlflow_template_db fixture has not run"
    return _TEMPLATE_DB.stat().st_size


def cli_env(workdir: Path, **extra: str) -> dict[str, str]:
    """Environment of a CLI subprocess: the repo importable, MLflow in ``workdir/mlflow.db`` (seeded)."""
    seed_mlflow_db(workdir)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATSCALE_", "SLURM_", "MLFLOW_"))}
    env.update({
        "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlflow.db'}",
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
    })
    env.update(worker_thread_share())
    env.update(extra)
    return env


def worker_thread_share() -> dict[str, str]:
    """``OMP_NUM_THREADS`` for this pytest-xdist worker's processes: its share of the cores, or nothing.

    Alone (no xdist, or one worker) the CLI runs with torch's own thread count, as a user's does. With N
    workers on C cores every process a worker starts gets C // N threads (at least one), the share Lightning's
    own DDP launcher gives each rank: with torch's default of one spinning thread per core, two fits side by
    side each ran their steps about 4x slower than with one thread each (docs/development.md). Results do not
    depend on the count (the CLI holds the count a run started with); tests/e2e/test_exact_under_load.py runs
    with no pin beside busy cores to prove it.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // workers))}


@pytest.fixture(scope="session", autouse=True)
def _worker_threads() -> None:
    """In-process fits of a pytest-xdist worker use its share of the cores too (``worker_thread_share``)."""
    share = worker_thread_share()
    if share:
        torch.set_num_threads(int(share["OMP_NUM_THREADS"]))


#: Set (to anything) to start every launch as a new interpreter instead of a fork of the zygote.
REAL_LAUNCHES_ENV = "TESTS_REAL_LAUNCHES"
_ZYGOTE = Zygote()


def _zygote_for(args: Sequence[str], env: dict[str, str]) -> Zygote | None:
    """The zygote when it can start this launch as a new interpreter would (``tests/forked.py``), else None.

    ``--cpu_threads N`` sets OpenMP's environment before torch is imported: such launches get an interpreter.
    """
    if os.environ.get(REAL_LAUNCHES_ENV) or any(a.startswith("--cpu_threads") for a in args):
        return None
    if not _ZYGOTE.started:
        try:
            _ZYGOTE.start(env)
        except (OSError, RuntimeError) as err:  # the launches still run, each as a new interpreter
            warnings.warn(f"launches start new interpreters: {err}", stacklevel=2)
    return _ZYGOTE if _ZYGOTE.serves(env) else None


def start_module(module: str, *args: str, cwd: Path, env: dict[str, str] | None = None, real: bool = False,
                 script: Path | None = None, **popen: Any) -> subprocess.Popen | ForkedProcess:
    """Start ``python -m module ARGS`` (or ``python SCRIPT ARGS``) in ``cwd`` (``Popen``'s stdout, stderr, text,
    start_new_session).

    A fork of the session's zygote (imports already done) unless ``real`` or the environment asks for a new
    interpreter; either way a process of its own, with its own pid, streams and exit status.
    """
    env = env or cli_env(cwd)
    zygote = None if real else _zygote_for(args, env)
    if zygote is None:
        command = [sys.executable, str(script)] if script else [sys.executable, "-m", module]
        return subprocess.Popen([*command, *args], cwd=cwd, env=env, stdin=popen.pop("stdin", subprocess.DEVNULL),
                                **popen)
    return zygote.launch(None if script else module, args, cwd=cwd, env=env,
                         script=str(script) if script else None, **popen)


def run_module(module: str, *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600,
               check: bool = False, real: bool = False, script: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m module ARGS`` to its end (``start_module``), output captured as text; killed at ``timeout``."""
    proc = start_module(module, *args, cwd=cwd, env=env, real=real, script=script, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def run_script(script: Path, *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600
               ) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` to its end in ``cwd`` (``run_module``)."""
    return run_module("", *args, cwd=cwd, env=env, timeout=timeout, script=script)


def start_fit(workdir: Path, *args: str, env: dict[str, str] | None = None, **popen: Any
              ) -> subprocess.Popen | ForkedProcess:
    """``python -m recipes.fit ARGS`` started in ``workdir`` (``start_module``)."""
    return start_module("recipes.fit", *args, cwd=workdir, env=env, **popen)


def run_fit(workdir: Path, *args: str, timeout: float = 600, env: dict[str, str] | None = None,
            check: bool = False, real: bool = False) -> subprocess.CompletedProcess:
    """``python -m recipes.fit ARGS`` in ``workdir`` to its end; output captured as text (``run_module``)."""
    return run_module("recipes.fit", *args, cwd=workdir, env=env, timeout=timeout, check=check, real=real)


def _interpreter_warning_filters() -> list:
    """The warning filters a fresh ``python`` starts with (pytest replaces them while tests run)."""
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.filterwarnings("ignore", category=category, append=True)
        return list(warnings.filters)


_INTERPRETER_WARNING_FILTERS = _interpreter_warning_filters()


def _print_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                   file: Any = None, line: str | None = None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@dataclass
class CliResult:
    """What an in-process launch of the CLI left: its exit code and everything it wrote to stdout and stderr."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def fit_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   capfd: pytest.CaptureFixture) -> Callable[..., CliResult]:
    """``python -m recipes.fit ARGS`` run inside the test's own interpreter, as ``recipes.fit.main`` runs it.

    For launches that never train (bad input, ``--print_config``, refusals at start-up): the same code path
    as the subprocess from the parse to the exit code, without ten seconds of importing torch, Lightning and
    MLflow. The environment and working directory are a subprocess's (``cli_env``); the signal handlers and
    torch's thread count the CLI sets are restored afterwards. The exit code is ``main``'s return value, or
    the code of a ``SystemExit`` (``--print_config`` and ``--help`` exit through the parser).
    ``tests/e2e/test_first_hour.py`` checks that a real subprocess exits with the code ``main`` returns.
    """
    from recipes.fit import main

    def run(*args: str, workdir: Path | None = None, **extra_env: str) -> CliResult:
        workdir = workdir or tmp_path
        env = cli_env(workdir, **extra_env)
        for key in [k for k in os.environ if k.startswith(("ATSCALE_", "SLURM_", "MLFLOW_")) and k not in env]:
            monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.chdir(workdir)
        monkeypatch.setattr(sys, "argv", [str(REPO / "recipes" / "fit.py"), *args])  # as `python -m` sets it
        handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
        threads = torch.get_num_threads()
        root_handlers = logging.root.handlers[:]
        capfd.readouterr()
        try:
            with warnings.catch_warnings():
                # as in a fresh interpreter: warnings and unhandled log records are printed on stderr (pytest
                # would record them instead), so tests of what stderr shows see what a user sees
                warnings.filters[:] = _INTERPRETER_WARNING_FILTERS
                warnings.showwarning = _print_warning
                logging.root.handlers[:] = []
                code = main() or 0  # reads sys.argv, as `python -m recipes.fit` does
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        finally:
            logging.root.handlers[:] = root_handlers
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            torch.set_num_threads(threads)
        out, err = capfd.readouterr()
        return CliResult(code, out, err)

    return run


def final_weights(workdir: Path, run_name: str, experiment: str = "digits") -> dict[str, torch.Tensor]:
    """The state dict of the newest good ``step=`` checkpoint of ``runs/<experiment>/<run_name>`` in ``workdir``."""
    from callbacks.spot import CHECKPOINT_PATTERN
    from callbacks.storage import ckpt_store

    record = ckpt_store.newest_good(workdir / "runs" / experiment / run_name / "checkpoints", CHECKPOINT_PATTERN)
    assert record is not None
    return torch.load(record.path, map_location="cpu", weights_only=False)["state_dict"]


def remote_final_weights(url: str, scratch: Path) -> dict[str, torch.Tensor]:
    """The newest ``step=`` checkpoint in the bucket, downloaded and verified."""
    from callbacks.storage.remote_store import RemoteCheckpoints

    remote = RemoteCheckpoints(url, scratch)
    (newest,) = [r for r in remote.records() if r["name"].startswith("step=")][:1]
    record = remote.fetch(newest)
    assert record is not None
    return torch.load(record.path, map_location="cpu", weights_only=False)["state_dict"]


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Same keys, and every tensor ``torch.equal`` to its counterpart (names the ones that differ)."""
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ: {different}"


#: A small corpus of Python files for the text datamodule: ``relative path -> content``.
CORPUS_FILES = {f"pkg/mod{i:02d}.py": f"# module {i}\n" + "x = 1\n" * (i + 1) for i in range(20)}


def write_corpus(root: Path, files: dict[str, str]) -> Path:
    """Write ``files`` (``relative path -> text``) under ``root``; returns ``root``."""
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return root


def _write_idx(path: Path, array: np.ndarray) -> None:
    """IDX: big-endian magic (0x0000, type 0x08 = uint8, ndim), big-endian int32 dims, raw bytes."""
    magic = 0x0800 + array.ndim  # 2051 for images (3 dims), 2049 for labels (1 dim)
    header = struct.pack(f">{1 + array.ndim}I", magic, *array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def write_mnist(root: Path, train: np.ndarray, test: np.ndarray) -> None:
    """MNIST's raw IDX files under ``root/MNIST/raw`` (images ``(N, 1, 28, 28)`` uint8; label of image i: i % 10)."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, images in (("train", train), ("t10k", test)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", images[:, 0])  # (N, 28, 28)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", np.arange(len(images)) % 10)


# ------------------------------------------------- untrusted checkpoints: real pickle payloads, as attackers forge them
#: A GPT small enough to checkpoint in milliseconds.
TINY_GPT = {"block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32}


class Payload:
    """Unpickling this runs code: it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return exec, (f"import pathlib; pathlib.Path({str(self.marker)!r}).touch()",)


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    """Where a checkpoint's payload would leave its mark; the test fails if it exists afterwards."""
    path = tmp_path / "PWNED"
    yield path
    assert not path.exists(), "the checkpoint's payload ran"


def tiny_gpt(seed: int) -> tuple:
    """A tiny GPT after one AdamW step (so its optimizer holds tensors as well as plain values)."""
    from recipes.gpt import GPT

    torch.manual_seed(seed)
    model = GPT(**TINY_GPT)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    return model, optimizer


def gpt_dcp_checkpoint(path: Path, seed: int = 0) -> Path:
    """A real distributed checkpoint of a tiny GPT, as our FSDP run lays it out: shards, ``.metadata``, ``meta.pt``.

    Written in one process by ``torch.distributed.checkpoint.save`` (what Lightning's ModelParallelStrategy
    calls on every rank), with the optimizer state, whose param groups become non-tensor (pickled) items.
    """
    import torch.distributed.checkpoint as dcp

    model, optimizer = tiny_gpt(seed)
    dcp.save({"state_dict": model.state_dict(), "optimizer_0": optimizer.state_dict()}, checkpoint_id=path,
             no_dist=True)
    torch.save({"hyper_parameters": dict(model.hparams), "global_step": seed, "epoch": 0}, path / "meta.pt")
    return path


def tamper_metadata_same_size(directory: Path, marker: Path) -> None:
    """Replace ``.metadata`` in place by a payload padded to the same size (pickle stops reading at STOP)."""
    meta = directory / ".metadata"
    size = meta.stat().st_size
    payload = pickle.dumps(Payload(marker))
    assert len(payload) <= size
    with open(meta, "r+b") as handle:
        handle.write(payload + b" " * (size - len(payload)))
    assert meta.stat().st_size == size


def shard_with_a_payload_item(directory: Path, marker: Path) -> Path:
    """A distributed checkpoint whose ``.metadata`` is clean but one non-tensor item of its shard is a payload."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"state_dict": {"w": torch.ones(4)}, "extra": Payload(marker)}, checkpoint_id=directory, no_dist=True)
    assert not marker.exists()
    return directory


def forge_file(path: Path, marker: Path, kind: str) -> None:
    """Overwrite checkpoint ``path`` with a payload and recompute its record, as an attacker with the folder can."""
    from callbacks.storage import ckpt_store

    record = json.loads(ckpt_store.meta_path(path).read_text())
    if kind == "zip":  # torch.save's format, which the cheap mmap'd check parses
        torch.save({"state_dict": {}, "global_step": record["global_step"], "x": Payload(marker)}, path)
    else:  # a legacy plain pickle
        path.write_bytes(pickle.dumps({"x": Payload(marker)}))
    ckpt_store.write_record(path, record["global_step"], record["epoch"], extra=record["extra"])
    assert ckpt_store.read_record(path, verify_hash=False) is not None  # size and SHA-256 match


def client_for(workdir: Path) -> mlflow.MlflowClient:
    return mlflow.MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")


def runs_of(workdir: Path, experiment: str) -> list:
    client = client_for(workdir)
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id])


class TinyModule(LightningModule):
    """One ``Linear(2, 1)`` that never learns (lr 0): for tests of callbacks, where the model is beside the point.

    Batches are ``(x,)`` with ``x`` of shape ``(n, 2)``; validation logs ``val/x``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).sum()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/x", self.layer(batch[0]).sum())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class RecordingLogger(Logger):
    """A Lightning logger that keeps every ``log_metrics`` call in memory, for exact assertions."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))

    def values(self, key: str) -> list[tuple[int | None, float]]:
        return [(step, m[key]) for step, m in self.calls if key in m]


# Small, fast variants of the digits recipe for tests (the README's run uses the full config).
FAST = ("--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false")

#: The README's commands for the default recipe on one device, DDP and FSDP (2 CPU processes): the text the
#: README shows, then the extra arguments the shared runs add.
DIGITS_RECIPE = "python -m recipes.fit --config configs/digits.yaml"
DIGITS_STRATEGIES = {
    "single": DIGITS_RECIPE,
    "ddp": f"{DIGITS_RECIPE} --config configs/strategy/ddp.yaml",
    "fsdp": f"{DIGITS_RECIPE} --config configs/strategy/fsdp.yaml",
}


def readme_env(workdir: Path) -> dict[str, str]:
    """A README command's environment: ``cli_env``, every download to a closed port, a 100-column terminal."""
    return cli_env(workdir, http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9", COLUMNS="100")


def readme_workdir(path: Path) -> Path:
    """``path`` made to look like the repository's root to a README command (``configs/`` in place)."""
    (path / "configs").symlink_to(CONFIGS)
    return path


class MadeOnFirstUse(dict):
    """``runs[name]``: a module's reference runs, each made by ``make(name)`` the first time a test asks for it.

    A reference only ``slow`` tests read is then never made by a ``.ci/run`` that leaves them out.
    """

    def __init__(self, make: Callable[[str], Path]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, name: str) -> Path:
        self[name] = self._make(name)
        return self[name]


@pytest.fixture(scope="session")
def digits_recipe_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """The default recipe's full runs, one per strategy, each in a folder of its own, made once a session.

    Each is the README's command as shown (20 epochs) plus ``--run_name <strategy>``, run as the README test runs
    its commands; tests/e2e/test_fit.py checks what each run left, tests/e2e/test_readme_commands.py checks the
    commands' output and continues the README from the single-device run. The single-device run is a new
    interpreter, whose output shows what importing the libraries prints; the DDP and FSDP launches fork from the
    zygote (their second rank, started by Lightning's launcher, is a new interpreter all the same).
    """
    out = {}
    for name, command in DIGITS_STRATEGIES.items():
        workdir = readme_workdir(tmp_path_factory.mktemp(f"digits-{name}"))
        _, flag, module, *args = command.split()
        assert flag == "-m", command
        out[name] = (workdir, run_module(module, *args, "--run_name", name, cwd=workdir, env=readme_env(workdir),
                                         timeout=900, real=name == "single"))
    return out


@pytest.fixture
def tracked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's cwd and environment are a CLI subprocess's: MLflow in ``tmp_path/mlflow.db``."""
    for key, value in cli_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    for key in [k for k in os.environ if k.startswith(("ATSCALE_", "SLURM_"))]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    return tmp_path


_E2E_DIR = Path(__file__).resolve().parent / "e2e"


def slow_tier_problems(tests: Sequence[tuple[str, str | None, bool]]) -> list[str]:
    """What is wrong with the ``slow`` tier among collected ``(node id, covered_by, slow)`` tests.

    A ``slow`` test is a variant that ``.ci/run`` leaves out because a test it runs holds the same behaviour:
    ``covered_by`` names that test (a function's node id, or one parametrization's), which must not be slow
    itself. Checked only where the covering test's file was collected (a run of one file checks its own).
    """
    ids = {nodeid: slow for nodeid, _, slow in tests}
    files = {nodeid.split("::", 1)[0] for nodeid in ids}
    problems = []
    for nodeid, covered_by, slow in tests:
        if not slow:
            continue
        if not covered_by:
            problems.append(f"{nodeid}: marked slow without covered_by=")
            continue
        if covered_by.split("::", 1)[0] not in files:
            continue
        cover = [is_slow for other, is_slow in ids.items() if other == covered_by or other.startswith(covered_by + "[")]
        if not cover:
            problems.append(f"{nodeid}: covered_by {covered_by}, which is not a test")
        elif all(cover):
            problems.append(f"{nodeid}: covered_by {covered_by}, which is slow too")
    return problems


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects: the check sees every collected test
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/e2e/ is end-to-end (``pytest -m "not e2e"`` runs the unit tests alone); every
    ``slow`` test names a test ``.ci/run`` runs that holds its behaviour (``slow_tier_problems``)."""
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(_E2E_DIR):
            item.add_marker(pytest.mark.e2e)
    tiers = [(item.nodeid, (mark.kwargs.get("covered_by") if (mark := item.get_closest_marker("slow")) else None),
              mark is not None) for item in items]
    if problems := slow_tier_problems(tiers):
        raise pytest.UsageError("the slow tier:\n  " + "\n  ".join(problems))


#: Files whose tests read the session's shared runs (``digits_recipe_runs``): one unit of work, so one worker
#: makes the runs, once.
_SCHEDULED_TOGETHER = {"tests/e2e/test_fit.py": "digits-recipe-runs",
                       "tests/e2e/test_readme_commands.py": "digits-recipe-runs"}
#: Files whose tests share no module- or session-scoped fixture (bar one source run of test_run_integrity, made
#: at most once per worker): each test is a unit of its own, so they spread over both workers.
_SCHEDULED_PER_TEST = {"tests/e2e/test_run_integrity.py", "tests/e2e/test_copy_into_project.py",
                       "tests/e2e/test_configs.py", "tests/e2e/test_bad_input.py"}


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (``-n 2``, as ``.ci/run`` runs the suite) a file's tests run on one worker, in file
    order, as a unit: the module- and session-scoped fixtures they share (trained runs, servers) are made once,
    not once per worker. ``_SCHEDULED_TOGETHER`` joins files that read the same shared runs;
    ``_SCHEDULED_PER_TEST`` splits files whose tests share nothing."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path in _SCHEDULED_PER_TEST:
                return nodeid
            return _SCHEDULED_TOGETHER.get(path, path)

    return FileScheduling(config, log)


@contextlib.contextmanager
def frozen(proc: subprocess.Popen) -> Iterator[None]:
    """Inside: every thread of the launch is stopped (SIGSTOP to its group), so what a test reads of it holds
    until the test acts; a signal sent meanwhile is delivered on SIGCONT, to the state read."""
    deadline = time.monotonic() + 10
    while os.getpgid(proc.pid) != proc.pid:  # a fork of the zygote starts its own group a moment after it starts
        assert time.monotonic() < deadline, "the launch did not start its own process group within 10 s"
        time.sleep(0.001)
    os.killpg(proc.pid, signal.SIGSTOP)
    while not all(_stopped(task) for task in Path(f"/proc/{proc.pid}/task").glob("*")):
        assert time.monotonic() < deadline, "the launch did not stop within 10 s of SIGSTOP"
        time.sleep(0.001)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)


def _stopped(task: Path) -> bool:
    try:
        state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # the thread ended
        return True
    return state in ("T", "t", "Z", "X")
