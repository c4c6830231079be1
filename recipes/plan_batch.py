"""The batch-size planner's former module, kept so that ``import recipes.plan_batch`` still works.

The command is ``python -m recipes.plan batch`` (:func:`recipes.plan.batch_main`, whose module docstring has
its launch forms); the work lives in :mod:`recipes.planning` (``batch_runs``, ``batch_train``,
``batch_report``, ``plot``). Import from there.
"""

from __future__ import annotations

from recipes.plan import batch_main as main
from recipes.planning.batch_report import print_plan
from recipes.planning.batch_train import validate
from recipes.planning.plot import write_batch_plot as write_plot

__all__ = ["main", "print_plan", "validate", "write_plot"]

if __name__ == "__main__":
    raise SystemExit(main())
