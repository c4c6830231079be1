"""What ``bench overhead|fit`` (:mod:`recipes.bench`) and ``bench gpu`` (:mod:`recipes.bench.gpu`) both run.

The step stopwatch (:class:`Stopwatch`), the full recipe in this process less chosen default pieces
(:func:`run_full_recipe`, :data:`PIECES`), and the memory-copy floor of a checkpoint's staging
(:func:`tensors_copy_floor`). It imports neither benchmark module: both import it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from callbacks.timing import StepTiming


class Stopwatch(Callback):
    """``time.perf_counter()`` at the end of every training batch."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        #: Seconds ``trainer.fit`` took, when :func:`run_full_recipe` timed it.
        self.fit_s: float | None = None

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.ends.append(time.perf_counter())



#: The default pieces of the full recipe that ``overhead --ablate`` turns off one at a time.
PIECES = {
    "mlflow": "MLflow logging (logger, params, metrics; system metrics go with it)",
    "system_metrics": "MLflow system metrics thread",
    "progress_bar": "rich progress bar",
    "spot": "spot callback (SpotCheckpoint)",
    "cost": "cost tracker (CostTracker)",
    "checkpointing": "best checkpoint (ModelCheckpoint)",
    "baselines": "baselines (scikit-learn, at fit start)",
    "manifest": "manifest (at fit start)",
    "log_model": "model logging (at fit end)",
    "timing": "StepTiming",
    "timing_plot": "StepTiming's time_breakdown.png (at train end)",
}


def _piece_classes() -> dict[str, tuple[type, ...]]:
    from callbacks.baselines import Baselines
    from callbacks.cost import CostTracker
    from callbacks.lm_baselines import LMBaselines
    from callbacks.manifest import Manifest
    from callbacks.spot import SpotCheckpoint
    from callbacks.throughput import TokenThroughput

    return {"spot": (SpotCheckpoint,), "cost": (CostTracker,), "checkpointing": (ModelCheckpoint,),
            "baselines": (Baselines,), "manifest": (Manifest,), "timing": (StepTiming,),
            "lm_baselines": (LMBaselines,), "token_throughput": (TokenThroughput,)}


def run_full_recipe(recipe: Sequence[str], root: Path, index: int, without: frozenset[str] = frozenset(),
                    watch: Stopwatch | None = None, also: Sequence[Callback] = (),
                    keep_files: bool = True) -> tuple[list[float], float]:
    """The full recipe (less the pieces named in ``without``, see :data:`PIECES`): (step ends, fit seconds).

    Args:
        recipe: the CLI arguments of the model, data and trainer (``recipes.bench.mlp_recipe`` gives the
            benchmark's MLP on one CPU).
        root: the run's files (``runs/``, ``default_root/``, and its stdout in ``<tag>-<index>.log``).
        index: the round, in the run's name and log file's.
        without: the default pieces to turn off.
        watch: the stopwatch to append (default a new :class:`Stopwatch`).
        also: more callbacks to append after it (measuring ones: they are not part of the recipe).
        keep_files: keep the run's checkpoints and MLflow artifacts (``runs/``, ``mlruns/``) once it is
            over; without, a benchmark's disk stays bounded (20 MB a GPT round, GBs over hundreds). Its
            log, and its metrics in the store, stay either way.

    Raises:
        RuntimeError: if the recipe's fit exits non-zero.
    """
    from recipes.run.cli import AtscaleCLI
    from recipes.run.common import ENV_CKPT_PATH, ENV_MLFLOW_RUN_ID, ENV_RUN_NAME

    for key in (ENV_CKPT_PATH, ENV_MLFLOW_RUN_ID, ENV_RUN_NAME):
        os.environ.pop(key, None)  # set by a previous in-process run
    extra: list[str] = []
    if "mlflow" in without:
        extra += ["--trainer.logger", "false"]
    if "progress_bar" in without:
        extra += ["--trainer.enable_progress_bar", "false"]
    if "log_model" in without:
        extra += ["--log_model", "false"]
    if "system_metrics" in without:
        extra += ["--system_metrics", "false"]
    tag = "-".join(sorted(without)) or "full"
    cli = AtscaleCLI(args=[
        *recipe, "--run_name", f"{tag}-{time.strftime('%H%M%S')}-{index}",
        "--runs_root", str(root / "runs"), "--trainer.default_root_dir", str(root / "default_root"), *extra])
    removed = tuple(cls for piece in without for cls in _piece_classes().get(piece, ()))
    if removed:
        cli.trainer.callbacks = [cb for cb in cli.trainer.callbacks if not isinstance(cb, removed)]
    watch = watch or Stopwatch()
    original_fit = cli.trainer.fit

    def timed_fit(*fit_args: Any, **fit_kwargs: Any) -> Any:  # trainer.fit alone, inside the CLI's fit flow
        started = time.perf_counter()
        try:
            return original_fit(*fit_args, **fit_kwargs)
        finally:
            watch.fit_s = time.perf_counter() - started

    cli.trainer.fit = timed_fit  # type: ignore[method-assign]
    if "timing" not in without and not any(isinstance(cb, StepTiming) for cb in cli.trainer.callbacks):
        cli.trainer.callbacks.append(StepTiming())
    for callback in cli.trainer.callbacks:
        if isinstance(callback, StepTiming) and "timing_plot" in without:
            callback.plot = False
    cli.trainer.callbacks.append(watch)
    cli.trainer.callbacks.extend(also)
    with open(root / f"{tag}-{index}.log", "w") as log_file, contextlib.redirect_stdout(log_file):
        started = time.perf_counter()
        code = cli.fit()  # its progress bar and end table go to a file, as in a batch job
        fit_s = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"full recipe run ({tag}) exited with {code}")
    if not keep_files:
        for files in (root / "runs", root / "mlruns"):  # every run in them is over: runs go one at a time
            shutil.rmtree(files, ignore_errors=True)
    return watch.ends, fit_s


