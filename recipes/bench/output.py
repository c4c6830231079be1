"""How every benchmark hands its figures over: JSON on stdout for a script (``--json``), else its tables.

With ``--json`` the progress and the tables' console write to stderr (``Console(stderr=True)``), so stdout
holds the JSON document alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def emit(figures: dict[str, Any], as_json: bool, draw: Callable[[], None]) -> None:
    """Print ``figures`` as JSON (numpy scalars as floats) when ``as_json``, else call ``draw`` for the tables."""
    if as_json:
        print(json.dumps(figures, indent=2, default=float))
    else:
        draw()
