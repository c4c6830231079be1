"""The datamodules' couplings to private parts of torchdata's ``StatefulDataLoader`` state, each in one place.

``StatefulDataLoader.state_dict()`` is documented as opaque; its keys are underscored. The resumable loader
(``loaders.py``) needs two facts from it that no public API gives: where the sampler stood at the last batch
handed out (with workers, the sampler in the main process has run ahead by the batches they prefetched) and
whether the iterator finished its pass. ``tests/unit/datamodules/test_compat.py`` checks both against a real
loader, with and without workers, and fails naming the key when an upgrade moves it (checked: torchdata 0.11).
"""

from __future__ import annotations

from typing import Any

__all__ = ["iterator_finished", "sampler_state", "served_sampler_state", "with_sampler_state"]


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
