"""Rerun a tracked run from its own record, and say whether it came out the same.

``python -m recipes.reproduce RUN_ID`` fetches the run's ``config.yaml`` and ``manifest.json`` from
MLflow, warns about every difference between the run's manifest and this machine (git commit and
uncommitted changes, Python/torch/Lightning/MLflow and every installed package's version, the data
fingerprint, CPU, GPUs, platform, host), reruns the config as a new run of the same experiment (a
fresh run directory and MLflow run tagged ``reproduces=RUN_ID``), and tables the final metrics of
both. Metrics that measure time or the machine rather than the training (``system/*``, ``time/*``,
``comm/*``, throughput, cost, ...; see ``DEFAULT_IGNORE``) are left out of the comparison.

Examples::

    python -m recipes.reproduce 3f2a...c9                      # rerun, compare exactly
    python -m recipes.reproduce 3f2a...c9 --tolerance 1e-6     # allow float noise (non-deterministic kernels)
    python -m recipes.reproduce 3f2a...c9 --dry_run            # only the differences and the command

Bitwise-equal metrics need ``trainer.deterministic: true`` in the run's config, the same code,
software and data, and the same device kind and count. Exit status: 0 every compared metric within
``--tolerance`` (default 0: identical); 1 differences (printed); the rerun's own status when it failed;
2 bad input (an unknown run, a run without the config/manifest artifacts, or a record that names code the
project's own configs do not use).

A run's record is untrusted input: a shared tracking store is written by a whole team. Its ``config.yaml``
is read with YAML's safe loader, every class or callable it names must come from the project's packages or
the library types the fit parser's signatures take (:data:`TRUSTED_IMPORTS`; nothing else is imported), and
it is then parsed, not instantiated, by the fit parser itself, which checks each ``class_path`` against the
type its place allows (a ``LightningModule`` for ``model``, a ``LightningDataModule`` for ``data``, ...). Only
a record that passes is built (its datamodule, for the data fingerprint) or rerun, ``--dry_run`` or not.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import yaml
from mlflow.entities import Run
from mlflow.exceptions import MlflowException

from callbacks.analysis import keys
from recipes.run.common import (
    ENV_FROM_PARENT,
    ENV_RUN_TAGS,
    USAGE_EXIT_CODE,
    ArgumentParser,
    UsageError,
    check_tracking_server,
    find_run,
    parse_or_exit,
    tracking_uri,
)

__all__ = ["DEFAULT_IGNORE", "TRUSTED_IMPORTS", "MetricDiff", "check_record", "compare_metrics", "fetch_record",
           "main", "manifest_differences", "parse_record", "rerun_config", "untrusted_names"]

#: Metric name patterns (fnmatch) that depend on timing or the machine, not on the training's numbers. ``spot/*``:
#: the interruptions the machine had (a resumed run ends bitwise equal without them).
DEFAULT_IGNORE = ("system/*", *(f"{prefix}*" for prefix in (keys.TIME_PREFIX, keys.COMM_PREFIX, keys.AMDAHL_PREFIX,
                                                           keys.COST_PREFIX, keys.GOODPUT_PREFIX)),
                  "throughput/*", "*per_sec*", "*/time", "*mfu*", "*_s", "validate/*", f"{keys.TRAIN_DEVICE_PREFIX}*",
                  f"{keys.SPOT_PREFIX}*")
TAG = keys.REPRODUCES_TAG

#: Where a class or callable named by a run's record may come from: the project's packages and the library
#: types that the fit parser's signatures take (optimizers, schedulers, Lightning callbacks, strategies,
#: plugins, DDP comm hooks). A record naming anything else is refused before anything is imported.
TRUSTED_IMPORTS = ("recipes.", "callbacks.", "datamodules.", "torch.optim.", "torch.nn.",
                   "torch.distributed.algorithms.ddp_comm_hooks.", "lightning.pytorch.callbacks.",
                   "lightning.pytorch.strategies.", "lightning.pytorch.plugins.", "lightning.pytorch.accelerators.",
                   "lightning.pytorch.profilers.")
#: Trusted packages' types that run whatever callables they are given: refused in a record.
REFUSED_IMPORTS = ("lightning.pytorch.callbacks.LambdaCallback", "lightning.pytorch.callbacks.lambda_function.")
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


@dataclass
class MetricDiff:
    """One metric of the original run and of the rerun (``None``: not logged by that run)."""

    key: str
    original: float | None
    rerun: float | None

    @property
    def delta(self) -> float | None:
        if self.original is None or self.rerun is None:
            return None
        return self.rerun - self.original

    def within(self, tolerance: float) -> bool:
        if self.original is None or self.rerun is None:
            return False
        if math.isnan(self.original) and math.isnan(self.rerun):
            return True
        return abs(self.rerun - self.original) <= tolerance


# --------------------------------------------------------------------------------------------- record


def fetch_record(client: mlflow.MlflowClient, run_id: str, dst: Path) -> tuple[Run, dict[str, Any], dict[str, Any]]:
    """The run, its config (as a dict) and its manifest, downloaded into ``dst``.

    Raises:
        UsageError: the run does not exist or lacks ``config.yaml`` / ``manifest.json``.
    """
    try:
        run = client.get_run(run_id)
    except MlflowException as err:
        raise UsageError(f"run {run_id!r} not found at {client.tracking_uri}.") from err
    found: dict[str, Path] = {}
    for name in ("config.yaml", "manifest.json"):
        try:
            found[name] = Path(client.download_artifacts(run_id, name, str(dst)))
        except (MlflowException, OSError) as err:
            raise UsageError(f"run {run_id} has no {name} artifact (was it started by python -m recipes.fit?): "
                             f"{err}") from err
    try:
        config = yaml.safe_load(found["config.yaml"].read_text())
        manifest = json.loads(found["manifest.json"].read_text())
    except (yaml.YAMLError, ValueError, UnicodeDecodeError) as err:  # a !!python/... tag, or not YAML/JSON at all
        first = " ".join(str(err).split())[:200]
        raise UsageError(f"run {run_id}'s record is not plain YAML/JSON ({type(err).__name__}: {first}); "
                         "nothing of it was run.") from None
    if not isinstance(config, dict) or not isinstance(manifest, dict):
        raise UsageError(f"run {run_id}'s config.yaml and manifest.json must each hold a mapping; nothing was run.")
    check_record(config, run_id)
    return run, config, manifest


def _trusted(name: str) -> bool:
    return name.startswith(TRUSTED_IMPORTS) and not (name in REFUSED_IMPORTS or name.startswith(REFUSED_IMPORTS))


def untrusted_names(config: Any, where: str = "") -> list[str]:
    """``"key: name"`` for every class or callable the config names from outside :data:`TRUSTED_IMPORTS`.

    Every ``class_path`` counts, and every other string that reads as an import path of an installed
    module (``os.system`` given where a callable is expected). Nothing is imported: top-level modules are
    only looked up (``importlib.util.find_spec``, which runs no module code).
    """
    found: list[str] = []
    if isinstance(config, dict):
        for key, value in config.items():
            here = f"{where}.{key}" if where else str(key)
            if key == "class_path" and not (isinstance(value, str) and _DOTTED.fullmatch(value) and _trusted(value)):
                found.append(f"{here}: {value!r}")
            else:
                found += untrusted_names(value, here)
    elif isinstance(config, (list, tuple)):
        for index, value in enumerate(config):
            found += untrusted_names(value, f"{where}[{index}]")
    elif isinstance(config, str) and _DOTTED.fullmatch(config) and not _trusted(config):
        try:
            importable = importlib.util.find_spec(config.split(".", 1)[0]) is not None
        except (ImportError, ValueError):
            importable = False
        if importable:
            found.append(f"{where}: {config!r}")
    return found


class _Parsed(Exception):
    """Raised by :class:`_RecordParser` once the fit parser has checked the record, before anything is built."""

    def __init__(self, config: Any) -> None:
        super().__init__("parsed")
        self.config = config


def parse_record(config: dict[str, Any]) -> Any:
    """The record parsed (types checked, nothing instantiated) by ``recipes.fit``'s own parser.

    Each ``class_path`` must be a subclass of the type its place allows, as for ``recipes.fit --config``.
    Call only on a config :func:`untrusted_names` passed: the parser imports the classes it checks.

    Raises:
        UsageError: the parser refuses the record (the key and value it names).
    """
    from recipes.run.cli import AtscaleCLI
    from recipes.run.errors import parse_error_message  # torch and Lightning: only for a record being used

    class _RecordParser(AtscaleCLI):
        def before_instantiate_classes(self) -> None:
            raise _Parsed(self.config)

    record = {k: v for k, v in config.items() if k != "config"}
    record["ckpt_path"] = None  # nothing of the record's is loaded here
    # the parser is given the record: this tool's own command line is not for it (LightningCLI warns with it, whole)
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        _RecordParser(args=record, parser_kwargs={"exit_on_error": False})
    except _Parsed as parsed:
        return parsed.config
    except (argparse.ArgumentError, TypeError, ValueError) as err:
        raise UsageError(f"the record's config.yaml does not parse as a recipes.fit config: "
                         f"{parse_error_message(str(err))}") from None
    finally:
        sys.argv = argv
    raise UsageError("the record's config.yaml did not reach the parser's end")  # pragma: no cover


def check_record(config: dict[str, Any], run_id: str = "the run") -> None:
    """Refuse (:class:`UsageError`) a record that names code outside the project's, or does not parse as a config.

    Nothing the record names is imported before its names pass :func:`untrusted_names`, and nothing
    is instantiated here.
    """
    bad = untrusted_names(config)
    if bad:
        shown = "; ".join(bad[:3]) + (f"; ... ({len(bad) - 3} more)" if len(bad) > 3 else "")
        allowed = ", ".join(prefix.rstrip(".") for prefix in TRUSTED_IMPORTS)
        raise UsageError(f"run {run_id}'s config.yaml names code from outside the project ({shown}); a record from "
                         f"a tracking store is untrusted and may name only {allowed}. Nothing was imported or run.")
    try:
        parse_record(config)
    except UsageError as err:
        raise UsageError(f"run {run_id}: {err}. Nothing was run.") from None


def data_fingerprint_here(config: dict[str, Any]) -> tuple[str | None, str | None]:
    """The fingerprint of the config's datamodule built here: ``(fingerprint, None)`` or ``(None, why not)``."""
    data = config.get("data") or {}
    class_path = data.get("class_path") if isinstance(data, dict) else None
    if not class_path:
        return None, "the config names no datamodule class"
    if untrusted_names({"class_path": class_path}):  # callers check the whole record first; never build code else
        return None, f"{class_path} is not one of the project's datamodules"
    try:
        from lightning.pytorch import LightningDataModule

        module_name, _, class_name = class_path.rpartition(".")
        cls = getattr(importlib.import_module(module_name), class_name)
        if not (isinstance(cls, type) and issubclass(cls, LightningDataModule)):
            return None, f"{class_path} is not a LightningDataModule"
        datamodule = cls(**(data.get("init_args") or {}))
        if not hasattr(datamodule, "fingerprint"):
            return None, f"{class_name} has no fingerprint()"
        return datamodule.fingerprint(), None
    except Exception as err:  # the data may be missing here: say so, do not stop
        return None, f"{type(err).__name__}: {err}"


