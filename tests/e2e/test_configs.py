"""Every shipped YAML parses, and ``--print_config`` output fed back with ``--config`` gives the same config.

``--print_config`` never trains: it runs in-process (``fit_in_process``), the parse and print of ``recipes.fit``
without an interpreter start-up per config; the README's own ``--print_config`` command runs as a real process
in tests/e2e/test_readme_commands.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from callbacks.analysis.prices import load_catalog
from tests.conftest import CONFIGS, CliResult

RECIPES = sorted(CONFIGS.glob("*.yaml"))
FRAGMENTS = sorted((CONFIGS / "strategy").glob("*.yaml")) + sorted((CONFIGS / "precision").glob("*.yaml"))


def print_config(fit: Callable[..., CliResult], *configs: Path | str) -> str:
    args = [a for c in configs for a in ("--config", str(c))]
    result = fit(*args, "--print_config")
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def contains(printed: object, expected: object) -> bool:
    """Whether ``printed`` holds every value of ``expected`` (it also holds the defaults it filled in)."""
    if isinstance(expected, dict):
        return isinstance(printed, dict) and all(k in printed and contains(printed[k], v) for k, v in expected.items())
    if isinstance(expected, list):
        return isinstance(printed, list) and len(printed) == len(expected) and all(
            contains(p, e) for p, e in zip(printed, expected, strict=True))
    return printed == expected


def test_contains_is_strict_about_values() -> None:
    assert contains({"a": {"b": 1, "c": 2}}, {"a": {"b": 1}})
    assert not contains({"a": {"b": 1}}, {"a": {"b": 2}})
    assert not contains({"a": [1, 2]}, {"a": [1]})


def test_every_yaml_is_valid_yaml() -> None:
    for path in CONFIGS.rglob("*.yaml"):  # a Kubernetes file holds several documents
        documents = list(yaml.safe_load_all(path.read_text()))
        assert documents and all(isinstance(d, dict) for d in documents), path


def test_price_catalog_loads() -> None:
    assert "cpu-local" in load_catalog()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_parses_and_print_config_round_trips(tmp_path: Path, recipe: Path,
                                                    fit_in_process: Callable[..., CliResult]) -> None:
    printed = print_config(fit_in_process, recipe)
    assert yaml.safe_load(printed)["model"]["class_path"]
    dumped = tmp_path / "printed.yaml"
    dumped.write_text(printed)
    assert print_config(fit_in_process, dumped) == printed


@pytest.mark.parametrize("fragment", FRAGMENTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_fragment_composes_with_the_default_recipe(fragment: Path, fit_in_process: Callable[..., CliResult]) -> None:
    printed = yaml.safe_load(print_config(fit_in_process, CONFIGS / "digits.yaml", fragment))
    assert contains(printed["trainer"], yaml.safe_load(fragment.read_text())["trainer"])
    assert printed["model"]["class_path"] == "recipes.classifier.ImageClassifier"
