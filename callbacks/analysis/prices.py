"""The instance price catalog: load it, validate it, look an instance up, override a price.

The catalog is a YAML mapping from instance name to its provider, region, GPU model and count,
on-demand and spot prices in USD per instance-hour, and the source and date of those prices
(``callbacks/analysis/prices.yaml`` ships with the repository). Prices move and differ by region and contract,
so every row says where it came from, and a caller can point at its own file or override one price.
A row may also give a typical spot interruption rate (a probability per period, with its source):
``recipes.plan`` uses it when ``--interruption-rate`` is not given.

Pure module (PyYAML and pydantic, which checks each row; no Lightning, no torch).

Example::

    >>> catalog = load_catalog()
    >>> price_for(get_instance(catalog, "a3-highgpu-1g"), "spot")
    4.42
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "DEFAULT_CATALOG",
    "MARKETS",
    "Instance",
    "get_instance",
    "load_catalog",
    "price_for",
    "with_overrides",
]

DEFAULT_CATALOG = Path(__file__).resolve().parent / "prices.yaml"  # package data: found after `pip install .`
MARKETS = ("on_demand", "spot")

#: What each checked field must be, said in the words of an error message.
_RULES = {
    "on_demand_usd_per_h": "must be a finite price >= 0.",
    "spot_usd_per_h": "must be a finite price >= 0.",
    "gpus": "must be an integer >= 0.",
    "spot_interruption_rate": "must be a probability in [0, 1) per spot_interruption_period_h.",
    "spot_interruption_period_h": "must be a positive number of hours (the period of spot_interruption_rate).",
}
_Text = Annotated[str, BeforeValidator(lambda v: v if v is None else str(v))]  # YAML may read a date or a number
_Note = Annotated[_Text, BeforeValidator(lambda v: v.strip() if isinstance(v, str) else v)]
_Price = Annotated[float, Field(ge=0, strict=True)]


class _Row(BaseModel):
    """The catalog row's schema: strict numbers (no bool, no numeric string), finite, within range."""

    model_config = ConfigDict(allow_inf_nan=False, frozen=True)

    name: _Text
    provider: _Text
    region: _Text = ""
    gpu: _Text | None = None
    gpus: Annotated[int, Field(ge=0, strict=True)]
    on_demand_usd_per_h: _Price
    spot_usd_per_h: _Price | None = None
    source: _Text
    date: _Text
    spot_interruption_rate: Annotated[float, Field(ge=0, lt=1, strict=True)] | None = None
    spot_interruption_period_h: Annotated[float, Field(gt=0, strict=True)] | None = None
    spot_interruption_source: _Note | None = None

    @model_validator(mode="after")
    def _a_rate_says_its_period_and_source(self) -> _Row:
        if self.spot_interruption_rate is None:
            return self
        if self.spot_interruption_period_h is None:
            raise ValueError(f"spot_interruption_period_h=None {_RULES['spot_interruption_period_h']}")
        if not self.spot_interruption_source:
            raise ValueError("spot_interruption_source is missing: say where the rate comes from, or that it is "
                             "an assumption.")
        return self


def _validated(name: str, fields: dict[str, Any]) -> _Row:
    """``fields`` checked against the schema; one :class:`ValueError` naming the instance and the first bad field."""
    try:
        return _Row.model_validate({**fields, "name": name})
    except ValidationError as err:
        first = err.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        if first["type"] == "missing" or (first["input"] is None and first["type"] != "value_error"):
            unit = " (USD per instance-hour)" if field.endswith("_usd_per_h") else ""
            problem = f"{field} is missing{unit}."
        elif first["type"] == "value_error":  # the row's own rule: its message says it all
            problem = str(first["ctx"]["error"])
        elif first["type"] == "float_type":
            problem = f"{field}={first['input']!r} is not a number."
        else:
            problem = f"{field}={first['input']!r} {_RULES.get(field, first['msg'])}"
        raise ValueError(f"instance {name!r}: {problem}") from None


