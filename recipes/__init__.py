"""The recipes: one module per command (``python -m recipes.fit`` ...), the tasks, and ``train`` for Python cells.

``from recipes import train`` loads :mod:`recipes.api` on first use: importing ``recipes`` (as every tool
that does not train does, e.g. ``recipes.compare``) imports no torch or Lightning.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Run", "TrainError", "train"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from recipes import api

        return getattr(api, name)
    raise AttributeError(f"module 'recipes' has no attribute {name!r}")
