"""The recipes' couplings to private internals of CPython, Lightning and MLflow, each in one place.

Each reaches into something its library does not promise to keep, because no public route does the
job; ``tests/unit/recipes/run/test_compat.py`` has a test per coupling that fails, naming it, when an
upgrade breaks it. Checked against CPython 3.11-3.12, lightning 2.6 and mlflow 3.17:

- ``threading._shutdown`` and ``atexit._run_exitfuncs``, what the interpreter's exit runs before its
  finalization, stay in ``recipes/run/shutdown.py``, which users copy alone; ``tests/unit/recipes/run/test_shutdown.py``
  fails when they break.
- :func:`system_metrics_monitor`: MLflow's system-metrics sampler, whose class lives in a module MLflow does
  not export; started by hand to continue a resumed run's samples from their last step.
- :func:`mlflow_schema_head`: the alembic revision MLflow's SQL store is at when complete; the chaos soak's
  observer (``recipes/soak/observe.py``'s ``Store``) opens an ``MlflowClient`` only on a store at it, since a client
  migrates one below it.
- :data:`MODEL_CHECKPOINT_PATH_KEYS`: the keys of ModelCheckpoint's saved state that hold absolute paths,
  which ``recipes/run/cli_callbacks.py`` points at the run's directory on the machine that resumes it
  (Lightning keeps the best-k record only when the directory is unchanged, and has no hook to move it).
- A method override (not a function, so it stays in its class; its signature is tested here):
  ``LightningCLI._instantiate_trainer`` in ``recipes/run/cli.py`` (the one hook that receives the trainer's
  config and the callbacks from the config together). The callbacks' overrides are base classes in
  ``callbacks/utils/compat.py``.
- :func:`async_write_state`: whether an MLflow async write (the ``RunOperations`` a ``log_batch(...,
  synchronous=False)`` returns) is done and how it ended; ``RunOperations`` offers only a blocking ``wait()``.
- :func:`jsonargparse_error_line`: jsonargparse's parse error read from its words (``Parser key "..."``, ``Given
  value: ...``, ``Expected a <class '...'>``): it raises an ``ArgumentError`` whose only content is that text (its
  ``argument_name`` is None), so the key and the bad value are in the words alone (jsonargparse 4.53).
- :func:`gloo_lost_peer`: a lost peer rank read from gloo's words. torch (2.14) raises gloo's transport error as a
  plain ``RuntimeError``, not as ``torch.distributed.DistNetworkError``; that type comes only from the rendezvous
  store's socket, and there it also means a store that never answered (a wrong address: a requeue would loop), and
  ``DistBackendError`` is any failure of a backend (NCCL's). No type says "the peer was there and is gone".
- :data:`MLFLOW_TRACKING_CLIENT_LOGGER`: the logger of MLflow's tracking client, named for the private module it
  lives in (``mlflow.tracking._tracking_service``); it prints a full store's failed writes, each with a traceback.
- :func:`set_model_parallel_sizes`: Lightning's ``ModelParallelStrategy`` resolves its ``"auto"`` sizes in
  ``setup_environment`` from attributes it keeps to itself; a strategy with a data-parallel mesh of every process
  (``recipes/strategies.py``) sets them first.
- :func:`stale_heartbeat_trial_ids`: the RUNNING trials whose Optuna heartbeat is older than the storage's grace
  period, without failing them: ``RDBStorage._get_stale_trial_ids`` (the abstract method every Optuna heartbeat
  storage implements; checked on Optuna 5.1); its only public caller, ``optuna.storages.fail_stale_trials``, FAILs
  them, and a sweep hands a stale trial back to WAITING as itself (``recipes/sweep/study.py``).
- :class:`HelpFormatter`: argparse's ``HelpFormatter._get_help_string``, the one hook that decides whether an
  option's help says its default (argparse documents its formatter classes' names, not their methods).
- :func:`init_mlflow_logger_without_client`: what ``MLFlowLogger.__init__`` sets, without the MLflow client it also
  builds on every rank (importing MLflow: about 1.6 CPU-seconds a process) though only global rank 0 uses one
  (``experiment`` is ``rank_zero_experiment``, the ``log_*`` methods ``rank_zero_only``); Lightning offers no
  lazy client. The attributes are Lightning's private ones.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

#: The logger of MLflow's tracking client (``logging.getLogger(__name__)`` in a private module).
MLFLOW_TRACKING_CLIENT_LOGGER = "mlflow.tracking._tracking_service.client"

#: ``ModelCheckpoint.state_dict()``'s keys that hold one absolute path each; ``best_k_models`` maps paths to scores.
MODEL_CHECKPOINT_PATH_KEYS = ("dirpath", "best_model_path", "kth_best_model_path", "last_model_path")
MODEL_CHECKPOINT_BEST_K_KEY = "best_k_models"


def system_metrics_monitor(run_id: str, **kwargs: Any) -> Any:
    """MLflow's ``SystemMetricsMonitor`` for ``run_id`` (None when MLflow's system metrics cannot run here)."""
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
    except ImportError:  # psutil missing
        return None
    return SystemMetricsMonitor(run_id, **kwargs)


def init_mlflow_logger_without_client(logger: Any, experiment_name: str = "lightning_logs", run_name: str | None = None,
                                      tracking_uri: str | None = None, tags: dict[str, Any] | None = None,
                                      save_dir: str | None = "./mlruns", log_model: Any = False, prefix: str = "",
                                      artifact_location: str | None = None, run_id: str | None = None,
                                      synchronous: bool | None = None) -> None:
    """``MLFlowLogger.__init__(logger, ...)`` (same arguments, Lightning 2.6) but with no MLflow client and no MLflow
    import: the logger of a rank other than global rank 0."""
    from lightning.pytorch.loggers.logger import Logger
    from lightning.pytorch.loggers.mlflow import LOCAL_FILE_URI_PREFIX

    Logger.__init__(logger)
    logger._experiment_name = experiment_name
    logger._experiment_id = None
    logger._tracking_uri = tracking_uri or f"{LOCAL_FILE_URI_PREFIX}{save_dir}"
    logger._run_name = run_name
    logger._run_id = run_id
    logger.tags = tags
    logger._log_model = log_model
    logger._logged_model_time = {}
    logger._checkpoint_callback = None
    logger._prefix = prefix
    logger._artifact_location = artifact_location
    logger._log_batch_kwargs = {} if synchronous is None else {"synchronous": synchronous}
    logger._initialized = False
    logger._mlflow_client = None


def set_model_parallel_sizes(strategy: Any, data_parallel: int, tensor_parallel: int) -> None:
    """The device mesh a Lightning ``ModelParallelStrategy`` builds in its ``setup_environment``: ``data_parallel`` x
    ``tensor_parallel`` (the sizes its constructor took, "auto" resolved by the caller)."""
    strategy._data_parallel_size = data_parallel
    strategy._tensor_parallel_size = tensor_parallel


def stale_heartbeat_trial_ids(storage: Any, study_id: int) -> set[int]:
    """The ids of ``study_id``'s RUNNING trials whose heartbeat in ``storage`` (an Optuna heartbeat storage) is
    older than its grace period."""
    return set(storage._get_stale_trial_ids(study_id))


def mlflow_schema_head() -> str:
    """The alembic revision of a complete MLflow SQL store (MLflow checks a store against it as its client opens it)."""
    from mlflow.store.db.utils import _get_latest_schema_revision

    return _get_latest_schema_revision()


def async_write_state(operation: Any) -> tuple[bool, BaseException | None]:
    """``(done, error)`` of an MLflow ``RunOperations`` without blocking: its futures, all done, and the first
    one's exception (a write the store refused)."""
    futures = operation._operation_futures
    if not all(future.done() for future in futures):
        return False, None
    return True, next((f.exception() for f in futures if f.exception() is not None), None)


