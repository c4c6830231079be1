"""The CLI's own callbacks: the run's config into its directory and MLflow, run files into object storage,
ModelCheckpoint's best-k record kept across a resume on another machine, how far training has logged
(what a checkpoint's publication waits for), and every rank's start checked against global rank 0's."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jsonargparse import Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, SaveConfigCallback
from lightning.pytorch.loggers import MLFlowLogger
from torch import distributed as dist

from callbacks.checkpoint_io import METRICS_PENDING_KEY, PublishGate
from callbacks.storage import ckpt_store, remote_store
from callbacks.utils.steps_file import PROGRESS_FILE
from recipes.run.common import UsageError
from recipes.run.compat import MODEL_CHECKPOINT_BEST_K_KEY, MODEL_CHECKPOINT_PATH_KEYS
from recipes.run.context import flatten
from recipes.run.tracking import redact

if TYPE_CHECKING:
    import mlflow

log = logging.getLogger(__name__)


def log_params_once(client: mlflow.MlflowClient, run_id: str, params: dict[str, str]) -> list[str]:
    """Log params the run does not have yet; a resumed run whose config changed gets tags instead.

    MLflow refuses to change a logged param, so changed values are recorded as
    ``config_changed.<key>`` tags (and returned) rather than failing the resume.
    """
    existing = client.get_run(run_id).data.params
    new = {k: v for k, v in params.items() if k not in existing}
    changed = [k for k, v in params.items() if k in existing and existing[k] != v]
    from mlflow.entities import Param  # global rank 0 alone: the other ranks never import MLflow

    items = [Param(k, v) for k, v in new.items()]
    for start in range(0, len(items), 100):
        client.log_batch(run_id, params=items[start:start + 100])
    for key in changed:
        client.set_tag(run_id, f"config_changed.{key}"[:250], params[key])
    return changed


class TrackedConfig(SaveConfigCallback):
    """Write the resolved ``config.yaml`` into the run directory and log it (and its params) to MLflow."""

    def __init__(self, parser: LightningArgumentParser, config: Namespace, run_dir: str = ".",
                 **kwargs: Any) -> None:
        super().__init__(parser, config, save_to_log_dir=False, **kwargs)
        self.run_dir = Path(run_dir)

    def save_config(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "config.yaml"
        # validated when parsed: a second check here cost 55 ms of trainer.fit's setup
        self.parser.save(self.config, str(path), skip_none=False, skip_validation=True, overwrite=True,
                         multifile=False)
        text = path.read_text()
        if redact(text) != text:  # a password in a URL (e.g. --spot.metadata_url) is never stored
            path.write_text(redact(text))
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger) and logger.run_id:
                changed = log_params_once(logger.experiment, logger.run_id, flatten(self.config))
                if changed:
                    log.warning("Resumed with a changed config: %s (recorded as config_changed.* tags).",
                                ", ".join(changed))
                logger.experiment.log_artifact(logger.run_id, str(path))


class UploadRunFiles(Callback):
    """Copy the run's config.yaml, manifest.json and cost sidecar to its object-storage directory (rank 0).

    At train start (they are written at setup and fit start) and again at teardown (a finished run,
    or one stopped by a notice). A failed upload is logged, never fatal: the checkpoints matter more.
    """

    FILES = ("config.yaml", "manifest.json", f"checkpoints/{PROGRESS_FILE}")

    def __init__(self, run_dir: Path, run_url: str) -> None:
        self.run_dir, self.run_url = Path(run_dir), run_url

    def upload(self) -> None:
        try:
            for name in self.FILES:
                if (self.run_dir / name).exists():
                    remote_store.put_file(self.run_dir / name, remote_store.join(self.run_url, name))
        except Exception as err:  # never end (or mask the outcome of) the run for these
            log.warning("Could not upload the run files to %s: %s", self.run_url, err)

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        if trainer.is_global_zero:
            self.upload()

    def teardown(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        if trainer.is_global_zero:
            self.upload()


def relocate_checkpoint_state(state: dict[str, Any], dirpath: str) -> bool:
    """Point a ModelCheckpoint state saved under another absolute directory at ``dirpath``; True if moved.

    ModelCheckpoint stores absolute paths and forgets its best-k bookkeeping when the directory
    differs, which it does whenever a run resumes on another machine or from another working
    directory. Paths are moved only when the old directory is the same run's (the same last three
    parts: ``<experiment>/<run>/checkpoints``); the checkpoints themselves live on in object storage.
    """
    old = state.get("dirpath")
    if not old or old == dirpath or Path(old).parts[-3:] != Path(dirpath).parts[-3:]:
        return False

    def move(path: Any) -> Any:
        if isinstance(path, str) and path.startswith(old.rstrip("/") + "/"):
            return dirpath.rstrip("/") + path[len(old.rstrip("/")):]
        return path

    for key in MODEL_CHECKPOINT_PATH_KEYS:
        if key in state:
            state[key] = move(state[key])
    state["dirpath"] = dirpath
    if isinstance(state.get(MODEL_CHECKPOINT_BEST_K_KEY), dict):
        state[MODEL_CHECKPOINT_BEST_K_KEY] = {move(k): v for k, v in state[MODEL_CHECKPOINT_BEST_K_KEY].items()}
    return True


class RelocateCheckpointState(Callback):
    """Keep ModelCheckpoint's best-k record across a resume on another machine (see ``relocate_checkpoint_state``).

    Without it, a relaunch elsewhere starts a fresh best-k list and leaves the old best checkpoints
    in the bucket for good.
    """

    def on_load_checkpoint(self, trainer: Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("callbacks") or {}
        for callback in trainer.checkpoint_callbacks:
            state = states.get(callback.state_key)
            if isinstance(callback, ModelCheckpoint) and callback.dirpath and isinstance(state, dict) \
                    and relocate_checkpoint_state(state, callback.dirpath):
                log.info("ModelCheckpoint state moved from another directory to %s.", callback.dirpath)


def pending_points(checkpoint: str | None) -> list[list[Any]]:
    """The metric points a checkpoint's record carries that the tracking store had not confirmed when it was
    published (``callbacks.checkpoint_io.PublishGate``); none for no checkpoint or no record."""
    record = ckpt_store.read_record(checkpoint, verify_hash=False) if checkpoint else None
    return list(record.extra.get(METRICS_PENDING_KEY) or []) if record is not None else []


class LoggedThrough(Callback):
    """Tells a checkpoint IO's publish gate how far training has logged (``callbacks.checkpoint_io.PublishGate``).

    A step's start follows the previous step's logging, its validation and its epoch's end: every metric of
    the steps before it has been handed to the logger.

    Args:
        gate: the gate of the trainer's checkpoint IO.
    """

    def __init__(self, gate: PublishGate) -> None:
        self.gate = gate

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.gate.passed(trainer.global_step)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.gate.finish()

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None:
        self.gate.finish()


class AgreedStart(Callback):
    """Every rank starts the run where global rank 0 does, checked once the process group exists.

    Tasks that a scheduler starts side by side (``srun``) each apply the resume policy alone: a rank whose node
    sees another checkpoint (its disk lacks the run's; a checkpoint appeared between two ranks' reads) would train
    apart from the others, or wait in another collective until the process group's timeout. At ``setup`` every
    rank gathers every rank's run name and checkpoint in one ``all_gather_object``; when any differs, every rank
    raises the same one-line error (exit 2) at the same point. Under torchrun and Lightning's own launcher the
    ranks received rank 0's decision already (``recipes/run/agree.py``): the check then costs one collective.
    """

    def __init__(self, run_name: str, ckpt_path: str | None) -> None:
        self.start = (run_name, Path(ckpt_path).name if ckpt_path else None)

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        if trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return
        starts: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(starts, self.start)
        apart = [rank for rank, start in enumerate(starts) if tuple(start) != tuple(starts[0])]
        if apart:
            def said(rank: int) -> str:
                name, ckpt = starts[rank]
                return f"rank {rank} starts run {name} from {ckpt or 'scratch'}"
            raise UsageError(f"the ranks would start apart: {said(0)}, {said(apart[0])}. Give every node the same "
                             "--runs_root (a shared filesystem, or an object-storage URL such as s3://bucket/runs) "
                             "and the same --run_name.")
