"""A per-sample trace of training, for resume tests: which samples each rank trained, in which epoch.

Add it to a run from the CLI::

    --trainer.callbacks+=tests.sample_trace.SampleTrace --trainer.callbacks.path=TRACE_DIR

Every training batch that reached its optimizer step appends one line per sample to
``TRACE_DIR/rank<R>.txt``: ``epoch global_step sha1-of-the-input``. A digits image has no index of its
own; its bytes name it (identical images count as one name with a multiplicity, see :func:`epoch_counts`).
"""

from __future__ import annotations

import collections
import hashlib
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

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        lines = "".join(f"{trainer.current_epoch} {trainer.global_step} {sample_key(x)}\n" for x in batch[0])
        with open(self.path / f"rank{trainer.global_rank}.txt", "a") as handle:
            handle.write(lines)


def epoch_counts(path: Path) -> dict[int, collections.Counter]:
    """Per epoch, how many times each sample name was trained, over every rank and every launch."""
    out: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for file in sorted(Path(path).glob("rank*.txt")):
        for line in file.read_text().splitlines():
            epoch, _, key = line.split()
            out[int(epoch)][key] += 1
    return dict(out)


def split_counts(dataset: Any) -> collections.Counter:
    """How many times each sample name occurs in a training set (the count every epoch must match)."""
    return collections.Counter(sample_key(dataset[i][0]) for i in range(len(dataset)))
