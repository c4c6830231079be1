"""Where a run lives and what it resumes from: the run context and the resume policy, without Lightning's CLI.

Resume policy, in order:

1. a rank started by the launching process takes what that process decided (``ATSCALE_CKPT_PATH``,
   ``ATSCALE_MLFLOW_RUN_ID``);
2. ``--ckpt_path``: that checkpoint (local, or downloaded from object storage), verified against its
   integrity record and torch's safe unpickler first;
3. ``--fresh``: start over, the previous checkpoints moved aside (never deleted);
4. else the newest checkpoint that verifies, in the run directory or, for object-storage runs, in the
   bucket (a newer one staged on this machine by the same MLflow run is uploaded first).

Under torchrun only global rank 0 applies the policy; the other ranks receive its decision
(:mod:`recipes.run.agree`) and find the same checkpoint on their own machine (:func:`checkpoint_here`).

Config changes on resume: only :data:`RESUMABLE_CHANGES` may differ from the run's logged params
(:func:`refused_changes`); any other change would be ignored by the restored training state.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jsonargparse import Namespace

from callbacks.analysis import keys
from callbacks.storage import ckpt_store, remote_store
from callbacks.storage.remote_store import RemoteCheckpoints, StoreError
from callbacks.utils.steps_file import PROGRESS_FILE
from recipes.run import tracking
from recipes.run.common import (
    ENV_CKPT_PATH,
    ENV_MLFLOW_RUN_ID,
    ENV_PARENT_RUN_ID,
    ENV_RUN_NAME,
    ENV_RUN_TAGS,
    UsageError,
    command_run_name,
)
from recipes.run.common import NAME_PATTERN as NAME_PATTERN  # the run names' rule, kept in the tools' module
from recipes.run.common import NAME_RULE as NAME_RULE
from recipes.run.common import check_name as check_name
from recipes.run.tracking import redact

log = logging.getLogger(__name__)

_MAX_PARAM_LENGTH = 6000
#: Datamodule settings that hold no training state: the datamodule is built anew from the config at every launch,
#: and a resumed loader continues from its global sample cursor (``datamodules.loaders.PassSampler``), which says
#: which samples come next whoever fetches them. So a relaunch may change:
#:
#: - ``num_workers`` (every datamodule): how many processes fetch the samples the cursor names; the order and the
#:   samples are the sampler's, the loader takes the cursor into any count (``ResumableLoader.load_state_dict``),
#:   and no item draws random numbers, so a resume with another count is bitwise;
#: - ``cache_dir`` (streamed and text datamodules): where downloaded chunks or the encoded corpus are kept, a copy
#:   refetched or re-encoded from the same source (the cache disk failed, a faster one was mounted);
#: - ``max_cache_size`` (streamed): how much of that copy is kept before read chunks are deleted;
#: - ``read_timeout_s`` (streamed): how long a read may keep failing before the run stops (exit 75);
#: - ``download`` (MNIST, CIFAR-10): whether missing files are fetched; which data is read is ``root``'s.
#:
#: The data's identity (``url``, ``root``, splits, seeds, ``batch_size``, ``shuffle_window``) is not among them.
DATA_SETTINGS = tuple(f"data.init_args.{name}" for name in (
    "num_workers", "cache_dir", "max_cache_size", "read_timeout_s", "download", "fetch_ahead"))
#: Config keys that may change when a run is resumed: they take effect (and are recorded as
#: ``config_changed.*`` tags, with one warning naming them). Any other change would be ignored by the restored
#: training state.
RESUMABLE_CHANGES = (
    "config", "experiment", "run_name", "runs_root", "staging_root", "ckpt_path", "fresh", "async_checkpoint",
    "cpu_threads", "elastic", "system_metrics",
    "log_model", "spot", "cost", "checkpoint.dirpath", "trainer.max_epochs", "trainer.max_steps", "trainer.max_time",
    "trainer.enable_progress_bar", "trainer.enable_model_summary", "trainer.log_every_n_steps", "trainer.devices",
    "trainer.num_nodes", "trainer.accelerator", "trainer.strategy", *DATA_SETTINGS,
)

@dataclass
class RunContext:
    """Where a run lives and what it resumes from."""

    experiment: str
    run_name: str
    run_dir: Path
    tracking_uri: str
    ckpt_path: str | None
    mlflow_run_id: str | None
    #: The run directory in object storage (``run_dir`` is then its local staging copy).
    run_url: str | None = None
    #: What the run resumes from, said once every check has passed.
    resume_note: str | None = None

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def identity(self) -> str:
        """What names this run's files for MLflow's ``atscale.run_dir`` tag: the URL, else the absolute directory."""
        return redact(self.run_url) if self.run_url else str(self.run_dir.resolve())

    @property
    def location(self) -> str:
        """Where the run's files are kept for good: the object-storage URL, else the local directory."""
        return self.run_url or str(self.run_dir)

    def remote_checkpoints(self) -> RemoteCheckpoints | None:
        """The run's checkpoint directory in object storage, mirrored from ``checkpoint_dir``."""
        if self.run_url is None:
            return None
        return RemoteCheckpoints(remote_store.join(self.run_url, "checkpoints"), self.checkpoint_dir)


