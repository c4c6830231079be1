"""The launch zygote's preparation (tests/forked.py): what its forks inherit must be what a new interpreter makes."""

from __future__ import annotations

import importlib.util

import pytest

from tests import forked


def test_mlflow_lists_installed_packages_once_a_process_so_the_zygote_can_make_the_list(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up only helps while MLflow keeps the list for the process; an upgrade that stops keeping it (or
    renames where it keeps it: ``monkeypatch`` refuses a missing attribute) fails here."""
    from mlflow.utils import requirements_utils

    listed = []
    real = requirements_utils.importlib_metadata.packages_distributions
    monkeypatch.setattr(requirements_utils, "_MODULES_TO_PACKAGES", None)  # as in a process that logged no model
    monkeypatch.setattr(requirements_utils.importlib_metadata, "packages_distributions",
                        lambda: listed.append(1) or real())
    forked._warm_requirement_check()
    assert listed == [1]
    requirements_utils.warn_dependency_requirement_mismatches(["torch", "mlflow", "cloudpickle"])  # a model's log
    assert listed == [1]


def test_every_preloaded_module_exists() -> None:
    """A name that an upgrade removed would stop the zygote at start: fail here first, naming it."""
    missing = [name for name in forked.PRELOAD if importlib.util.find_spec(name) is None]
    assert missing == []
