"""``ExpectedCost``: a torchmetrics metric, the mean misclassification cost of a classifier's decisions.

The cost matrix and the decision rules are defined in :mod:`.analysis.decision_cost` (pure numpy; the
served model and the baselines use it): ``C[i][j]`` costs deciding ``j`` when the truth is ``i``;
``"argmax"`` decides the most probable class, ``"bayes"`` the class of least expected cost under the
model's probabilities, ``argmin_j sum_i p_i C[i][j]``. This metric applies the same rules to batches
of logits on the model's device and accumulates ``sum C[y][d]`` and the count, so it is exact under DDP
(torchmetrics sums both over ranks before dividing).

A classifier logs two of them per validation (see :class:`recipes.classifier.ImageClassifier`):

==============================  ==========================================================
key                             meaning
==============================  ==========================================================
``val/expected_cost``           mean cost of the argmax decisions (0/1 matrix: error rate)
``val/bayes_expected_cost``     mean cost of the Bayes decisions (never more, in expectation)
==============================  ==========================================================

Example::

    cost = ExpectedCost([[0, 1, 4], [1, 0, 1], [1, 1, 0]], decision="bayes")
    cost.update(logits, labels)
    cost.compute()

Copy with it (paths under ``recipes/``, each folder with an ``__init__.py``):
``callbacks/analysis/decision_cost.py`` put beside it, under its own name (the import falls back to that
place when no ``callbacks`` package is there).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torchmetrics import Metric

try:  # in this repository
    from callbacks.analysis.decision_cost import DECISION_RULES, check_cost_matrix
except ModuleNotFoundError as missing:  # copied into another project (see "Copy with it" above)
    if missing.name != "callbacks":
        raise
    from .decision_cost import DECISION_RULES, check_cost_matrix  # type: ignore[no-redef]

__all__ = ["ExpectedCost", "torch_decisions"]


def torch_decisions(costs: torch.Tensor, logits: torch.Tensor, rule: str) -> torch.Tensor:
    """The decisions of ``rule`` for a batch of logits (torch twin of :func:`.analysis.decision_cost.decide`)."""
    if rule == "argmax":
        return logits.argmax(dim=-1)
    probs = logits.float().softmax(dim=-1).to(costs.dtype)
    return (probs @ costs).argmin(dim=-1)


class ExpectedCost(Metric):
    """Mean of ``C[y][d]`` over the examples seen, ``d`` the decisions of ``decision`` on the logits.

    Args:
        cost_matrix: ``(K, K)`` costs, rows = truth, columns = decision (a list of rows or an array).
        decision: ``"argmax"`` or ``"bayes"``.
        kwargs: torchmetrics' ``Metric`` options.

    Raises:
        ValueError: an unknown decision rule, or a bad matrix (named by :func:`check_cost_matrix`).
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    total: torch.Tensor
    count: torch.Tensor

    def __init__(self, cost_matrix: Any, decision: str = "argmax", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if decision not in DECISION_RULES:
            raise ValueError(f"ExpectedCost(decision={decision!r}) is not one of {', '.join(DECISION_RULES)}.")
        self.decision = decision
        costs = check_cost_matrix(np.asarray(cost_matrix, dtype=np.float64))
        self.register_buffer("costs", torch.as_tensor(costs, dtype=torch.float64), persistent=False)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        """Add a batch: ``logits`` ``(N, K)``, ``target`` ``(N,)`` class indices."""
        decisions = torch_decisions(self.costs, logits.detach(), self.decision)
        self.total += self.costs[target, decisions].sum()
        self.count += target.numel()

    def compute(self) -> torch.Tensor:
        """The mean cost per example (NaN before any update)."""
        return (self.total / self.count).float() if self.count > 0 else torch.tensor(float("nan"))
