"""The chaos soak's former module: the soak now lives in :mod:`recipes.soak`, one module per part.

Kept so that the names imported from ``recipes.chaos`` before the split keep working; new code imports from
the module that holds the name (see :mod:`recipes.soak`). The command is unchanged:
``python -m recipes.bench chaos ...``.
"""

from __future__ import annotations

from recipes.soak.cli import add_arguments, main
from recipes.soak.launch import EXIT_WATCH_LINE, hung_where
from recipes.soak.observe import Store

__all__ = ["EXIT_WATCH_LINE", "Store", "add_arguments", "hung_where", "main"]
