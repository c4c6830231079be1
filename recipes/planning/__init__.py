"""The planner behind ``python -m recipes.plan``: the model, a run's measurements from MLflow, the tables and
the figures, and the batch-size planner's run reading, training and tables. ``recipes/plan.py`` is the command
(its docstring has the launch forms); nothing here parses a command line."""
