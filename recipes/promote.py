"""Promote the best run of an experiment to the MLflow Model Registry as ``champion``.

Picks the FINISHED run with the best ``--metric``, refuses it unless it beats its baseline (by default
the logistic regression of the metric's kind the run logged: ``baseline/linear_acc`` for an accuracy,
``baseline/linear_expected_cost`` for ``val/expected_cost``), registers the model the run logged
(MLflow 3: the run's logged model, ``models:/<model_id>``) as a new version of ``--name`` and points
the alias ``champion`` at it. Then anyone loads or serves it by alias::

    mlflow.pyfunc.load_model("models:/digits@champion")
    mlflow models serve -m models:/digits@champion --env-manager local --port 5001

Examples::

    python -m recipes.promote --experiment digits --metric val/acc --mode max
    python -m recipes.promote --experiment digits --metric val/expected_cost --mode min
    python -m recipes.promote --experiment digits --metric val/loss --mode min --name digits-cnn --baseline none
    python -m recipes.promote --experiment text --metric val/bpb --mode min --baseline baseline/unigram_bpb
    python -m recipes.promote --sweep digits-lr     # the best trial of a recipes.sweep (its metric and mode)

With ``--sweep NAME`` the candidates are the sweep's trial runs (tag ``sweep`` = NAME) that were not pruned;
the experiment, ``--metric`` and ``--mode`` default to the sweep's own.

The tracking store is ``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db`` (the registry needs a
database store). Exit status: 0 promoted; 1 refused (no finished run, the best run does not beat its
baseline, or it logged no model: the reason is printed); 2 bad input (unknown experiment or metric).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass

import mlflow
from mlflow.entities import Run, ViewType
from mlflow.exceptions import MlflowException

from callbacks.analysis.keys import (
    DEFAULT_METRIC,
    KIND_TAG,
    LINEAR_BASELINE_KEY,
    LINEAR_COST_BASELINE_KEY,
    PRUNED_TAG,
    REGISTERED_AS_TAG,
    SWEEP_NAME_TAG,
    TRIAL_SWEEP_TAG,
)
from recipes.compare import baselines_for
from recipes.run.common import (
    USAGE_EXIT_CODE,
    ArgumentParser,
    UsageError,
    all_experiments,
    all_pages,
    all_runs,
    check_tracking_server,
    get_experiment,
    parse_or_exit,
    quoted,
    tracking_uri,
)

__all__ = ["Promotion", "Refused", "best_run", "check_baseline", "check_baseline_kind", "check_names", "find_sweep",
           "logged_model_uri", "main", "promote", "runs_with_metric", "sweep_trials"]

REFUSED_EXIT_CODE = 1
ALIAS = "champion"


class Refused(Exception):
    """The best run may not be promoted; the message says why."""


@dataclass
class Promotion:
    """What was registered."""

    name: str
    version: str
    alias: str
    run_id: str
    run_name: str
    metric: str
    value: float
    baseline: str | None
    baseline_value: float | None
    model_uri: str
    previous_version: str | None

    @property
    def load_uri(self) -> str:
        return f"models:/{self.name}@{self.alias}"


def runs_with_metric(client: mlflow.MlflowClient, experiment_id: str, experiment: str, metric: str) -> list[Run]:
    """The experiment's runs that logged ``metric``.

    Raises:
        UsageError: no run of the experiment logged ``metric`` at all (the message lists what they logged).
    """
    runs = all_runs(client, [experiment_id])
    with_metric = [r for r in runs if metric in r.data.metrics]
    if not with_metric:
        logged = sorted({k for r in runs for k in r.data.metrics if not k.startswith("system/")})
        raise UsageError(f"metric {metric!r} is not logged by any run of experiment {experiment!r} "
                         f"(logged: {', '.join(logged) if logged else 'none'}).")
    return with_metric


def best_run(runs: list[Run], experiment: str, metric: str, mode: str) -> Run:
    """The FINISHED run with the best final ``metric`` (the newest among equals).

    Raises:
        Refused: none of the runs finished.
    """
    finished = [r for r in runs if r.info.status == "FINISHED"]
    if not finished:
        states = ", ".join(sorted({r.info.status for r in runs}))
        raise Refused(f"no FINISHED run of experiment {experiment!r} logged {metric} (their states: {states}).")
    sign = 1.0 if mode == "max" else -1.0
    return max(finished, key=lambda r: (sign * r.data.metrics[metric], r.info.start_time))


def metric_kind(key: str) -> str:
    """What a metric measures, from its last word: ``val/acc`` and ``baseline/linear_acc`` -> ``acc``."""
    return key.rsplit("/", 1)[-1].rsplit("_", 1)[-1]


def check_baseline_kind(metric: str, baseline: str | None) -> None:
    """A baseline judges a metric of the same kind only (accuracy against accuracy, bpb against bpb).

    Raises:
        UsageError: naming both when they measure different things.
    """
    if baseline is not None and metric_kind(metric) != metric_kind(baseline):
        raise UsageError(f"--baseline {baseline} measures {metric_kind(baseline)!r}, not {metric_kind(metric)!r} "
                         f"like --metric {metric}: pick a baseline of the same kind, or --baseline none.")


def check_baseline(run: Run, metric: str, mode: str, baseline: str | None) -> float | None:
    """The baseline's value, after checking that the run beats it.

    Raises:
        Refused: the run did not log the baseline, or does not beat it (the message says by how much).
    """
    if baseline is None:
        return None
    name, value = run.info.run_name, run.data.metrics[metric]
    if baseline not in run.data.metrics:
        raise Refused(f"run {name} ({run.info.run_id}) logged no {baseline}, so it cannot be checked against its "
                      "baseline; pass --baseline none to promote without that check.")
    base = run.data.metrics[baseline]
    beats = value > base if mode == "max" else value < base
    if not beats:
        short = base - value if mode == "max" else value - base
        raise Refused(f"run {name} ({run.info.run_id}) has {metric} {value:.4f}, which does not beat its {baseline} "
                      f"{base:.4f} (short by {short:.4f}); not promoted.")
    return base


def logged_model_uri(client: mlflow.MlflowClient, run: Run, artifact: str = "model") -> str:
    """The URI of the model the run logged as ``artifact`` (MLflow 3: ``models:/<model_id>``).

    Raises:
        Refused: the run logged no such model (an interrupted fit logs none).
    """
    candidates = all_pages(client.search_logged_models, experiment_ids=[run.info.experiment_id],
                           filter_string=f"source_run_id = {quoted(run.info.run_id)} AND name = {quoted(artifact)}")
    ready = [m for m in candidates if str(m.status).endswith("READY")]
    if ready:
        return max(ready, key=lambda m: m.creation_timestamp).model_uri
    raise Refused(f"run {run.info.run_name} ({run.info.run_id}) logged no model named {artifact!r} "
                  "(callbacks.mlflow_model.LogModel logs it when a fit completes).")


def sweep_trials(client: mlflow.MlflowClient, experiment_id: str, sweep: str, experiment: str,
                 metric: str) -> list[Run]:
    """The runs of sweep ``sweep``'s trials that were not pruned (a pruned trial stopped early: never the best)
    and logged ``metric``.

    Raises:
        Refused: the sweep has no such run that logged ``metric``.
    """
    # the pruner tags a pruned trial "true" and leaves the others untagged
    runs = all_runs(client, [experiment_id],
                    filter_string=f"tags.`{TRIAL_SWEEP_TAG}` = {quoted(sweep)} AND tags.`{PRUNED_TAG}` IS NULL")
    trials = [r for r in runs if metric in r.data.metrics]
    if not trials:
        raise Refused(f"sweep {sweep!r} has no unpruned trial run in experiment {experiment!r} that logged {metric}.")
    return trials


def find_sweep(client: mlflow.MlflowClient, sweep: str) -> Run:
    """The parent run of ``recipes.sweep --name sweep``, in any experiment.

    Raises:
        UsageError: there is none (the message lists the sweeps there are).
    """
    experiments = [e.experiment_id for e in all_experiments(client, ViewType.ACTIVE_ONLY)]
    if not experiments:
        raise UsageError(f"--sweep {sweep!r}: no such sweep in the tracking store (sweeps there: none).")
    parents = f"tags.`{KIND_TAG}` = 'sweep'"
    found = all_runs(client, experiments, filter_string=f"{parents} AND tags.`{SWEEP_NAME_TAG}` = {quoted(sweep)}",
                     order_by=["attributes.start_time DESC"])
    if not found:
        known = sorted({r.data.tags.get(SWEEP_NAME_TAG, "") for r in all_runs(client, experiments, parents)})
        raise UsageError(f"--sweep {sweep!r}: no such sweep in the tracking store (sweeps there: "
                         f"{', '.join(known) if known else 'none'}).")
    return found[0]


def promote(client: mlflow.MlflowClient, experiment: str, metric: str, mode: str, name: str,
            baseline: str | None = LINEAR_BASELINE_KEY, alias: str = ALIAS, tracking_uri: str = "",
            sweep: str | None = None) -> Promotion:
    """Register the best finished run's model as a new version of ``name`` and alias it.

    The registration goes through ``mlflow.register_model``, on the global tracking URI: set it to
    the client's first (:func:`main` does).

    Raises:
        UsageError: unknown experiment or metric.
        Refused: nothing may be promoted (the message says why).
    """
    exp = get_experiment(client, experiment, tracking_uri)
    runs = runs_with_metric(client, exp.experiment_id, experiment, metric)
    if sweep is not None:
        runs = sweep_trials(client, exp.experiment_id, sweep, experiment, metric)
    check_baseline_kind(metric, baseline)
    run = best_run(runs, experiment, metric, mode)
    base = check_baseline(run, metric, mode, baseline)
    model_uri = logged_model_uri(client, run)
    previous = None
    try:
        previous = str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        pass
    value = run.data.metrics[metric]
    tags = {"source_run_id": run.info.run_id, "experiment": experiment, metric: f"{value:.6g}"}
    if baseline is not None and base is not None:
        tags[baseline] = f"{base:.6g}"
    version = mlflow.register_model(model_uri, name, tags=tags)
    client.set_registered_model_alias(name, alias, version.version)
    client.set_tag(run.info.run_id, REGISTERED_AS_TAG, f"{name}/{version.version}@{alias}")
    return Promotion(name=name, version=str(version.version), alias=alias, run_id=run.info.run_id,
                     run_name=run.info.run_name, metric=metric, value=value, baseline=baseline, baseline_value=base,
                     model_uri=model_uri, previous_version=previous)


#: A registered model's name here: it goes into ``models:/<name>@<alias>`` URIs and the shell commands this tool
#: prints, so one plain word (MLflow itself refuses only '/' and ':').
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: An alias: MLflow's rule (word characters and '-', at most 255), in ASCII; 'latest' and 'v<N>' are MLflow's own.
ALIAS_NAME = re.compile(r"[A-Za-z0-9_-]{1,255}")


def check_names(name: str | None, alias: str) -> None:
    """Refuse (:class:`UsageError`, naming the value) a model name or alias before anything is registered.

    MLflow checks the alias only when it sets it, after the new version was registered: a bad alias left a
    version behind without it.
    """
    if name is not None and not MODEL_NAME.fullmatch(name):
        raise UsageError(f"--name {name!r}: a registered model's name here is 1-128 letters, digits and . _ -, "
                         "starting with a letter or digit.")
    if not ALIAS_NAME.fullmatch(alias):
        raise UsageError(f"--alias {alias!r}: an alias is 1-255 letters, digits, '_' and '-'.")
    if alias.lower() == "latest" or re.fullmatch(r"[vV]\d+", alias):
        raise UsageError(f"--alias {alias!r} is reserved by MLflow ('latest' and version names like 'v3').")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m recipes.promote", description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", default=None, help="MLflow experiment name (required unless --sweep).")
    parser.add_argument("--sweep", default=None, help="Promote the best unpruned trial of this recipes.sweep.")
    parser.add_argument("--metric", default=None,
                        help=f"Metric that picks the best run. Default {DEFAULT_METRIC} (with --sweep: the sweep's).")
    parser.add_argument("--mode", choices=("max", "min"), default=None,
                        help="Best is max (default) or min (with --sweep: the sweep's).")
    parser.add_argument("--name", default=None, help="Registered model name (default: the experiment's name).")
    parser.add_argument("--baseline", default=None,
                        help="Metric the run must beat (default: the linear baseline of the metric's kind, "
                             f"{LINEAR_BASELINE_KEY} or {LINEAR_COST_BASELINE_KEY}); 'none' skips the check.")
    parser.add_argument("--alias", default=ALIAS, help="Alias to point at the new version.")
    parser.add_argument("--json", action="store_true", help="Print the promotion as JSON.")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_or_exit(build_parser(), argv)
    if args.experiment is None and args.sweep is None:
        print("error: --experiment is required (or --sweep NAME)", file=sys.stderr)
        return USAGE_EXIT_CODE
    uri = tracking_uri()
    try:
        check_names(args.name, args.alias)
        check_tracking_server(uri)
        mlflow.set_tracking_uri(uri)
        client = mlflow.MlflowClient(uri)
        if args.sweep is not None:
            parent = find_sweep(client, args.sweep)
            args.experiment = args.experiment or client.get_experiment(parent.info.experiment_id).name
            args.metric = args.metric or parent.data.params.get("metric")
            args.mode = args.mode or parent.data.params.get("mode")
        args.metric, args.mode = args.metric or DEFAULT_METRIC, args.mode or "max"
        name = args.name or args.experiment
        baseline = baselines_for(args.metric)[0] if args.baseline is None else (
            None if args.baseline.lower() == "none" else args.baseline)
        result = promote(client, args.experiment, args.metric, args.mode, name, baseline, args.alias, uri,
                         sweep=args.sweep)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except Refused as err:
        print(f"refused: {err}", file=sys.stderr)
        return REFUSED_EXIT_CODE
    except MlflowException as err:  # a value MLflow refuses (say an experiment name it takes for no model's)
        if err.error_code != "INVALID_PARAMETER_VALUE":
            raise
        print(f"error: {' '.join(err.message.split())}", file=sys.stderr)
        return USAGE_EXIT_CODE
    if args.json:
        print(json.dumps({**asdict(result), "load_uri": result.load_uri}, indent=2))
        return 0
    vs = "" if result.baseline_value is None else \
        f" (beats {result.baseline} {result.baseline_value:.4f} by {abs(result.value - result.baseline_value):.4f})"
    print(f"Promoted run {result.run_name} ({result.run_id}): {result.metric} {result.value:.4f}{vs}")
    print(f"Registered {result.model_uri} as {result.name!r} version {result.version}, alias {result.alias!r}"
          + (f" (was version {result.previous_version})" if result.previous_version else ""))
    print(f"Load it with (MLFLOW_TRACKING_URI={uri}):")
    print(f'    model = mlflow.pyfunc.load_model("{result.load_uri}")')
    print("Serve it over HTTP with:")
    print(f"    mlflow models serve -m {result.load_uri} --env-manager local --port 5001   # 5000: mlflow ui's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