def jsonargparse_error_line(message: str) -> str:
    """jsonargparse's parse error cut to one line: the key, what it expects, the value given (else its first lines).

    jsonargparse nests every Union alternative it tried (``LightningModule | None`` and so on) into a dozen lines;
    a person needs the key and the bad value, which it says only in those words.
    """
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    keys = re.findall(r'Parser key "([^"]+)"', message)
    nested = re.findall(r"NestedArg\(key='([^']+)', val='([^']*)'\)", message)
    given = re.findall(r"Given value: (.*)", message)
    expected = [e for e in re.findall(r"Expected a <class '([\w.]+)'>", message) if e != "NoneType"]
    problem = re.findall(r"Problem with given class_path '[^']+':\s*(?!Parser key)(.+)", message)
    if not keys and message.startswith("Does not validate against any of the Union subtypes"):
        # a class's own error while jsonargparse instantiated it (say ImageClassifier's bad cost matrix)
        errors = [e for e in re.findall(r"^\s*- (.+)$", message, re.MULTILINE) if "NoneType" not in e]
        return errors[0] if errors else " ".join(lines[:2])
    if keys and nested:
        key, value = f"{keys[0]}.init_args.{nested[-1][0]}", nested[-1][1]
    elif keys and given:
        key, value = keys[0], given[-1]
    else:
        return " ".join(lines[:2]) if lines else message
    if expected:
        return f"{key}: expected {expected[0].rsplit('.', 1)[-1]}, got {value!r}"
    if problem:
        return f"{key}: {problem[-1]}"
    return f"{key}: invalid value {value!r}"


#: gloo's transport (TCP) saying its peer process is gone: the words and the peer's address.
_GLOO_LOST_PEER = re.compile(r"gloo/transport/tcp/\S+\] (?:Read error )?(?:\[(?P<addr1>[^\]]+)\]:(?P<port1>\d+): )?"
                             r"(?P<what>Connection (?:reset|closed) by peer)(?: \[(?P<addr2>[^\]]+)\]:(?P<port2>\d+))?")


def gloo_lost_peer(error: BaseException) -> str | None:
    """``"Connection reset by peer at host:port"`` when ``error`` is gloo's saying a peer's connection is gone."""
    match = _GLOO_LOST_PEER.search(str(error))
    if not match:
        return None
    addr, port = match["addr1"] or match["addr2"], match["port1"] or match["port2"]
    return f"{match['what']} at {addr}:{port}" if addr else match["what"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, except one that says nothing (``None``, ``False``, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default in ([], (), ""):
            return action.help
        return super()._get_help_string(action)