def check_location(flag: str, value: object) -> None:
    """Refuse (:class:`UsageError`) a storage URL with credentials in it (``file://user:password@host/...``).

    A location is stored with the run (params, tags, ``config.yaml``) and printed; the credentials
    would be too. Object stores take theirs from their own configuration (``AWS_ACCESS_KEY_ID`` and
    ``AWS_SECRET_ACCESS_KEY``, ``GOOGLE_APPLICATION_CREDENTIALS``, ``AZURE_STORAGE_*``).
    """
    if isinstance(value, str) and tracking.has_credentials(value):
        shown = tracking.mask_userinfo(value)
        raise UsageError(f"{flag} {shown}: credentials in a storage URL would be stored with the run and printed; "
                         "give them through the store's own configuration (e.g. AWS_ACCESS_KEY_ID and "
                         "AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS), not in the URL.")


#: Trainer arguments Lightning takes at construction and divides by once training runs (a ZeroDivisionError at the
#: first step or epoch): as integers they count batches or epochs and must be >= 1.
TRAINER_COUNTS = {
    "val_check_interval": "validate every N training batches (or a float in (0, 1]: a fraction of the epoch)",
    "check_val_every_n_epoch": "validate every N epochs (or null: by val_check_interval alone)",
    "accumulate_grad_batches": "step the optimizer every N batches",
}


def check_devices(trainer_cfg: Namespace, oversubscribe: bool = False) -> None:
    """Refuse more CPU processes than cores (Lightning would start them and crawl), unless ``oversubscribe``."""
    import torch

    devices, accelerator = trainer_cfg.get("devices"), str(trainer_cfg.get("accelerator"))
    wants_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if not wants_cpu or (not isinstance(devices, int) and not str(devices).isdigit()):
        return
    cores = os.cpu_count() or 1
    if int(devices) > cores and not oversubscribe:
        raise UsageError(f"trainer.devices={devices} asks for {devices} CPU processes, but this machine has "
                         f"{cores} CPU cores (--oversubscribe true starts them anyway, one thread each).")


def check_trainer_values(trainer: Any) -> None:
    """Refuse (:class:`UsageError`, naming the key and value) trainer counts Lightning accepts but divides by.

    Lightning 2.6 checks most trainer arguments when the Trainer is built; these three it takes as they are and
    fails on in the middle of the first epoch, after the run was opened.
    """
    for key, meaning in TRAINER_COUNTS.items():
        value = trainer.get(key) if trainer is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise UsageError(f"trainer.{key}={value} must be >= 1 ({meaning}).")


def _short_class(value: Any) -> str:
    """``a.b.Name`` (or a ``{class_path: ...}`` config) -> ``Name``; other values as text."""
    if isinstance(value, (dict, Namespace)) and value.get("class_path"):
        value = value.get("class_path")
    return str(value).rsplit(".", 1)[-1] if isinstance(value, str) and "." in value and " " not in value \
        else str(value)


def search_tags(cfg: Namespace) -> dict[str, str]:
    """Tags a person filters runs by in MLflow, and the run's description (the command that started it)."""
    trainer = cfg.trainer
    configs = [Path(str(c)).name for c in (cfg.get("config") or [])]
    tags = {
        keys.RECIPE_TAG: " + ".join(configs) or cfg.experiment,
        keys.MODEL_TAG: _short_class(cfg.get("model")),
        keys.DATA_TAG: _short_class(cfg.get("data")),
        keys.STRATEGY_TAG: _short_class(trainer.get("strategy") or "auto"),
        keys.DEVICES_TAG: f"{trainer.get('devices') or 'auto'} x {trainer.get('num_nodes') or 1}",
        keys.PRECISION_TAG: str(trainer.get("precision") or "32-true"),
        keys.MARKET_TAG: str(cfg.cost.get("market")) if cfg.get("cost") else "on_demand",
        "mlflow.note.content": "```\n" + " ".join(redact(a) for a in [Path(sys.executable).name, *sys.argv]) + "\n```",
    }
    from callbacks.manifest import git_state  # here: the resume policy is testable without Lightning

    sha = git_state(Path(__file__).parent).get("sha")
    if sha:
        tags[keys.GIT_SHA_TAG] = sha
    return tags


