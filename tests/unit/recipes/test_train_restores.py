"""``recipes.api.process_state_kept``: what ``train`` changes for the whole process goes back, raised or returned.

The end-to-end case (a fresh interpreter, a refused and a finished ``train``) is tests/e2e/test_train_restores.py.
"""

from __future__ import annotations

import logging
import os
import warnings

import pytest

from recipes.api import process_state_kept


def test_logging_warnings_filters_and_environment_go_back_when_the_launch_raises(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATSCALE_TEST_CHANGED", "before")
    monkeypatch.setenv("ATSCALE_TEST_REMOVED", "kept")
    monkeypatch.delenv("ATSCALE_TEST_ADDED", raising=False)
    root, existing = logging.getLogger(), logging.getLogger("atscale.test.existing")
    monkeypatch.setattr(existing, "level", logging.INFO)
    level, handlers, root_filters = root.level, root.handlers[:], root.filters[:]
    filters, environ = warnings.filters[:], dict(os.environ)
    with pytest.raises(RuntimeError, match="the launch failed"), process_state_kept():
        root.setLevel(logging.ERROR)  # as importing mlflow.pytorch does (logging.basicConfig(level=ERROR))
        root.addHandler(logging.NullHandler())
        root.addFilter(logging.Filter("x"))
        existing.setLevel(logging.CRITICAL)
        logging.getLogger("atscale.test.created").setLevel(logging.WARNING)
        warnings.filterwarnings("ignore", message="quiet")
        warnings.simplefilter("error")
        os.environ["ATSCALE_TEST_ADDED"] = "1"
        os.environ["ATSCALE_TEST_CHANGED"] = "after"
        del os.environ["ATSCALE_TEST_REMOVED"]
        raise RuntimeError("the launch failed")
    assert (root.level, root.handlers, root.filters) == (level, handlers, root_filters)
    assert existing.level == logging.INFO
    assert logging.getLogger("atscale.test.created").level == logging.WARNING  # created inside: the library's own
    assert warnings.filters == filters
    assert dict(os.environ) == environ