def tensors_copy_floor(state: Sequence[torch.Tensor], repeats: int = 5) -> dict[str, float]:
    """The memory-copy floor of a consistent snapshot of ``state``, as a checkpoint's staging makes it.

    ``copy_s``: median of ``repeats`` ``copy_``-es into buffers allocated beforehand: host memory for
    host tensors; for CUDA tensors pinned host memory (``torch.empty(..., pin_memory=True)``), copied
    with ``non_blocking`` and timed up to ``torch.cuda.synchronize()``: the device-to-host floor.
    ``clone_s``: the same snapshot into fresh memory (``clone()``; ``.cpu()`` for CUDA tensors).

    Returns:
        ``{"copy_s", "clone_s", "bytes", "pinned"}`` (``pinned``: 1.0 when the buffers were pinned).
    """
    cuda = any(t.is_cuda for t in state)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) if t.is_cuda else torch.empty_like(t)
               for t in state]
    copies, clones = [], []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        for buffer, tensor in zip(buffers, state, strict=True):
            buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        sync()
        copies.append(time.perf_counter() - started)
        started = time.perf_counter()
        cloned = [t.cpu() if t.is_cuda else t.clone() for t in state]
        sync()
        clones.append(time.perf_counter() - started)
        del cloned
    return {"copy_s": statistics.median(copies), "clone_s": statistics.median(clones),
            "bytes": float(sum(t.numel() * t.element_size() for t in state)), "pinned": float(cuda)}


def from_spec(spec: dict[str, Any]) -> Any:
    """``{class_path, init_args}`` of a config -> a callable that builds it with the remaining arguments."""
    import functools
    import importlib

    module, name = spec["class_path"].rsplit(".", 1)
    return functools.partial(getattr(importlib.import_module(module), name), **spec.get("init_args", {}))


def own_store_uri(root: Path) -> str:
    """The tracking URI of a benchmark's own MLflow store in ``root``."""
    return f"sqlite:///{root / 'mlflow.db'}"


@contextlib.contextmanager
def own_store(root: Path) -> Any:
    """``root`` created, and the recipe's MLflow store in it unless ``MLFLOW_TRACKING_URI`` names one."""
    from unittest import mock

    root.mkdir(parents=True, exist_ok=True)
    with mock.patch.dict(os.environ):
        os.environ.setdefault("MLFLOW_TRACKING_URI", own_store_uri(root))
        yield root