def global_rank_from_env() -> int:
    """This process's rank as the launcher (torchrun, SLURM, Lightning) announced it; 0 if none."""
    for key in ("RANK", "SLURM_PROCID"):
        if key in os.environ:
            return int(os.environ[key])
    return 0 if os.environ.get("LOCAL_RANK", "0") == "0" else int(os.environ["LOCAL_RANK"])


def launched_by_parent() -> bool:
    """Whether Lightning started this process as a further rank of a CLI process that decided the run."""
    return int(os.environ.get("LOCAL_RANK", "0")) > 0 and ENV_RUN_NAME in os.environ


def default_run_name(args: Sequence[str] | None) -> str:
    """The run's name when ``--run_name`` gives none, the same for every rank and every relaunch of the command.

    A scheduler's job identity where there is one (a SLURM job, a torchrun rendezvous id), else the command's own
    name (:func:`recipes.run.common.command_run_name`): relaunching the same command resumes its run.
    """
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ.get('SLURM_ARRAY_JOB_ID') or os.environ['SLURM_JOB_ID']}" + (
            f"-{os.environ['SLURM_ARRAY_TASK_ID']}" if os.environ.get("SLURM_ARRAY_TASK_ID") else "")
    if os.environ.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return f"torchrun-{os.environ['TORCHELASTIC_RUN_ID']}"
    if args is None:  # a config given as a dict or namespace (a test, a caller of its own): no command to name
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UsageError("several processes were launched without a shared run name: pass --run_name NAME "
                             "(or torchrun --rdzv-id ID) so that every rank writes to the same run.")
        return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    return command_run_name(args)


