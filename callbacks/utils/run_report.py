"""What a callback adds to a run once ``trainer.fit`` returned: deferred work, end-table rows, an exit code.

Lightning's hooks end inside ``trainer.fit``. A run has more to do after it: draw a plot or log a model off the
training loop, print an end table, and leave with an exit code a scheduler understands (75: relaunch me). The
project's CLI (``recipes/run/cli.py``) meets its callbacks through these three protocols, each one method, in
this order; a callback takes part by defining the method (nothing to import or subclass, so it still copies into
another project alone), and one's own loop may call them the same way::

    trainer.fit(model, datamodule=data)
    for callback in trainer.callbacks:
        if isinstance(callback, AfterFit):
            callback.after_fit(trainer)
    rows = [row for cb in trainer.callbacks if isinstance(cb, SummaryRows) for row in cb.summary_rows(metrics)]
    code = max((c for cb in trainer.callbacks if isinstance(cb, ExitCode) and (c := cb.exit_code())), default=0)

Written here because Lightning has no hook after ``fit`` returns and no notion of a process's exit code.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["AfterFit", "ExitCode", "SummaryRows"]


@runtime_checkable
class AfterFit(Protocol):
    """Work deferred off the training loop (a plot, a model upload)."""

    def after_fit(self, trainer: Any) -> None:
        """Once, on every rank, after ``trainer.fit`` returned."""


@runtime_checkable
class SummaryRows(Protocol):
    """Rows of the run's end table."""

    def summary_rows(self, metrics: dict[str, float]) -> list[tuple[str, str]]:
        """``(key, value)`` rows, given the run's final scalar metrics (global rank 0)."""


@runtime_checkable
class ExitCode(Protocol):
    """An exit code the callback asks of the process."""

    def exit_code(self) -> int | None:
        """75: stopped after its checkpoint, relaunch to resume; None: nothing to ask."""
