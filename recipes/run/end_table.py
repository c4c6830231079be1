"""The table a run prints at its end: its metrics, baselines, bill, timing and where it is kept."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

__all__ = ["print_end_table"]


def print_end_table(title: str, rows: list[tuple[str, str]]) -> None:
    """The end table, printed with rich (as wide as its longest row when stdout is not a terminal)."""
    table = Table(title=title, show_header=False)
    table.add_column("key", style="cyan")
    table.add_column("value")
    for key, value in rows:
        table.add_row(key, value)
    console = Console(stderr=False)
    if not console.is_terminal:  # a log file or a pipe: as wide as the longest row, so paths print whole
        widest = [max((len(c) for c in column.cells if isinstance(c, str)), default=0) for column in table.columns]
        console = Console(stderr=False, width=max(100, sum(widest) + 3 * len(widest) + 1))  # + borders, padding
    console.print(table)
