"""The end of a sweep: the trials table, the best trial beside its baselines, parameter importances, the
optimization-history and parallel-coordinate plots, and what the sweep spent and what pruning saved.

Money comes from the trials' own MLflow runs (``cost/usd``, logged by :class:`callbacks.cost.CostTracker`):
spent is the sum of every trial run's ``cost/usd``; saved by pruning, for each pruned trial, what its run
projected for the rest of its training when it stopped (``cost/projected_usd - cost/usd``).
"""

from __future__ import annotations

import csv
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlflow
import optuna
from optuna.trial import FrozenTrial, TrialState
from rich.table import Table

from callbacks.analysis.keys import COST_KEY, PROJECTED_COST_KEY, TRIAL_SWEEP_TAG, TRIAL_TAG
from recipes.run.common import all_runs, quoted

from .study import RUN_NAME_ATTR


@dataclass
class Money:
    """What the sweep's trials cost so far (from their MLflow runs)."""

    spent_usd: float = 0.0
    saved_by_pruning_usd: float = 0.0
    #: trial number -> (cost so far, projected total) of its run
    per_trial: dict[int, tuple[float, float | None]] = field(default_factory=dict)


def child_runs(client: mlflow.MlflowClient, experiment_id: str, name: str) -> dict[int, Any]:
    """The sweep's trial runs (tag ``sweep`` = ``name``), by trial number (the newest run of each)."""
    runs = all_runs(client, [experiment_id], order_by=["attributes.start_time ASC"],
                    filter_string=f"tags.`{TRIAL_SWEEP_TAG}` = {quoted(name)} AND tags.`{TRIAL_TAG}` IS NOT NULL")
    return {int(r.data.tags[TRIAL_TAG]): r for r in runs if r.data.tags[TRIAL_TAG].isdigit()}


def money(runs: dict[int, Any], trials: list[FrozenTrial]) -> Money:
    """Spent and saved by pruning (module docstring) over ``runs``."""
    out = Money()
    pruned = {t.number for t in trials if t.state == TrialState.PRUNED}
    for number, run in runs.items():
        usd = float(run.data.metrics.get(COST_KEY, 0.0))
        projected = run.data.metrics.get(PROJECTED_COST_KEY)
        out.per_trial[number] = (usd, None if projected is None else float(projected))
        out.spent_usd += usd
        if number in pruned and projected is not None:
            out.saved_by_pruning_usd += max(0.0, float(projected) - usd)
    return out


def _short(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def param_text(value: Any) -> str:
    """A trial's parameter as the tables show it: floats to 4 significant digits."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def trials_table(study: optuna.Study, metric: str, cash: Money) -> Table:
    """One row per trial: state, the metric, epochs reported, the parameters, cost and run name."""
    trials = study.get_trials(deepcopy=False)
    keys = list(dict.fromkeys(k for t in trials for k in t.params))
    table = Table(title=f"sweep {study.study_name}: {len(trials)} trials")
    for column in ["#", "state", metric, "epochs", *(_short(k) for k in keys), "cost", "run"]:
        table.add_column(column, justify="left" if column in ("state", "run") else "right")
    for t in trials:
        state = t.state.name + (f" @{t.user_attrs['pruned_at_epoch']}" if t.state == TrialState.PRUNED else "")
        value = "" if t.value is None else f"{t.value:.4f}"
        usd = cash.per_trial.get(t.number, (None, None))[0]
        table.add_row(str(t.number), state, value, str(len(t.intermediate_values)),
                      *(param_text(t.params[k]) if k in t.params else "" for k in keys),
                      "" if usd is None else f"${usd:.4f}", str(t.user_attrs.get(RUN_NAME_ATTR, "")))
    return table


def importances(study: optuna.Study) -> dict[str, float]:
    """Parameter importances (Optuna's fANOVA) over the finished trials; empty when too few to say."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            evaluator = optuna.importance.FanovaImportanceEvaluator(seed=0)
            return dict(optuna.importance.get_param_importances(study, evaluator=evaluator))
    except (ValueError, RuntimeError, ZeroDivisionError):
        return {}


def write_plots(study: optuna.Study, out_dir: Path) -> list[Path]:
    """``optimization_history.png`` and ``parallel_coordinate.png`` (Optuna's matplotlib plots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as vis

    written = []
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    for name, plot in (("optimization_history", vis.plot_optimization_history),
                       ("parallel_coordinate", vis.plot_parallel_coordinate)):
        if not complete:
            break
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ExperimentalWarning: the matplotlib backend is "experimental"
            ax = plot(study)
        fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
        fig.set_size_inches(10, 6)
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def write_csv(study: optuna.Study, cash: Money, path: Path) -> Path:
    """``trials.csv``: number, state, value, epochs, cost, run name and one column per parameter."""
    trials = study.get_trials(deepcopy=False)
    keys = list(dict.fromkeys(k for t in trials for k in t.params))
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["number", "state", "value", "epochs", "cost_usd", "run_name", *keys])
        for t in trials:
            usd = cash.per_trial.get(t.number, (None, None))[0]
            writer.writerow([t.number, t.state.name, "" if t.value is None else t.value, len(t.intermediate_values),
                             "" if usd is None else usd, t.user_attrs.get(RUN_NAME_ATTR, ""),
                             *(json.dumps(t.params[k]) if k in t.params else "" for k in keys)])
    return path


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    """The best COMPLETE trial, or None."""
    if not any(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False)):
        return None
    return study.best_trial


def summary_table(study: optuna.Study, metric: str, mode: str, cash: Money, best_run: Any,
                  baselines: tuple[str, ...], ranked: dict[str, float], stopped_by: str, budget: float | None,
                  parent_run_id: str) -> Table:
    """The best trial beside its run's baselines, importances, money, and where the sweep is in MLflow."""
    table = Table(title=f"sweep {study.study_name} — {stopped_by}", show_header=False)
    table.add_column("key", style="cyan")
    table.add_column("value")
    best = best_trial(study)
    if best is None:
        table.add_row("best trial", "none finished")
    else:
        table.add_row("best trial", f"#{best.number} {metric} {best.value:.4f} ({mode}), run "
                      f"{best.user_attrs.get(RUN_NAME_ATTR, '')}")
        table.add_row("best params", ", ".join(f"{_short(k)}={param_text(v)}" for k, v in best.params.items()))
        metrics = best_run.data.metrics if best_run is not None else {}
        for key in baselines:
            if key in metrics and best.value is not None:
                table.add_row(key, f"{metrics[key]:.4f}  (best trial {best.value - metrics[key]:+.4f})")
    if ranked:
        table.add_row("importance", ", ".join(f"{_short(k)} {v:.2f}" for k, v in ranked.items()))
    counts = {s: sum(t.state == s for t in study.get_trials(deepcopy=False)) for s in TrialState}
    table.add_row("trials", ", ".join(f"{n} {s.name.lower()}" for s, n in counts.items() if n))
    spent = f"${cash.spent_usd:.4f}" + (f" of a ${budget:.4f} budget" if budget is not None else "")
    table.add_row("spent", spent)
    table.add_row("saved by pruning", f"${cash.saved_by_pruning_usd:.4f}")
    table.add_row("mlflow", f"parent run {parent_run_id}")
    return table


def finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)
