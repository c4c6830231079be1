"""The served classifier: an MLflow pyfunc model that answers with a decision, probabilities and class names.

:class:`callbacks.mlflow_model.LogModel` logs this file as the model's code (MLflow "models from code"),
with the trained network (an MLflow PyTorch model) as its ``network`` artifact, the cost matrix, class
names and decision rule as its ``serving.json`` artifact, and :mod:`callbacks.analysis.decision_cost` as its code
dependency. MLflow's own server serves it::

    mlflow models serve -m models:/digits@champion --env-manager local --port 5000
    curl -s localhost:5000/invocations -H 'Content-Type: application/json' -d @serving_input_example.json

Input: images as a tensor (``{"inputs": [...]}``, shape ``(N, C, H, W)``, float32). Output, one record
per image::

    {"decision": "3", "class_index": 3, "rule": "bayes", "expected_cost": 0.012,
     "probabilities": {"0": 0.0001, ..., "9": 0.0003}}

``decision`` is the class the rule chose (``argmax``: the most probable; ``bayes``: the least expected
cost under the probabilities), ``expected_cost`` the expected cost of that decision under the model's
own probabilities. A request may pick the rule: ``{"inputs": ..., "params": {"decision": "argmax"}}``.
In Python, ``mlflow.pyfunc.load_model(uri).unwrap_python_model().network`` is the PyTorch network.
"""

import json
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import torch

try:  # inside a logged model: MLflow puts the model's code/ folder (decision_cost.py) on sys.path
    from decision_cost import decide, decision_costs
except ImportError:  # in this repository (MLflow runs this file once while logging it)
    from callbacks.analysis.decision_cost import decide, decision_costs


class ServedClassifier(mlflow.pyfunc.PythonModel):
    """Network logits -> softmax probabilities -> the decision of the configured (or requested) rule."""

    def load_context(self, context: Any) -> None:
        config = json.loads(Path(context.artifacts["serving"]).read_text())
        self.classes = [str(name) for name in config["classes"]]
        self.costs = np.asarray(config["costs"], dtype=np.float64)
        self.decision = str(config["decision"])
        self.network = mlflow.pytorch.load_model(context.artifacts["network"])

    def probabilities(self, images: Any) -> np.ndarray:
        """The softmax of the network's logits, ``(N, K)`` float64."""
        x = torch.as_tensor(np.asarray(images, dtype=np.float32))
        with torch.no_grad():
            logits = self.network(x)
        return logits.float().softmax(dim=-1).double().numpy()

    # an ndarray input: MLflow infers no schema from this hint (the logged signature has one) and validates nothing
    def predict(self, context: Any, model_input: np.ndarray, params: dict[str, Any] | None = None) -> list[dict]:
        rule = str((params or {}).get("decision") or self.decision)
        probs = self.probabilities(model_input)
        decisions = decide(self.costs, probs, rule)
        risks = decision_costs(self.costs, probs)
        return [{"decision": self.classes[d], "class_index": int(d), "rule": rule,
                 "expected_cost": float(risks[k, d]),
                 "probabilities": {name: float(p) for name, p in zip(self.classes, probs[k], strict=True)}}
                for k, d in enumerate(decisions)]


mlflow.models.set_model(ServedClassifier())