@dataclass(frozen=True)
class Instance:
    """One catalog row. Constructing it validates it (the schema is :class:`_Row`'s, checked by pydantic).

    Args:
        name: Instance name, e.g. ``"a3-highgpu-1g"``.
        provider: Cloud provider (``gcp``, ``aws``, ``local``...).
        region: Region the prices are for.
        gpu: GPU model, or None for a machine without GPUs.
        gpus: GPUs per instance (>= 0; 0 for a CPU machine, which then counts as one device).
        on_demand_usd_per_h: On-demand price per instance-hour, USD (>= 0, required).
        spot_usd_per_h: Spot price per instance-hour, USD (>= 0), or None when the catalog has none.
        source: Where the prices come from.
        date: When they were read (``YYYY-MM``).
        spot_interruption_rate: Typical probability that one spot instance is interrupted per
            ``spot_interruption_period_h``, in [0, 1); None when the catalog has no figure.
        spot_interruption_period_h: The period of that rate, hours (> 0; required with a rate).
        spot_interruption_source: Where the rate comes from, or that it is an assumption (required
            with a rate).

    Raises:
        ValueError: If a price is missing, negative or not a number, ``gpus`` is not an integer >= 0,
            or an interruption rate is out of range or lacks its period or source; the message names
            the instance and the field.
    """

    name: str
    provider: str
    region: str
    gpu: str | None
    gpus: int
    on_demand_usd_per_h: float
    spot_usd_per_h: float | None
    source: str
    date: str
    spot_interruption_rate: float | None = None
    spot_interruption_period_h: float | None = None
    spot_interruption_source: str | None = None

    def __post_init__(self) -> None:
        row = _validated(self.name, dataclasses.asdict(self))
        for field in dataclasses.fields(self):  # as validated: integers given for prices become floats
            object.__setattr__(self, field.name, getattr(row, field.name))

    @property
    def devices_per_instance(self) -> int:
        """Devices one instance contributes: its GPU count, or 1 for a machine without GPUs."""
        return self.gpus if self.gpus > 0 else 1


def _instance_from_entry(name: str, entry: Any) -> Instance:
    if not isinstance(entry, dict):
        raise ValueError(f"instance {name!r}: expected a mapping of fields, got {entry!r}.")
    row = _validated(name, entry)
    return Instance(**row.model_dump())


def load_catalog(path: str | Path | None = None) -> dict[str, Instance]:
    """Load and validate a price catalog.

    Args:
        path: A YAML catalog; None for the repository's ``callbacks/analysis/prices.yaml``.

    Returns:
        The instances by name, in file order.

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: If the file is not YAML, not a mapping of instances, or a row is invalid; the
            message names the file, the instance and the field.
    """
    path = DEFAULT_CATALOG if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"price catalog {str(path)!r} does not exist.")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"price catalog {str(path)!r} is not valid YAML: {err}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(
            f"price catalog {str(path)!r} must be a non-empty mapping of instance name -> fields."
        )
    catalog: dict[str, Instance] = {}
    for name, entry in data.items():
        try:
            catalog[str(name)] = _instance_from_entry(str(name), entry)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
    return catalog


def get_instance(catalog: dict[str, Instance], name: str) -> Instance:
    """Look an instance up by name.

    Args:
        catalog: As returned by :func:`load_catalog`.
        name: The instance name.

    Returns:
        The :class:`Instance`.

    Raises:
        KeyError: If the catalog has no such instance; the message names it and lists the known ones.
    """
    try:
        return catalog[name]
    except KeyError:
        known = ", ".join(sorted(catalog))
        raise KeyError(f"unknown instance {name!r}; the catalog knows: {known}") from None


def price_for(instance: Instance, market: str) -> float:
    """Price per instance-hour on a market.

    Args:
        instance: The catalog row.
        market: ``"on_demand"`` or ``"spot"``.

    Returns:
        USD per instance-hour.

    Raises:
        ValueError: If ``market`` is unknown, or the catalog lacks a spot price for this instance.
    """
    if market == "on_demand":
        return instance.on_demand_usd_per_h
    if market == "spot":
        if instance.spot_usd_per_h is None:
            raise ValueError(
                f"the catalog lacks a spot price for instance {instance.name!r} ({instance.source}); "
                "give one with --price-spot or a catalog of your own."
            )
        return instance.spot_usd_per_h
    raise ValueError(f"market={market!r} must be one of {MARKETS}.")


def with_overrides(instance: Instance, on_demand: float | None = None, spot: float | None = None) -> Instance:
    """A copy of ``instance`` with its prices replaced where given.

    Args:
        instance: The catalog row.
        on_demand: New on-demand price per instance-hour, USD (>= 0), or None to keep it.
        spot: New spot price per instance-hour, USD (>= 0), or None to keep it.

    Returns:
        The new :class:`Instance`; its source says which prices were overridden.

    Raises:
        ValueError: If an override is negative or not a number; the message names the instance and field.
    """
    changes: dict[str, Any] = {}
    notes = []
    if on_demand is not None:
        changes["on_demand_usd_per_h"] = on_demand
        notes.append("on-demand")
    if spot is not None:
        changes["spot_usd_per_h"] = spot
        notes.append("spot")
    if not changes:
        return instance
    changes["source"] = f"{instance.source}; {' and '.join(notes)} price overridden by the user"
    return dataclasses.replace(instance, **changes)
