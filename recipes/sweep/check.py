"""Check a sweep's recipe before any trial starts: the space's keys and values parse, the metric is logged.

The recipe is parsed in this process by the project's own CLI parser (``recipes.run.cli.AtscaleCLI``), with the
overrides and one probe value per space key (the low bound, each categorical choice), and its classes are
built (a bad ``--cost.instance`` fails here too). One validation batch of the built model on the CPU then
shows which metrics the recipe's validation logs: ``--metric`` must be one of them. Nothing is written: no
run directory, no MLflow run.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from optuna.distributions import CategoricalDistribution

from recipes.run.common import UsageError

from .space import Space, override_args, probe_params


@dataclass
class Recipe:
    """What the sweep needs to know of the recipe."""

    experiment: str
    runs_root: str
    validation_metrics: list[str]


class _Parsed(Exception):
    def __init__(self, cli: Any) -> None:
        self.cli = cli


def _cli_class(instantiate: bool) -> Any:
    from recipes.run.cli import AtscaleCLI

    class ProbeCLI(AtscaleCLI):
        """Parse and build the recipe's classes; no run directory, no tracking, no trainer."""

        def before_instantiate_classes(self) -> None:
            if not instantiate:
                raise _Parsed(self)

        def instantiate_trainer(self, **kwargs: Any) -> Any:
            return None

    return ProbeCLI


def _parse(args: list[str], instantiate: bool) -> Any:
    from recipes.run.errors import parse_error_message

    cls = _cli_class(instantiate)
    argv, sys.argv = sys.argv, sys.argv[:1]  # the CLI is given its args; the sweep's own are not for it
    try:
        return cls(args=args, parser_kwargs={"exit_on_error": False})
    except _Parsed as parsed:
        return parsed.cli
    except argparse.ArgumentError as err:
        unknown = re.search(r"Option '([^']+)' is not accepted", str(err))
        if unknown:  # a key the recipe's classes do not take (jsonargparse nests it deep in a Union error)
            raise UsageError(f"no such parameter ({unknown.group(1)!r} is not accepted)") from None
        raise UsageError(parse_error_message(str(err))) from None
    except (ValueError, TypeError, FileNotFoundError) as err:
        message = str(err)
        if message.startswith("Does not validate against any of the Union subtypes"):
            message = parse_error_message(message)
        raise UsageError(" ".join(message.split())) from None
    finally:
        sys.argv = argv


def _validation_metrics(model: Any, datamodule: Any) -> list[str]:
    from lightning.pytorch import Trainer

    for name in ("lightning.pytorch", "lightning.fabric", "lightning.pytorch.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.ERROR)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
                      num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.validate(model, datamodule=datamodule, verbose=False)
    return sorted(str(k) for k in trainer.callback_metrics)


def check_recipe(configs: Sequence[str], extra: Sequence[str], space: Space, space_path: str,
                 metric: str) -> Recipe:
    """Parse the recipe with ``extra`` and the space's probes, build it, and check ``metric``.

    Raises:
        UsageError: naming the override, the space key or the metric that is wrong.
    """
    from recipes.run.process import quiet_known_noise

    quiet_known_noise()
    base = [a for c in configs for a in ("--config", c)] + list(extra)
    clash = sorted(k for k in space if f"--{k}" in extra or any(a.startswith(f"--{k}=") for a in extra))
    if clash:
        raise UsageError(f"--{clash[0]} is both in the space ({space_path}) and passed as an override; "
                         "drop one of them")
    _parse(base, instantiate=False)  # the overrides alone: an error here is theirs
    probe = probe_params(space)
    try:
        cli = _parse(base + override_args(probe), instantiate=True)
    except UsageError as err:
        key = _key_named(str(err), space)
        if key is None:
            raise
        message = str(err).removeprefix(f"{key}: ")
        raise UsageError(f"--space {space_path}: {key}: {message}") from None
    for key, dist in space.items():
        if isinstance(dist, CategoricalDistribution):
            for choice in dist.choices[1:]:
                try:
                    _parse(base + override_args({**probe, key: choice}), instantiate=False)
                except UsageError as err:
                    raise UsageError(f"--space {space_path}: {key}: choice {choice!r}: {err}") from None
    for key in space:  # a key jsonargparse accepted must also name something of the parsed config
        if cli.config.get(key) is None and _missing(cli.config, key):
            raise UsageError(f"--space {space_path}: {key} is not a key of the recipe's config")
    try:
        logged = _validation_metrics(cli.model, cli.datamodule)
    except Exception as err:  # the recipe cannot validate at all: every trial would fail the same way
        raise UsageError(f"the recipe failed its check validation ({type(err).__name__}: "
                         f"{' '.join(str(err).split())[:300]})") from None
    if metric not in logged:
        raise UsageError(f"--metric {metric}: the recipe's validation never logs it (it logs: "
                         f"{', '.join(m for m in logged if '/' in m) or 'nothing'})")
    cfg = cli.config
    return Recipe(experiment=str(cfg.experiment), runs_root=str(cfg.runs_root), validation_metrics=logged)


def _missing(cfg: Any, key: str) -> bool:
    node: Any = cfg
    for part in key.split("."):
        try:
            if part not in node:
                return True
            node = node[part]
        except TypeError:
            return True
    return False


def _key_named(message: str, space: Space) -> str | None:
    """The space key a parse error is about (the longest whose last part the message names)."""
    found = [k for k in space if k in message or re.search(rf"\b{re.escape(k.rsplit('.', 1)[-1])}\b", message)]
    return max(found, key=len) if found else None
