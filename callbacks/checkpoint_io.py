"""A checkpoint IO that publishes every file atomically with an integrity record.

Lightning's ``TorchCheckpointIO`` already writes through a temporary file, but leaves nothing
that tells a complete checkpoint from one cut short after the rename of a copied file, nor a
way to find the newest good one. This IO writes with fsync + rename and then the checkpoint's
``.meta.json`` record (size, SHA-256, step, and the ``atscale`` block a callback puts in the
checkpoint, e.g. the MLflow run id), so a resume can verify before it trusts.

Wrap it in Lightning's ``AsyncCheckpointIO`` to write in a background thread (tensors are
cloned on the caller's thread first).

Example::

    trainer = Trainer(plugins=[AtomicCheckpointIO()])
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

from callbacks import ckpt_store

#: Key of the checkpoint's block of run metadata, copied into the integrity record.
RUN_METADATA_KEY = "atscale"


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temporary file, fsync, rename, then write the integrity record."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got {storage_options!r}).")
        try:
            size, sha256 = ckpt_store.atomic_write(path, lambda handle: torch.save(checkpoint, handle))
        except OSError as err:  # ENOSPC, EDQUOT, EIO...: say what was kept, keep the errno
            raise OSError(err.errno, f"could not write checkpoint {path} ({err.strerror or err}); "
                                     "nothing was replaced: the previous checkpoints are intact") from err
        ckpt_store.write_record(
            path,
            global_step=checkpoint.get("global_step", 0),
            epoch=checkpoint.get("epoch", 0),
            size=size,
            sha256=sha256,
            extra=dict(checkpoint.get(RUN_METADATA_KEY, {})),
        )

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        ckpt_store.remove(path)
