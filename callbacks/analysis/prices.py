"""The instance price catalog: load it, validate it, look an instance up, override a price.

The catalog is a YAML mapping from instance name to its provider, region, GPU model and count,
on-demand and spot prices in USD per instance-hour, and the source and date of those prices
(``callbacks/analysis/prices.yaml`` ships with the repository). Prices move and differ by region and contract,
so every row says where it came from, and a caller can point at its own file or override one price.
A row may also give a typical spot interruption rate (a probability per period, with its source):
``recipes.plan`` uses it when ``--interruption-rate`` is not given.

Pure module (PyYAML only; no Lightning, no torch).

Example::

    >>> catalog = load_catalog()
    >>> price_for(get_instance(catalog, "a3-highgpu-1g"), "spot")
    4.42
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

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


def _check_price(name: str, field: str, value: Any, required: bool) -> float | None:
    if value is None:
        if required:
            raise ValueError(f"instance {name!r}: {field} is missing (USD per instance-hour).")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"instance {name!r}: {field}={value!r} is not a number.")
    if not value >= 0 or math.isinf(value):
        raise ValueError(f"instance {name!r}: {field}={value!r} must be a finite price >= 0.")
    return float(value)


@dataclass(frozen=True)
class Instance:
    """One catalog row. Constructing it validates it.

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
        _check_price(self.name, "on_demand_usd_per_h", self.on_demand_usd_per_h, required=True)
        _check_price(self.name, "spot_usd_per_h", self.spot_usd_per_h, required=False)
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 0:
            raise ValueError(f"instance {self.name!r}: gpus={self.gpus!r} must be an integer >= 0.")
        rate, period = self.spot_interruption_rate, self.spot_interruption_period_h
        if rate is None:
            return
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
            raise ValueError(f"instance {self.name!r}: spot_interruption_rate={rate!r} must be a probability "
                             "in [0, 1) per spot_interruption_period_h.")
        if isinstance(period, bool) or not isinstance(period, (int, float)) or not 0 < period < math.inf:
            raise ValueError(f"instance {self.name!r}: spot_interruption_period_h={period!r} must be a positive "
                             "number of hours (the period of spot_interruption_rate).")
        if not (self.spot_interruption_source or "").strip():
            raise ValueError(f"instance {self.name!r}: spot_interruption_source is missing: say where the rate "
                             "comes from, or that it is an assumption.")

    @property
    def devices_per_instance(self) -> int:
        """Devices one instance contributes: its GPU count, or 1 for a machine without GPUs."""
        return self.gpus if self.gpus > 0 else 1


def _instance_from_entry(name: str, entry: Any) -> Instance:
    if not isinstance(entry, dict):
        raise ValueError(f"instance {name!r}: expected a mapping of fields, got {entry!r}.")
    for field in ("provider", "gpus", "source", "date"):
        if entry.get(field) is None:
            raise ValueError(f"instance {name!r}: {field} is missing.")
    return Instance(
        name=str(name),
        provider=str(entry["provider"]),
        region=str(entry.get("region", "")),
        gpu=None if entry.get("gpu") is None else str(entry["gpu"]),
        gpus=entry["gpus"],
        on_demand_usd_per_h=_check_price(name, "on_demand_usd_per_h", entry.get("on_demand_usd_per_h"), True),
        spot_usd_per_h=_check_price(name, "spot_usd_per_h", entry.get("spot_usd_per_h"), False),
        source=str(entry["source"]),
        date=str(entry["date"]),
        spot_interruption_rate=_as_float(entry.get("spot_interruption_rate")),
        spot_interruption_period_h=_as_float(entry.get("spot_interruption_period_h")),
        spot_interruption_source=None if entry.get("spot_interruption_source") is None
        else str(entry["spot_interruption_source"]).strip(),
    )


def _as_float(value: Any) -> Any:
    """An integer as a float (``24`` -> ``24.0``); anything else as given, for :class:`Instance` to validate."""
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


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
        changes["on_demand_usd_per_h"] = _check_price(instance.name, "on_demand_usd_per_h", on_demand, True)
        notes.append("on-demand")
    if spot is not None:
        changes["spot_usd_per_h"] = _check_price(instance.name, "spot_usd_per_h", spot, True)
        notes.append("spot")
    if not changes:
        return instance
    changes["source"] = f"{instance.source}; {' and '.join(notes)} price overridden by the user"
    return dataclasses.replace(instance, **changes)
