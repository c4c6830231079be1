"""The served classifier reads its classes, costs and rule from serving.json and decides by them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import mlflow
import numpy as np
import pytest
import torch

from callbacks.utils.served_classifier import ServedClassifier


def _fixed_logits() -> torch.nn.Module:
    """A network whose logits are ``log([0.5, 0.3, 0.2])`` for every 8x8 image (zero weights, that bias)."""
    linear = torch.nn.Linear(64, 3)
    with torch.no_grad():
        linear.weight.zero_()
        linear.bias.copy_(torch.log(torch.tensor([0.5, 0.3, 0.2])))
    return torch.nn.Sequential(torch.nn.Flatten(), linear)


@pytest.fixture
def served(tmp_path: Path) -> ServedClassifier:
    # pickled (MLflow's traced 'pt2' format, the recipe's, takes seconds to export); requirements given, not inferred
    mlflow.pytorch.save_model(_fixed_logits(), str(tmp_path / "network"), serialization_format="pickle",
                              pip_requirements=["torch"])
    # deciding "a" when the truth is "c" costs 10: the bayes rule avoids "a" although it is the most probable
    costs = [[0, 1, 1], [1, 0, 1], [10, 1, 0]]
    (tmp_path / "serving.json").write_text(json.dumps({"classes": ["a", "b", "c"], "decision": "bayes",
                                                       "costs": costs}))
    model = ServedClassifier()
    model.load_context(SimpleNamespace(artifacts={"network": str(tmp_path / "network"),
                                                  "serving": str(tmp_path / "serving.json")}))
    return model


def test_decides_by_the_configured_rule_and_a_request_may_pick_another(served: ServedClassifier) -> None:
    images = np.zeros((2, 1, 8, 8), dtype=np.float32)
    # expected cost of deciding a: 0.3*1 + 0.2*10 = 2.3; b: 0.5*1 + 0.2*1 = 0.7; c: 0.5*1 + 0.3*1 = 0.8
    (bayes, _) = served.predict(None, images)
    assert (bayes["decision"], bayes["class_index"], bayes["rule"]) == ("b", 1, "bayes")
    assert bayes["expected_cost"] == pytest.approx(0.7)
    assert bayes["probabilities"] == pytest.approx({"a": 0.5, "b": 0.3, "c": 0.2})
    (argmax, _) = served.predict(None, images, params={"decision": "argmax"})
    assert (argmax["decision"], argmax["rule"]) == ("a", "argmax")
    assert argmax["expected_cost"] == pytest.approx(2.3)
