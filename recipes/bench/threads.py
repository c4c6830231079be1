"""Where a run's CPU goes beside the training step: each thread's CPU time over a window of training batches.

On a machine whose cores the step's own threads keep busy, every other thread that runs (MLflow's metric
writer, its system-metrics sampler, the progress bar's refresh thread, the checkpoint writer) takes a core,
and, while it runs Python, the interpreter lock, from the step. An ablation cannot resolve costs this small
against a machine's drift; the threads' own CPU time, read from the kernel (``psutil``), can.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import lightning.pytorch as pl
import psutil
from lightning.pytorch import Callback, Trainer
from typing_extensions import override

#: Threads of the run named by what they do; the key is the thread's name less its counter (or, for an
#: unnamed ``Thread`` subclass, its class's name).
THREAD_ROLES = {
    "MainThread": "training thread",
    "MLflowBatchLoggingWorkerPool": "MLflow metric writer",
    "MLflowAsyncLoggingLoop": "MLflow metric queue",
    "MLflowAsyncLoggingStatusCheck": "MLflow metric queue's status check",
    "SystemMetricsMonitor": "MLflow system metrics",
    "_RefreshThread": "progress bar refresh",
    "ThreadPoolExecutor": "checkpoint writer (thread pool)",
}
#: Threads the interpreter does not know: torch's intra-op (OpenMP) workers, part of the step itself.
NATIVE = "torch intra-op threads (native)"


def thread_role(thread: threading.Thread) -> str:
    """What a thread does, by its name without the counter Python or a pool appends (``Thread-3`` -> its class)."""
    name = re.sub(r"[-_]\d+(_\d+)?$", "", thread.name)
    if name == "Thread":
        name = type(thread).__name__
    return THREAD_ROLES.get(name, name)


def cpu_by_role() -> dict[str, float]:
    """CPU seconds (user + system) each role's threads in this process have used so far."""
    roles = {t.native_id: thread_role(t) for t in threading.enumerate() if t.native_id is not None}
    seconds: dict[str, float] = {}
    for thread in psutil.Process().threads():
        role = roles.get(thread.id, NATIVE)
        seconds[role] = seconds.get(role, 0.0) + thread.user_time + thread.system_time
    return seconds


class ThreadCpuWindow(Callback):
    """Each role's CPU seconds between the ends of training batches ``first`` and ``last`` (counted from 1),
    as a share of one core over that window's wall time: :attr:`shares` (and :attr:`wall_s`) once the last
    batch ends."""

    def __init__(self, first: int, last: int) -> None:
        if not 1 <= first < last:
            raise ValueError(f"ThreadCpuWindow(first={first}, last={last}): expected 1 <= first < last.")
        self.first, self.last = first, last
        self._batches = 0
        self._start: tuple[float, dict[str, float]] | None = None
        self.shares: dict[str, float] = {}
        self.wall_s = 0.0

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._batches += 1
        if self._batches == self.first:
            self._start = (time.perf_counter(), cpu_by_role())
        elif self._batches == self.last and self._start is not None:
            started, before = self._start
            after = cpu_by_role()
            self.wall_s = time.perf_counter() - started
            # a thread that ended inside the window is gone from `after`: its share is not counted
            self.shares = {role: (after[role] - before.get(role, 0.0)) / self.wall_s for role in after}
