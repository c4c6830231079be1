"""The datamodules' couplings to private parts of torchdata's ``StatefulDataLoader`` state and of litdata, one place.

``StatefulDataLoader.state_dict()`` is documented as opaque; its keys are underscored. The resumable loader
(``loaders.py``) needs three facts from it that no public API gives: how many workers the loader that took it had
(torchdata restores a state only into a loader with as many), where the sampler stood at the last batch handed out
(with workers, the sampler in the main process has run ahead by the batches they prefetched) and whether the
iterator finished its pass. ``tests/unit/datamodules/test_compat.py`` and ``test_loader_worker_count.py`` check
them against a real loader, with and without workers, and fail naming the key when an upgrade moves it (checked:
torchdata 0.11).

litdata writes each chunk's item layout (``index.json``'s ``data_spec``) as a serialized pytree spec, and reads it
back with ``treespec_loads`` from a private module; its item loader is set up with its serializers, made by a private
function. :func:`item_loader` is litdata's own reader of a chunk's items, set up as litdata sets it up
(``tests/unit/datamodules/test_streaming.py`` decodes prepared chunks with it and compares litdata's own
``StreamingDataset`` item by item; checked: litdata 0.2.76).
"""

from __future__ import annotations

from typing import Any

__all__ = ["item_loader", "iterator_finished", "sampler_state", "saved_num_workers", "served_sampler_state",
           "with_sampler_state"]


def served_sampler_state(state: dict[str, Any]) -> Any:
    """The sampler's state at the last batch the loader handed out, from its workers' snapshot (None without one)."""
    main = (state.get("_snapshot") or {}).get("_main_snapshot") or {}
    return (main.get("_sampler_iter_state") or {}).get("sampler_state")


def sampler_state(state: dict[str, Any]) -> Any:
    """The sampler's state as the loader saved it for a loader without workers (None if absent)."""
    return (state.get("_sampler_iter_state") or {}).get("sampler_state")


def with_sampler_state(state: dict[str, Any], sampler: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the sampler's state (as :func:`sampler_state` reads it) replaced by ``sampler``."""
    return {**state, "_sampler_iter_state": {**(state.get("_sampler_iter_state") or {}), "sampler_state": sampler}}


def iterator_finished(state: dict[str, Any]) -> bool:
    """Whether the loader's iterator had run to the end of its pass when the state was taken."""
    return bool(state.get("_iterator_finished", False))


def saved_num_workers(state: dict[str, Any]) -> int | None:
    """The number of worker processes of the loader that took ``state``: 0 without workers, None if unrecognised."""
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, dict):
        count = (snapshot.get("_main_snapshot") or {}).get("_num_workers")
        return int(count) if count is not None else None
    return 0 if "_num_yielded" in state else None


def item_loader(index: dict[str, Any]) -> Any:
    """litdata's ``PyTreeLoader`` set up for a split's ``index.json`` (what decodes one item's bytes)."""
    from litdata.streaming.item_loader import PyTreeLoader
    from litdata.streaming.serializers import _get_serializers
    from litdata.utilities._pytree import treespec_loads

    loader = PyTreeLoader()
    loader.setup({**index["config"], "data_spec": treespec_loads(index["config"]["data_spec"])}, index["chunks"],
                 _get_serializers(None))
    return loader
