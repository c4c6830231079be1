"""A run's manifest: everything needed to tell whether a rerun can reproduce it.

``manifest.json`` records the code (git SHA and dirty flag), the command line, the software
(Python, torch, Lightning, MLflow versions and the full list of installed distributions), the
machine (host, CPU, GPUs), the world size, the seed and a fingerprint of the training data.
The callback writes it into the run directory at fit start and logs it to MLflow (rank 0).

Copy with it: nothing; this file works alone.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

if TYPE_CHECKING:
    from lightning.pytorch import Trainer


def git_state(cwd: str | os.PathLike | None = None) -> dict[str, Any]:
    """The checkout's commit and whether it has uncommitted changes (``None`` outside git).

    Written here, not read from the ``mlflow.source.git.commit`` tag that MLflow sets when Lightning's
    ``MLFlowLogger`` creates a run (``mlflow.tracking.context.registry.resolve_tags``, MLflow 3.17): that tag
    does not hold this value. It is the checkout of the launched file (``sys.argv[0]``), not of the working
    directory that ``recipes.reproduce`` compares against (a launch from outside the checkout: the tag names a
    commit, this gives ``None``); it is set once, when the run is created, so a relaunch of the run with newer
    code keeps the first launch's commit, while a manifest describes its own launch; a Trainer without an MLflow
    logger has no tag; and MLflow records no dirty flag, which needs ``git status`` in this same checkout anyway.
    """

    def run(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    sha = run("rev-parse", "HEAD")
    status = run("status", "--porcelain", "--untracked-files=no") if sha else None
    return {"sha": sha, "dirty": bool(status) if status is not None else None}


def cpu_name() -> str:
    """The CPU model as the OS reports it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _name_and_version(dist: importlib.metadata.Distribution) -> tuple[str | None, str | None]:
    """``Name`` and ``Version`` from the head of a distribution's METADATA, without parsing all of it.

    ``dist.metadata`` parses the whole file (long descriptions included) as an e-mail message, for every
    installed package, on the critical path of every fit; the two headers come first in a core-metadata
    file, so reading up to the first blank line gives the same pairs for a small fraction of the time.
    """
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    name = version = None
    for line in text.splitlines():
        if not line:  # end of the headers
            break
        if name is None and line.startswith("Name:"):
            name = line[5:].strip()
        elif version is None and line.startswith("Version:"):
            version = line[8:].strip()
        if name and version:
            break
    return name, version


def installed_packages() -> list[str]:
    """``name==version`` of every installed distribution, sorted (what ``pip freeze`` lists)."""
    found = {f"{name}=={version}" for name, version in map(_name_and_version, importlib.metadata.distributions())
             if name}
    return sorted(found, key=str.lower)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def training_input(datamodule: Any, fingerprint: str) -> Any:
    """The training data as an MLflow dataset input (the run page's "Datasets"): the datamodule, its fingerprint.

    MLflow keeps one entry per name and digest, so a relaunch with the same data adds nothing. A datamodule with
    ``dataset_source()`` (streamed data: ``{"url": ..., "index_digest": ...}``) is named by its URL, and its source
    records the URL and the digest of the chunk index.
    """
    from mlflow.entities import Dataset, DatasetInput, InputTag

    cls = type(datamodule)
    described = {"datamodule": f"{cls.__module__}.{cls.__qualname__}"}
    streamed = datamodule.dataset_source() if hasattr(datamodule, "dataset_source") else None
    if streamed:  # data streamed from a URL: the input names it and the digest of its chunk index
        described.update(streamed)
        return DatasetInput(Dataset(name=str(streamed["url"]), digest=fingerprint[:36], source_type="litdata",
                                    source=json.dumps(described)),
                            tags=[InputTag(key="mlflow.data.context", value="train")])
    return DatasetInput(Dataset(name=cls.__name__, digest=fingerprint[:36], source_type="code",
                                source=json.dumps(described)),
                        tags=[InputTag(key="mlflow.data.context", value="train")])


DATASET_ATTEMPTS = 3
DATASET_RETRY_WAIT_S = 0.5  # grows linearly with the attempt


def log_training_input(experiment: Any, run_id: str, dataset_input: Any) -> bool:
    """Record ``dataset_input`` on the run, asking again when the store refuses; warn (not fail) if it keeps refusing.

    Launches that start together into one experiment race to insert the same dataset row: the loser's store answers
    with an error (PostgreSQL's unique violation, which a tracking server passes on as a 400 that MLflow's client
    does not retry) although the row exists by then, so the next attempt links to it. The input is a convenience
    of the run page (the manifest holds the fingerprint): a store that keeps refusing costs a warning, not the run.
    """
    from mlflow.exceptions import MlflowException

    for attempt in range(1, DATASET_ATTEMPTS + 1):
        try:
            experiment.log_inputs(run_id, datasets=[dataset_input])
            return True
        except MlflowException as err:
            if attempt == DATASET_ATTEMPTS:
                first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
                warnings.warn(f"the run's dataset input was not recorded after {attempt} attempts: {first_line}",
                              stacklevel=2)
                return False
            time.sleep(DATASET_RETRY_WAIT_S * attempt)
    return False


def build_manifest(world_size: int, seed: int | None, data_fingerprint: str | None,
                   argv: list[str] | None = None) -> dict[str, Any]:
    """The manifest of a run started now in this process."""
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    return {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_state(),
        "command": [sys.executable, *(argv if argv is not None else sys.argv)],
        "cwd": os.getcwd(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "lightning": _version("lightning"),
            "mlflow": _version("mlflow"),
        },
        "packages": installed_packages(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),  # the thread count can change float results on CPU
        "gpus": gpus,
        "world_size": world_size,
        "seed": seed,
        "data_fingerprint": data_fingerprint,
    }


class Manifest(Callback):
    """Write ``manifest.json`` into ``dirpath`` at fit start and log it as an MLflow artifact.

    Args:
        dirpath: the run directory.
        seed: the run's seed, recorded as is.
        argv: the command line to record (default ``sys.argv``); pass it with secrets removed.

    The datamodule's ``fingerprint()``, when it has one, is the data fingerprint.

    Example::

        trainer = Trainer(callbacks=[Manifest("runs/digits/r1", seed=42)])
    """

    def __init__(self, dirpath: str | os.PathLike, seed: int | None = None, argv: list[str] | None = None) -> None:
        self.dirpath = Path(dirpath)
        self.seed = seed
        self.argv = argv
        self.manifest: dict[str, Any] | None = None

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        datamodule: Any = trainer.datamodule
        fingerprint = datamodule.fingerprint() if hasattr(datamodule, "fingerprint") else None
        self.manifest = build_manifest(trainer.world_size, self.seed, fingerprint, argv=self.argv)
        self.dirpath.mkdir(parents=True, exist_ok=True)
        path = self.dirpath / "manifest.json"
        path.write_text(json.dumps(self.manifest, indent=2))
        for logger in trainer.loggers:
            run_id = getattr(logger, "run_id", None)
            if run_id is not None and hasattr(logger.experiment, "log_artifact"):
                logger.experiment.log_artifact(run_id, str(path))
                if fingerprint and hasattr(logger.experiment, "log_inputs"):
                    log_training_input(logger.experiment, run_id, training_input(datamodule, fingerprint))
