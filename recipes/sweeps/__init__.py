"""Sweeps on Optuna: the search space, the study in a database, the trial processes, the pruning callback
each trial runs, the in-process recipe check and the end-of-sweep report. ``python -m recipes.sweep`` is the
command (its docstring has the launch forms)."""