def _short(value: Any) -> str:
    text = str(value)
    return text[:12] if isinstance(value, str) and len(value) == 64 else text  # sha256 fingerprints


def manifest_differences(original: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """One line per way this machine differs from the run's manifest (empty: nothing differs)."""
    lines = []
    git_o, git_h = original.get("git") or {}, here.get("git") or {}
    if git_o.get("sha") != git_h.get("sha"):
        lines.append(f"git SHA: run {git_o.get('sha')} | here {git_h.get('sha')}")
    if git_o.get("dirty"):
        lines.append("git: the run's checkout had uncommitted changes, so its exact code is not recorded")
    if git_h.get("dirty"):
        lines.append("git: this checkout has uncommitted changes")
    versions_o, versions_h = original.get("versions") or {}, here.get("versions") or {}
    for key in sorted(set(versions_o) | set(versions_h)):
        if versions_o.get(key) != versions_h.get(key):
            lines.append(f"{key} version: run {versions_o.get(key)} | here {versions_h.get(key)}")

    def packages(m: dict[str, Any]) -> dict[str, str]:
        return dict(p.split("==", 1) if "==" in p else (p, "?") for p in m.get("packages") or [])

    pk_o, pk_h = packages(original), packages(here)
    changed = [f"{n} {pk_o[n]} -> {pk_h[n]}" for n in sorted(set(pk_o) & set(pk_h), key=str.lower)
               if pk_o[n] != pk_h[n]]
    only_run = sorted(set(pk_o) - set(pk_h), key=str.lower)
    only_here = sorted(set(pk_h) - set(pk_o), key=str.lower)
    for label, items in (("package versions (run -> here)", changed), ("packages only in the run", only_run),
                         ("packages only here", only_here)):
        if items:
            shown = ", ".join(items[:12]) + (f", ... ({len(items) - 12} more)" if len(items) > 12 else "")
            lines.append(f"{label}: {shown}")
    if original.get("data_fingerprint") != here.get("data_fingerprint"):
        lines.append(f"data fingerprint: run {_short(original.get('data_fingerprint'))} | "
                     f"here {_short(here.get('data_fingerprint'))}")
    for key, label in (("gpus", "GPUs"), ("cpu", "CPU"), ("cpu_count", "CPU cores"), ("threads", "torch threads"),
                       ("platform", "platform"), ("host", "host"), ("world_size", "world size")):
        if key in original and key in here and original.get(key) != here.get(key):
            lines.append(f"{label}: run {original.get(key)} | here {here.get(key)}")
    return lines


#: The metric a run logs its CPU thread count under (callbacks.cpu_threads logs it).
THREADS_METRIC = keys.CPU_THREADS_KEY


def original_thread_env(run: Run, env: dict[str, str]) -> dict[str, str]:
    """``OMP_NUM_THREADS`` of the rerun: the original's count per process, on which CPU results depend.

    ``--cpu_threads auto`` holds whatever count a process starts with, and that follows the machine's
    cores; on another machine the rerun would split its reductions differently. Nothing for a run that
    logged no count (a GPU run, or one from before the count was logged).
    """
    count = run.data.metrics.get(THREADS_METRIC)
    if count is None or count < 1 or env.get("OMP_NUM_THREADS") == str(int(count)):
        return {}
    print(f"CPU threads: {int(count)} per process, as the original run had.", flush=True)
    return {"OMP_NUM_THREADS": str(int(count))}


#: Datamodules that stream a prepared dataset from a URL: the rerun pins the index digest the original saw.
STREAMED_DATA = ("datamodules.streaming.StreamingImageDataModule", "datamodules.streaming.StreamingTextDataModule")


def rerun_config(config: dict[str, Any], run_name: str, runs_root: str | None,
                 data_fingerprint: str | None = None) -> dict[str, Any]:
    """The run's config as a fresh run named ``run_name``: its own directories, nothing resumed.

    A streamed dataset (:data:`STREAMED_DATA`) is read from the same URL, and with ``data_fingerprint`` (the original
    manifest's) the rerun refuses to train on anything but the chunks the original saw (``index_digest``): data
    prepared again at that URL since is named, not silently trained on.
    """
    out = {k: v for k, v in config.items() if k != "config"}  # the original's --config paths: not read again
    data = out.get("data")
    if data_fingerprint and isinstance(data, dict) and data.get("class_path") in STREAMED_DATA:
        out["data"] = {**data, "init_args": {**(data.get("init_args") or {}), "index_digest": data_fingerprint}}
    out.update({"run_name": run_name, "fresh": True, "ckpt_path": None})
    if runs_root is not None:
        out["runs_root"] = runs_root
    for key in ("checkpoint", "spot"):  # the original's resolved checkpoints/ dir: let the CLI derive the new one
        if isinstance(out.get(key), dict):
            out[key] = {**out[key], "dirpath": None}
    return out


# ------------------------------------------------------------------------------------------- metrics


def final_metrics(run: Run, ignore: tuple[str, ...]) -> dict[str, float]:
    return {k: float(v) for k, v in run.data.metrics.items() if not any(fnmatch.fnmatch(k, p) for p in ignore)}


def compare_metrics(original: dict[str, float], rerun: dict[str, float]) -> list[MetricDiff]:
    """Every metric of either run, by name."""
    return [MetricDiff(k, original.get(k), rerun.get(k)) for k in sorted(set(original) | set(rerun))]


def print_diffs(diffs: list[MetricDiff], tolerance: float, original_id: str, rerun_id: str) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    table = Table(title=f"metrics: run {original_id} vs rerun {rerun_id} (tolerance {tolerance:g})")
    for name, justify in (("metric", "left"), ("original", "right"), ("rerun", "right"), ("difference", "right"),
                          ("", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.8g}"

    for d in diffs:
        ok = d.within(tolerance)
        table.add_row(escape(d.key), fmt(d.original), fmt(d.rerun), fmt(d.delta),
                      "same" if ok else "[bold red]DIFFERS[/]")
    console.print(table)


# ---------------------------------------------------------------------------------------------- main


def warn_differences(config: dict[str, Any], manifest: dict[str, Any]) -> None:
    """Print a warning per difference between the run's manifest and this machine (stderr)."""
    from callbacks.manifest import build_manifest  # torch and Lightning: only once a run is being reproduced

    fingerprint, why = data_fingerprint_here(config)
    here = build_manifest(manifest.get("world_size", 1), config.get("seed_everything"), fingerprint)
    differences = manifest_differences(manifest, here)
    if why is not None:
        differences.append(f"data fingerprint: not computed here ({why})")
    for line in differences:
        print(f"warning: {line}", file=sys.stderr)
    if not differences:
        print("The code, software, data and machine match the run's manifest.")
    if (config.get("trainer") or {}).get("deterministic") is not True:
        print("note: the run's config does not set trainer.deterministic: true; identical metrics are not "
              "guaranteed even with everything the same.", file=sys.stderr)


def warn_rerun_differences(client: mlflow.MlflowClient, rerun_id: str, manifest: dict[str, Any], dst: Path) -> None:
    """What the rerun itself recorded: warn if its world size or data differ from the original's."""
    try:
        dst.mkdir(parents=True, exist_ok=True)
        rerun = json.loads(Path(client.download_artifacts(rerun_id, "manifest.json", str(dst))).read_text())
    except (MlflowException, OSError, ValueError) as err:
        print(f"warning: could not read the rerun's manifest.json ({err}).", file=sys.stderr)
        return
    for key, label in (("world_size", "world size"), ("data_fingerprint", "data fingerprint")):
        if rerun.get(key) != manifest.get(key):
            print(f"warning: the rerun's {label} differs: run {_short(manifest.get(key))} | "
                  f"rerun {_short(rerun.get(key))}", file=sys.stderr)



def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m recipes.reproduce", description=__doc__.splitlines()[0])
    parser.add_argument("run_id", help="MLflow run id of the run to reproduce.")
    parser.add_argument("--runs_root", default=None,
                        help="Root of the new run's directory (default: the original config's runs_root).")
    parser.add_argument("--run_name", default=None, help="Name of the new run (default: <original>-repro-<time>).")
    parser.add_argument("--tolerance", type=float, default=0.0,
                        help="Largest absolute metric difference counted as the same (0: identical).")
    parser.add_argument("--ignore", action="append", default=[], metavar="PATTERN",
                        help="Also leave metrics matching this fnmatch pattern out (repeatable).")
    parser.add_argument("--dry_run", action="store_true", help="Only print the differences and the command.")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_or_exit(build_parser(), argv)
    if not (args.tolerance >= 0 and math.isfinite(args.tolerance)):
        print(f"error: --tolerance {args.tolerance} must be a finite number >= 0.", file=sys.stderr)
        return USAGE_EXIT_CODE
    quiet = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR" not in os.environ
    if quiet:  # two small files: no progress bars around the one-line answers
        os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    try:
        return _main(args)
    finally:
        if quiet:
            os.environ.pop("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", None)


def _main(args: argparse.Namespace) -> int:
    uri = tracking_uri()
    ignore = (*DEFAULT_IGNORE, *args.ignore)
    with tempfile.TemporaryDirectory(prefix="atscale-reproduce-") as tmp:
        try:
            check_tracking_server(uri)
            client = mlflow.MlflowClient(tracking_uri=uri)
            run, config, manifest = fetch_record(client, args.run_id, Path(tmp))
        except UsageError as err:
            print(f"error: {err}", file=sys.stderr)
            return USAGE_EXIT_CODE

        warn_differences(config, manifest)
        run_name = args.run_name or f"{run.info.run_name or args.run_id[:8]}-repro-{time.strftime('%Y%m%d-%H%M%S')}"
        config_path = Path(tmp) / "reproduce.yaml"
        rerun = rerun_config(config, run_name, args.runs_root, manifest.get("data_fingerprint"))
        config_path.write_text(yaml.safe_dump(rerun, sort_keys=False))
        command = [sys.executable, "-m", "recipes.fit", "--config", str(config_path)]
        print(f"Rerunning run {args.run_id} ({run.info.run_name}) as {run_name!r}: "
              f"{' '.join(command[1:3])} --config <its config.yaml> --run_name {run_name} --fresh true", flush=True)
        if args.dry_run:
            return 0
        env = {k: v for k, v in os.environ.items() if k not in ENV_FROM_PARENT}
        env["MLFLOW_TRACKING_URI"] = uri
        env[ENV_RUN_TAGS] = json.dumps({TAG: args.run_id})
        env.update(original_thread_env(run, env))
        code = subprocess.run(command, env=env, check=False).returncode

        if code != 0:
            print(f"error: the rerun exited with status {code}.", file=sys.stderr)
            return code
        new = find_run(client, [run.info.experiment_id], run_name)
        if new is None:
            print(f"error: the rerun finished but no MLflow run named {run_name!r} was found.", file=sys.stderr)
            return 1
        client.set_tag(new.info.run_id, TAG, args.run_id)
        warn_rerun_differences(client, new.info.run_id, manifest, Path(tmp) / "rerun")
    diffs = compare_metrics(final_metrics(run, ignore), final_metrics(new, ignore))
    print_diffs(diffs, args.tolerance, args.run_id, new.info.run_id)
    differing = [d for d in diffs if not d.within(args.tolerance)]
    if not differing:
        print(f"Reproduced: {len(diffs)} metrics identical within {args.tolerance:g} "
              f"(new run {new.info.run_id}, tagged {TAG}={args.run_id}).")
        return 0
    print(f"NOT reproduced: {len(differing)} of {len(diffs)} metrics differ by more than {args.tolerance:g}: "
          + ", ".join(d.key for d in differing) + f" (new run {new.info.run_id}).")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
