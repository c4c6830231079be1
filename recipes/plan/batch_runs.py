"""What a run says for the batch-size planner, read from MLflow: noise scale, batch, steps, step time.

``python -m recipes.plan batch --run`` and ``--step-time-runs`` read these; :mod:`recipes.plan.batch_train`
reads its own training runs through :func:`read_run` too. A run's global batch is GradientNoiseScale's
``noise_scale/batch_used``, else ``data.init_args.batch_size`` x ``trainer.accumulate_grad_batches``; its
steps to a target are the first logged step at which the metric reached it. mlflow is imported only when a
client is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from callbacks.analysis.keys import B_NOISE_KEY, NOISE_BATCH_USED_KEY, STEP_KEY
from recipes.run.common import UsageError, tracking_uri

if TYPE_CHECKING:
    from mlflow import MlflowClient

__all__ = [
    "BATCH_PARAM",
    "Reference",
    "measured_steps_to",
    "read_run",
    "store_client",
]

BATCH_PARAM = "data.init_args.batch_size"
ACCUMULATE_PARAM = "trainer.accumulate_grad_batches"


def _reached(key: str, value: float, target: float) -> bool:
    return value <= target if key.endswith("<=") else value >= target


def store_client() -> tuple[MlflowClient, str]:
    import mlflow

    uri = tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        raise UsageError(f"no MLflow store at {uri}: set MLFLOW_TRACKING_URI to the store that tracked the runs.")
    return mlflow.MlflowClient(tracking_uri=uri), uri


def _run(client: MlflowClient, run_id: str, uri: str) -> Any:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException:
        raise UsageError(f"unknown run {run_id!r}: no such MLflow run in {uri}.") from None


def _global_batch(run: Any) -> int | None:
    """The run's global batch: GradientNoiseScale's ``batch_used``, else batch_size x accumulation (one process)."""
    if NOISE_BATCH_USED_KEY in run.data.metrics and run.data.metrics[NOISE_BATCH_USED_KEY] > 0:
        return int(run.data.metrics[NOISE_BATCH_USED_KEY])
    params = run.data.params
    try:
        return int(params[BATCH_PARAM]) * int(params.get(ACCUMULATE_PARAM, "1") or 1)
    except (KeyError, ValueError):
        return None


def measured_steps_to(client: MlflowClient, run_id: str, target: tuple[str, float] | None) -> int | None:
    """First logged step at which the target metric reached its value; without a target, the last step."""
    if target is None:
        run = client.get_run(run_id)
        return max((m.step for k in run.data.metrics if not k.startswith("system/")
                    for m in client.get_metric_history(run_id, k)), default=None)
    key, value = target
    for m in sorted(client.get_metric_history(run_id, key.removesuffix("<=")), key=lambda m: m.step):
        if _reached(key, m.value, value):
            return int(m.step)
    return None


@dataclass(frozen=True)
class Reference:
    """What one run says: its noise scale, global batch, steps to the target and step time."""

    run_id: str
    b_noise: float | None
    batch: int | None
    steps: int | None
    step_s: float | None
    per_device_batch: int | None


def read_run(client: MlflowClient, run_id: str, uri: str, target: tuple[str, float] | None) -> Reference:
    run = _run(client, run_id, uri)
    metrics = run.data.metrics
    try:
        per_device = int(run.data.params[BATCH_PARAM])
    except (KeyError, ValueError):
        per_device = None
    return Reference(run_id=run_id, b_noise=metrics.get(B_NOISE_KEY), batch=_global_batch(run),
                     steps=measured_steps_to(client, run_id, target), step_s=metrics.get(STEP_KEY),
                     per_device_batch=per_device)
