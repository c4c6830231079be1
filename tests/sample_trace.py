"""A per-sample trace of training, for resume tests: which samples each rank trained, in which epoch.

Add it to a run from the CLI::

    --trainer.callbacks+=tests.sample_trace.SampleTrace --trainer.callbacks.path=TRACE_DIR

Every training batch that reached its optimizer step appends one line per sample to
``TRACE_DIR/rank<R>.txt``: ``epoch global_step sha1-of-the-input launch``. A digits image has no index of its
own; its bytes name it (identical images count as one name with a multiplicity, see :func:`epoch_counts`).
Each launch also appends ``launch resumed_step`` to ``TRACE_DIR/launches.txt``: a launch that crashed trained
steps past its last checkpoint that the next one trains again, and only the kept ones count.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


def sample_key(x: torch.Tensor) -> str:
    """The name of one sample: the SHA-1 of its input tensor's bytes."""
    return hashlib.sha1(x.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


class SampleTrace(Callback):
    """Append the samples of every trained batch to ``path/rank<R>.txt`` (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.launch = 0

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.launch = trainer.strategy.broadcast(time.time_ns(), src=0)  # one id for every rank of this launch
        if trainer.is_global_zero:
            self.path.mkdir(parents=True, exist_ok=True)
            with open(self.path / "launches.txt", "a") as handle:
                handle.write(f"{self.launch} {trainer.global_step}\n")

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        lines = "".join(f"{trainer.current_epoch} {trainer.global_step} {sample_key(x)} {self.launch}\n"
                        for x in batch[0])
        with open(self.path / f"rank{trainer.global_rank}.txt", "a") as handle:
            handle.write(lines)


def epoch_counts(path: Path) -> dict[int, collections.Counter]:
    """Per epoch, how many times each sample name was trained, over every rank and every launch.

    Steps a launch trained past the step the next launch resumed from (lost with a crash) do not count.
    """
    record = Path(path) / "launches.txt"
    launches = sorted(tuple(map(int, line.split())) for line in record.read_text().splitlines()) \
        if record.exists() else []
    # a launch keeps the steps up to where the next one resumed; the last one keeps all it trained
    kept_until = {launch[0]: following[1] for launch, following in itertools.pairwise(launches)}
    out: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for file in sorted(Path(path).glob("rank*.txt")):
        for line in file.read_text().splitlines():
            epoch, step, key, launch = line.split()
            if int(step) <= kept_until.get(int(launch), int(step)):
                out[int(epoch)][key] += 1
    return dict(out)


def split_counts(dataset: Any) -> collections.Counter:
    """How many times each sample name occurs in a training set (the count every epoch must match)."""
    return collections.Counter(sample_key(dataset[i][0]) for i in range(len(dataset)))
