"""The search space of a sweep: a short YAML of config keys and their distributions.

Each top-level key is a ``recipes.fit`` config key, as ``--key value`` would set it; each value a
distribution::

    model.init_args.optimizer.init_args.lr: {type: float, low: 1.0e-4, high: 3.0e-2, log: true}
    model.init_args.width: {type: int, low: 16, high: 64, step: 16}
    model.init_args.dropout: {type: float, low: 0.0, high: 0.3}
    data.init_args.batch_size: [32, 64, 128]          # a list: categorical

``type`` is ``float`` (``low``, ``high``, optional ``log`` or ``step``), ``int`` (the same, integer bounds)
or ``categorical`` (``choices``: numbers, strings, booleans or null). A bad entry is a :class:`UsageError`
naming the key. Imports no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from recipes.run.common import UsageError

__all__ = ["Space", "load_space", "override_args", "parse_distribution"]

Space = dict[str, BaseDistribution]
_FIELDS = {"float": {"type", "low", "high", "log", "step"}, "int": {"type", "low", "high", "log", "step"},
           "categorical": {"type", "choices"}}


def _number(where: str, name: str, value: Any, integer: bool) -> float | int:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not math.isfinite(value):
        kind = "an integer" if integer else "a number"
        raise UsageError(f"{where}: {name} must be {kind}, got {value!r}")
    return value


def parse_distribution(where: str, spec: Any) -> BaseDistribution:
    """One space entry -> an Optuna distribution; :class:`UsageError` naming ``where`` (the file and key)."""
    if isinstance(spec, list):
        spec = {"type": "categorical", "choices": spec}
    if not isinstance(spec, Mapping):
        raise UsageError(f"{where}: expected a mapping with type: float|int|categorical (or a list of choices), "
                         f"got {spec!r}")
    kind = spec.get("type")
    if kind not in _FIELDS:
        raise UsageError(f"{where}: type {kind!r} is not one of float, int, categorical")
    unknown = sorted(set(spec) - _FIELDS[kind])
    if unknown:
        raise UsageError(f"{where}: unknown field(s) {', '.join(unknown)} for type {kind} "
                         f"(expected {', '.join(sorted(_FIELDS[kind] - {'type'}))})")
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise UsageError(f"{where}: choices must be a non-empty list, got {choices!r}")
        bad = [c for c in choices if c is not None and not isinstance(c, (bool, int, float, str))]
        if bad:
            raise UsageError(f"{where}: choice {bad[0]!r} is not a number, string, boolean or null")
        if len({json.dumps(c) for c in choices}) != len(choices):
            raise UsageError(f"{where}: choices {choices!r} repeat a value")
        return CategoricalDistribution(choices)
    integer = kind == "int"
    for field in ("low", "high"):
        if field not in spec:
            raise UsageError(f"{where}: {field} is required for type {kind}")
    low, high = (_number(where, f, spec[f], integer) for f in ("low", "high"))
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise UsageError(f"{where}: log must be true or false, got {log!r}")
    step = spec.get("step")
    if step is not None:
        step = _number(where, "step", step, integer)
        if step <= 0:
            raise UsageError(f"{where}: step must be > 0, got {step!r}")
        if log:
            raise UsageError(f"{where}: step and log: true cannot be combined")
    if not low < high:
        raise UsageError(f"{where}: low must be below high, got low={low!r}, high={high!r}")
    if log and low <= 0:
        raise UsageError(f"{where}: log: true needs low > 0, got low={low!r}")
    if integer:
        return IntDistribution(int(low), int(high), log=log, step=int(step or 1))
    return FloatDistribution(float(low), float(high), log=log, step=None if step is None else float(step))


def load_space(path: str) -> Space:
    """Read and check a space file (module docstring); :class:`UsageError` naming the file and the bad entry."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise UsageError(f"--space {path}: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise UsageError(f"--space {path}: not valid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(data, Mapping) or not data:
        raise UsageError(f"--space {path}: expected a mapping of config keys to distributions, got {data!r}")
    space: Space = {}
    for key, spec in data.items():
        if not isinstance(key, str) or not key or key.startswith("-") or " " in key:
            raise UsageError(f"--space {path}: {key!r} is not a config key (e.g. model.init_args.dropout)")
        space[key] = parse_distribution(f"--space {path}: {key}", spec)
    return space


def cli_value(value: Any) -> str:
    """A parameter value as ``recipes.fit`` reads it on its command line (jsonargparse parses YAML scalars)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def override_args(params: Mapping[str, Any]) -> list[str]:
    """``{"a.b": 0.1}`` -> ``["--a.b", "0.1"]``, in the space's order."""
    out: list[str] = []
    for key, value in params.items():
        out += [f"--{key}", cli_value(value)]
    return out


def probe_params(space: Space) -> dict[str, Any]:
    """One valid value per key (low bound, first choice): what the recipe check parses before any trial."""
    out: dict[str, Any] = {}
    for key, dist in space.items():
        if isinstance(dist, CategoricalDistribution):
            out[key] = dist.choices[0]
        else:
            out[key] = dist.low  # type: ignore[attr-defined]
    return out


def check_fixed(space: Space, params: Mapping[str, Any], where: str) -> None:
    """``--enqueue`` parameters: keys of the space, values inside their distributions."""
    for key, value in params.items():
        if key not in space:
            raise UsageError(f"{where}: {key!r} is not a key of the space (keys: {', '.join(space)})")
        dist = space[key]
        if isinstance(dist, CategoricalDistribution):
            inside = value in dist.choices
        else:
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            integer = not isinstance(dist, IntDistribution) or isinstance(value, int)
            inside = numeric and integer and dist.low <= value <= dist.high  # type: ignore[attr-defined]
        if not inside:
            raise UsageError(f"{where}: {key}={value!r} is outside its distribution {dist}")