def torchrun_nodes() -> int | None:
    """The number of nodes in this torchrun rendezvous round, or None when torchrun did not start the process.

    In torchrun's elastic mode (``--nnodes MIN:MAX``) a round has as many nodes as joined it: after a node is
    lost the survivors restart with fewer, so ``trainer.num_nodes`` follows the round (Lightning checks that
    devices x nodes is the world size). ``GROUP_WORLD_SIZE`` is torchrun's count; world / local world is the same.
    """
    if os.environ.get("TORCHELASTIC_RUN_ID", "none") == "none":
        return None
    group = os.environ.get("GROUP_WORLD_SIZE", "")
    if group.isdigit() and int(group) >= 1:
        return int(group)
    world, local = os.environ.get("WORLD_SIZE", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(local) >= 1 and int(world) % int(local) == 0:
        return int(world) // int(local)
    return None


def run_tags() -> dict[str, str] | None:
    """Tags for a new MLflow run from the environment: ``ATSCALE_RUN_TAGS`` (JSON) and a sweep's parent run."""
    tags = json.loads(os.environ.get(ENV_RUN_TAGS) or "{}")
    if os.environ.get(ENV_PARENT_RUN_ID):
        tags["mlflow.parentRunId"] = os.environ[ENV_PARENT_RUN_ID]
    return tags or None


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """Nested config -> ``{"a.b.c": "value"}`` for MLflow params."""
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for key, sub in value.items():
            out.update(flatten(sub, f"{prefix}{key}."))
        return out
    text = json.dumps(value, default=str) if isinstance(value, (list, tuple)) else str(value)
    return {prefix.rstrip("."): redact(text)[:_MAX_PARAM_LENGTH]}


def resumable_change(key: str) -> bool:
    """Whether config key ``key`` may differ on resume (see :data:`RESUMABLE_CHANGES`)."""
    return any(key == p or key.startswith(p + ".") for p in RESUMABLE_CHANGES)


def refused_changes(logged: dict[str, str], params: dict[str, str]) -> list[tuple[str, str, str]]:
    """``(key, logged value, new value)`` of every change a resume would record but not apply."""
    return [(k, logged[k], v) for k, v in sorted(params.items())
            if k in logged and logged[k] != v and not resumable_change(k)]



def refuse_ignored_changes(client: Any, run_id: str, cfg: Namespace, run_name: str,
                           ckpt_path: str | None) -> str | None:
    """Stop a resume whose config changes something the restored training state would override; returns the MLflow
    run this launch continues.

    Without a checkpoint there is no training state to keep: a first launch that failed before its first
    checkpoint (a bug, a value no check caught) never blocks the corrected one, which opens a new MLflow run
    (the failed one keeps the params it ran with; MLflow never changes a logged param).

    Raises:
        UsageError: naming each refused change (old -> new), when a checkpoint would be resumed.
    """
    from mlflow.exceptions import MlflowException

    try:
        logged = client.get_run(run_id).data.params
    except MlflowException:
        return run_id  # a run id from a checkpoint of another store: nothing to compare
    refused = refused_changes(logged, flatten(cfg))
    if refused and not ckpt_path:
        log.warning("MLflow run %s of %s/%s ended before its first checkpoint with another config (%s): this launch "
                    "starts the run over in a new MLflow run.", run_id, cfg.experiment, run_name,
                    ", ".join(k for k, _, _ in refused))
        return None
    if refused:
        changes = ", ".join(f"{k} ({old} -> {new})" for k, old, new in refused)
        raise UsageError(f"run {cfg.experiment}/{run_name} was started with another config; resuming would keep the "
                         f"checkpoint's training state and ignore: {changes}. Relaunch with the original values, or "
                         "start over with --fresh true or a new --run_name.")
    return run_id


def resolve_resume(cfg: Namespace, ctx: RunContext) -> tuple[str | None, str | None]:
    """The checkpoint a launch resumes from and its MLflow run id, by the resume policy (module docstring).

    Raises:
        UsageError: an explicit checkpoint that cannot be used, or checkpoints none of which verifies.
    """
    if launched_by_parent():  # a rank launched by the process that decided
        return os.environ[ENV_CKPT_PATH] or None, os.environ.get(ENV_MLFLOW_RUN_ID) or None
    checkpoint_dir, remote = ctx.checkpoint_dir, ctx.remote_checkpoints()
    if cfg.ckpt_path:
        return explicit_checkpoint(cfg.ckpt_path, checkpoint_dir)
    try:
        if cfg.fresh:
            if global_rank_from_env() == 0:
                suffix = f"before-{time.strftime('%Y%m%d-%H%M%S')}"
                if checkpoint_dir.exists():
                    aside = checkpoint_dir.with_name(f"checkpoints.{suffix}")
                    shutil.move(checkpoint_dir, aside)
                    log.warning("--fresh: previous checkpoints moved to %s", aside)
                if remote is not None and (moved := remote.move_aside(suffix)):
                    log.warning("--fresh: previous checkpoints moved to %s", moved)
            return None, None
        record = ckpt_store.newest_good(checkpoint_dir)
        if remote is not None:
            record = newest_of_bucket_and_staging(remote, record)
            if record is not None:  # the steps the lost machine ran, for the cost
                remote_store.get_if_missing(remote.object_url(PROGRESS_FILE), checkpoint_dir / PROGRESS_FILE)
        unverified = len(remote.records()) if remote is not None else len(ckpt_store.candidates(checkpoint_dir))
    except (OSError, StoreError) as err:
        raise UsageError(f"cannot read the checkpoints of {ctx.location}: {err}") from err
    if record is None and unverified:
        # starting over here would be pruned against the broken records: stop and say so
        raise UsageError(f"none of the {unverified} checkpoint(s) of {ctx.location} verifies (see the warnings "
                         "above); pass --ckpt_path to choose one, or --fresh true to set them aside.")
    if record is None:
        return None, None
    source = remote.object_url(record.path.name) if remote else record.path
    fetched = remote.last_fetch if remote else None
    how = f"; downloaded {fetched[0] / 2**20:.1f} MiB in {fetched[1]:.1f} s" if fetched else ""
    ctx.resume_note = f"Resuming from {source} (step {record.global_step}{how})."
    return str(record.path), record.extra.get("mlflow_run_id")

def newest_of_bucket_and_staging(remote: RemoteCheckpoints, staged: ckpt_store.CheckpointRecord | None,
                                  ) -> ckpt_store.CheckpointRecord | None:
    """The bucket's newest good checkpoint, unless this machine staged a newer one of the same run.

    A relaunch on the same machine after an upload failed (or was killed) must not go back in time:
    the newer staged checkpoint is uploaded first, then resumed from. A staged checkpoint of another
    MLflow run (the bucket was started afresh elsewhere) never wins over the bucket.
    """
    fetched = remote.fetch_newest_good()
    if staged is None:
        return fetched
    if fetched is None:
        newer = not remote.records()  # an empty bucket: every upload of this run failed
    else:
        same_run = staged.extra.get("mlflow_run_id") == fetched.extra.get("mlflow_run_id")
        newer = same_run and staged.global_step > fetched.global_step
    if not newer:
        return fetched
    log.warning("The staged checkpoint %s (step %d) is newer than the bucket's; uploading it first.",
                staged.path, staged.global_step)
    remote.publish(staged.path)
    return staged

def explicit_checkpoint(ckpt_path: str, checkpoint_dir: Path) -> tuple[str, str | None]:
    """``--ckpt_path``: a local checkpoint, or one in object storage downloaded and verified first."""
    if remote_store.is_remote(ckpt_path):
        parent, name = ckpt_path.rstrip("/").rsplit("/", 1)
        try:
            record = RemoteCheckpoints(parent, checkpoint_dir).fetch_named(name)
        except (StoreError, OSError) as err:
            raise UsageError(f"--ckpt_path {ckpt_path}: {err}") from err
        if record is None:
            raise UsageError(f"--ckpt_path {ckpt_path} is incomplete or corrupt (see the warning above).")
        return str(record.path), record.extra.get("mlflow_run_id")
    path = remote_store.local_path(ckpt_path)
    if not path.exists():
        raise UsageError(f"--ckpt_path {ckpt_path} does not exist.")
    local = None
    if ckpt_store.meta_path(path).exists():
        local = ckpt_store.read_record(path)
        if local is None:
            raise UsageError(f"--ckpt_path {ckpt_path} does not match its integrity record (truncated, changed or "
                             "unreadable; see the warning above); nothing was loaded.")
    problem = ckpt_store.rejection(path)  # torch's safe unpickler; an allow-list for distributed metadata
    if problem:
        raise UsageError(f"--ckpt_path {ckpt_path} is not a checkpoint this run can load ({problem}).")
    return str(path), local.extra.get("mlflow_run_id") if local else None


def _belongs(client: Any, run: Any, ctx: RunContext) -> bool:
    """Whether MLflow run ``run`` is the record of the run ``ctx`` describes (not merely one a checkpoint names).

    Its ``atscale.run_dir`` tag names this run's files, or it has this run's experiment and name (the
    run directory was moved, or copied to another machine, with its checkpoints).
    """
    if run.data.tags.get(tracking.RUN_DIR_TAG) == ctx.identity:
        return True
    experiment = client.get_experiment_by_name(ctx.experiment)
    return (experiment is not None and run.info.experiment_id == experiment.experiment_id
            and run.info.run_name == ctx.run_name)


def mlflow_run_of(client: Any, ctx: RunContext, ckpt_path: str | None, ckpt_run_id: str | None,
                  explicit: bool) -> str | None:
    """The MLflow run this launch continues: the run it is launched as, never another run's.

    A checkpoint names the MLflow run that wrote it. That run is continued only if it is this run's own
    record (its ``atscale.run_dir`` tag names this run's files, or it has this run's experiment and name);
    a checkpoint of another run (``--ckpt_path runs/digits/cc/...`` launched as ``other``) starts or
    continues ``other``'s own record instead.
    Otherwise the run's own record is found by its tag (a run killed before its first checkpoint), or
    there is none and a new one is opened.

    Raises:
        UsageError: the newest checkpoint of this run directory was written by an MLflow run this tracking
            store does not hold, and the store has no record of the run (launched against another store):
            continuing silently would split the run's history and skip the config-change check.
    """
    from mlflow.exceptions import MlflowException

    own = tracking.find_run(client, ctx.experiment, ctx.identity)
    if ckpt_run_id is None or ckpt_run_id == own:
        return own
    try:
        run = client.get_run(ckpt_run_id)
    except MlflowException:
        run = None
    if run is not None and _belongs(client, run, ctx):
        return ckpt_run_id
    store = redact(ctx.tracking_uri)
    if run is None and not explicit and own is None:
        raise UsageError(
            f"run {ctx.experiment}/{ctx.run_name} would resume from {ckpt_path}, written by MLflow run {ckpt_run_id}, "
            f"which {store} does not hold (was it launched against another tracking store?). Set "
            "MLFLOW_TRACKING_URI to the store that holds it; or pass --ckpt_path " f"{ckpt_path} to continue "
            "training from it as a new MLflow run in this store; or --fresh true to start over.")
    whose = "an MLflow run this store does not hold" if run is None else "another run's MLflow record"
    target = f"its own MLflow run {own}" if own else f"a new MLflow run in {store}"
    log.warning("--ckpt_path %s was written by %s (%s): %s/%s continues from it as %s.", ckpt_path, whose,
                ckpt_run_id, ctx.experiment, ctx.run_name, target)
    return own


class AlreadyComplete(Exception):
    """The run being relaunched finished already with this config: nothing to train (exit code 0)."""


def stop_if_complete(client: Any, run_id: str, cfg: Namespace, ctx: RunContext, ckpt_path: str) -> None:
    """A FINISHED run relaunched with the same length of training has nothing to do: say so instead of resuming.

    Raises:
        AlreadyComplete: the run finished with these ``max_epochs``/``max_steps``/``max_time``.
    """
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException:
        return
    length = {k: v for k, v in flatten(cfg).items() if k in ("trainer.max_epochs", "trainer.max_steps",
                                                             "trainer.max_time")}
    if run.info.status != "FINISHED" or any(run.data.params.get(k, v) != v for k, v in length.items()):
        return
    record = ckpt_store.read_record(ckpt_path, verify_hash=False)
    step = f" at step {record.global_step}" if record else ""
    monitor = cfg.checkpoint.monitor
    metric = run.data.metrics.get(monitor) if monitor else None
    shown = f", {monitor} {metric:.4f}" if metric is not None else ""
    raise AlreadyComplete(f"run {cfg.experiment}/{ctx.run_name} is already complete (finished{step}{shown}; "
                          f"MLflow run {run_id}). To train longer, relaunch with a larger --trainer.max_epochs (or "
                          "--trainer.max_steps); to start over, add --fresh true or choose a new --run_name.")


def decide_start(cfg: Namespace, ctx: RunContext) -> dict[str, Any]:
    """Where the run starts, decided once for the job: the checkpoint, the MLflow run, the note to print.

    Raises:
        UsageError: the resume policy refuses (see :func:`resolve_resume`, :func:`refuse_ignored_changes`).
        AlreadyComplete: nothing to train.
    """
    ckpt_path, run_id = resolve_resume(cfg, ctx)
    if not launched_by_parent() and not cfg.fresh:
        import mlflow

        client = mlflow.MlflowClient(ctx.tracking_uri)
        # the run's own MLflow record (also of a run killed before its first checkpoint), never the one a
        # checkpoint of another run names
        run_id = mlflow_run_of(client, ctx, ckpt_path, run_id, explicit=bool(cfg.ckpt_path))
        if run_id:
            run_id = refuse_ignored_changes(client, run_id, cfg, ctx.run_name, ckpt_path)
            if ckpt_path and not cfg.ckpt_path:
                stop_if_complete(client, run_id, cfg, ctx, ckpt_path)
    return {"ckpt_path": ckpt_path, "mlflow_run_id": run_id, "note": ctx.resume_note}


def checkpoint_here(decided: str | None, cfg: Namespace, ctx: RunContext) -> str | None:
    """The local path of the checkpoint global rank 0 decided to resume from, fetched if this machine lacks it.

    Raises:
        UsageError: the checkpoint is on rank 0's disk only (a local ``--runs_root`` that this machine does
            not share): training would start apart from rank 0.
    """
    if decided is None or Path(decided).exists():
        return decided
    if cfg.ckpt_path:
        return explicit_checkpoint(cfg.ckpt_path, ctx.checkpoint_dir)[0]
    remote = ctx.remote_checkpoints()
    try:
        record = remote.fetch_named(Path(decided).name) if remote is not None else None
    except (StoreError, OSError) as err:
        raise UsageError(f"cannot fetch {Path(decided).name}, the checkpoint global rank 0 resumes from, from "
                         f"{ctx.location}: {err}") from err
    if record is None:
        raise UsageError(f"rank {global_rank_from_env()} cannot find {decided}, the checkpoint global rank 0 resumes "
                         "from, on this machine: give every node the same --runs_root (a shared filesystem, or an "
                         "object-storage URL such as s3://bucket/runs).")
    return str(record.path)
