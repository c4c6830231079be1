"""Cost-sensitive decisions: a misclassification cost matrix, the expected cost of decisions, the Bayes decision.

Pure numpy (no torch, no Lightning): the training metric, the baselines and the served model all
decide and score with these functions.

``C[i][j]`` is the cost of deciding class ``j`` when the truth is class ``i`` (usually 0 on the diagonal).

- Expected cost of a set of decisions ``d_k`` on examples with labels ``y_k``: the mean of ``C[y_k][d_k]``.
  With the 0/1 matrix (0 on the diagonal, 1 elsewhere) it is the error rate.
- Bayes decision under predicted probabilities ``p``: ``d = argmin_j sum_i p_i C[i][j]``, the class whose
  expected cost under the model's beliefs is least. With the 0/1 matrix it is the argmax of ``p``.

A matrix is given inline (a list of rows) or as a file: YAML (a mapping with ``costs:`` rows and optional
``classes:`` names and ``story:``) or CSV (rows of numbers; ``#`` starts a comment)::

    # configs/costs/digits-cheques.yaml
    story: Reading a cheque amount ...
    classes: ["0", "1", ...]
    costs:
      - [0, 10, 10, ...]
      - ...

Example::

    C = load_cost_matrix([[0, 1, 4], [1, 0, 1], [1, 1, 0]], num_classes=3)
    p = np.array([[0.5, 0.1, 0.4]])
    argmax_decisions(p), bayes_decisions(C, p)   # [0], [2]: deciding 0 risks 0.4 * 4 = 1.6, deciding 2 risks 0.6
"""

from __future__ import annotations

import csv
import io
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["DECISION_RULES", "CostMatrix", "CostMatrixError", "argmax_decisions", "bayes_decisions",
           "check_cost_matrix", "decide", "decision_costs", "expected_cost", "load_cost_matrix", "zero_one"]

#: The decision rules a classifier may serve: the most probable class, or the least expected cost.
DECISION_RULES = ("argmax", "bayes")


class CostMatrixError(ValueError):
    """A cost matrix that cannot be used; the message names the bad value and where it came from."""


@dataclass(frozen=True)
class CostMatrix:
    """A validated cost matrix, with the class names and the story a file may give.

    Args:
        costs: ``(K, K)`` float64 array, ``costs[i, j]`` = cost of deciding ``j`` when the truth is ``i``.
        classes: the class names (``"0"``, ``"1"``... when none were given).
        story: why the costs are what they are (from the file), or ``""``.
        source: where the matrix came from (a path, ``"inline"`` or ``"0/1 default"``), for messages.
    """

    costs: np.ndarray
    classes: tuple[str, ...]
    story: str = ""
    source: str = "inline"

    @property
    def is_zero_one(self) -> bool:
        """Whether this is the 0/1 matrix (its expected cost is the error rate; Bayes = argmax)."""
        return bool(np.array_equal(self.costs, zero_one(len(self.costs))))


def zero_one(num_classes: int) -> np.ndarray:
    """The 0/1 cost matrix: every error costs 1, so the expected cost is the error rate."""
    return np.ones((num_classes, num_classes)) - np.eye(num_classes)


def _number(value: Any, where: str, source: str) -> float:
    """``value`` as a finite float; :class:`CostMatrixError` naming it otherwise (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise CostMatrixError(f"cost matrix ({source}): {where} is {value!r}, not a number.")
    try:
        number = float(value)
    except ValueError:
        raise CostMatrixError(f"cost matrix ({source}): {where} is {value!r}, not a number.") from None
    if not math.isfinite(number):
        raise CostMatrixError(f"cost matrix ({source}): {where} is {value!r}; costs must be finite.")
    return number


def check_cost_matrix(rows: Any, num_classes: int | None = None, source: str = "inline") -> np.ndarray:
    """Validate a cost matrix given as rows of numbers; returns it as a float64 array.

    Args:
        rows: a square sequence of sequences (or a 2-d array) of finite, non-negative numbers.
        num_classes: the number of classes it must cover (``None``: any, at least 2).
        source: where it came from, for the message.

    Raises:
        CostMatrixError: the shape is wrong, or an entry is not a number, negative or not finite. The
            message names the value and its row and column.
    """
    if isinstance(rows, np.ndarray):
        rows = rows.tolist()
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence) or not all(
            isinstance(r, Sequence) and not isinstance(r, (str, bytes)) for r in rows):
        raise CostMatrixError(f"cost matrix ({source}) must be a list of rows of numbers, got {rows!r}.")
    n = len(rows)
    expected = num_classes if num_classes is not None else n
    if n != expected:
        raise CostMatrixError(f"cost matrix ({source}) has {n} rows; {expected} classes need a {expected}x{expected} "
                              "matrix.")
    if n < 2:
        raise CostMatrixError(f"cost matrix ({source}) has {n} rows; a classifier needs at least 2 classes.")
    for i, row in enumerate(rows):
        if len(row) != n:
            raise CostMatrixError(f"cost matrix ({source}): row {i} has {len(row)} entries {list(row)!r}; a "
                                  f"{n}x{n} matrix needs {n}.")
    costs = np.array([[_number(v, f"row {i}, column {j}", source) for j, v in enumerate(row)]
                      for i, row in enumerate(rows)], dtype=np.float64)
    negative = np.argwhere(costs < 0)
    if len(negative):
        i, j = negative[0]
        raise CostMatrixError(f"cost matrix ({source}): row {i}, column {j} is {rows[i][j]!r}; costs must not be "
                              "negative.")
    return costs


def _read_csv(text: str) -> list[list[str]]:
    lines = [line.split("#", 1)[0] for line in text.splitlines()]
    return [[cell.strip() for cell in row] for row in csv.reader(io.StringIO("\n".join(lines))) if any(
        cell.strip() for cell in row)]


def _classes(names: Any, n: int, source: str) -> tuple[str, ...]:
    if names is None:
        return tuple(str(i) for i in range(n))
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence) or len(names) != n:
        raise CostMatrixError(f"cost matrix ({source}): classes {names!r} must list {n} names, one per row.")
    return tuple(str(name) for name in names)


def load_cost_matrix(spec: str | Path | Sequence[Sequence[Any]] | np.ndarray | None, num_classes: int,
                     classes: Sequence[str] | None = None, base_dirs: Sequence[Path] = ()) -> CostMatrix:
    """The cost matrix a config names: ``None`` (the 0/1 default), rows of numbers, or a YAML/CSV file.

    Args:
        spec: the config's value.
        num_classes: the classifier's number of classes (the matrix must be that square).
        classes: class names, when the file gives none (default ``"0"``, ``"1"``...).
        base_dirs: folders a relative path is also looked up in, after the working directory.

    Raises:
        CostMatrixError: a missing or unreadable file, or a bad matrix (see :func:`check_cost_matrix`).
    """
    if spec is None:
        return CostMatrix(zero_one(num_classes), _classes(classes, num_classes, "classes"), source="0/1 default")
    if not isinstance(spec, (str, Path)):
        costs = check_cost_matrix(spec, num_classes, "inline")
        return CostMatrix(costs, _classes(classes, num_classes, "inline"), source="inline")
    path = Path(spec).expanduser()
    if not path.is_absolute() and not path.exists():
        path = next((base / path for base in base_dirs if (base / path).exists()), path)
    source = str(spec)
    if not path.is_file():
        raise CostMatrixError(f"cost matrix file {source} not found (give a .yaml or .csv file, or the rows inline).")
    text = path.read_text()
    story, names = "", classes
    if path.suffix.lower() == ".csv":
        rows: Any = _read_csv(text)
    elif path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise CostMatrixError(f"cost matrix file {source} is not valid YAML ({' '.join(str(err).split())}).") \
                from None
        if isinstance(data, dict):
            if "costs" not in data:
                found = ", ".join(map(str, data))
                raise CostMatrixError(f"cost matrix file {source} has no 'costs:' key (found: {found}).")
            rows, story = data["costs"], str(data.get("story") or "").strip()
            names = classes if classes is not None else data.get("classes")
        else:
            rows = data
    else:
        raise CostMatrixError(f"cost matrix file {source} must end in .yaml, .yml or .csv.")
    costs = check_cost_matrix(rows, num_classes, source)
    return CostMatrix(costs, _classes(names, num_classes, source), story=story, source=source)


def argmax_decisions(probs: np.ndarray) -> np.ndarray:
    """The most probable class of each row (the first one among equals)."""
    return np.asarray(probs).argmax(axis=-1)


def decision_costs(costs: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """The expected cost of each decision under ``probs``: ``(probs @ C)[k, j] = sum_i p_ki C[i][j]``."""
    return np.asarray(probs, dtype=np.float64) @ np.asarray(costs, dtype=np.float64)


def bayes_decisions(costs: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """The Bayes decision of each row: ``argmin_j sum_i p_i C[i][j]`` (the first one among equals)."""
    return decision_costs(costs, probs).argmin(axis=-1)


def decide(costs: np.ndarray, probs: np.ndarray, rule: str) -> np.ndarray:
    """The decisions of rule ``"argmax"`` or ``"bayes"``.

    Raises:
        ValueError: naming an unknown rule.
    """
    if rule == "argmax":
        return argmax_decisions(probs)
    if rule == "bayes":
        return bayes_decisions(costs, probs)
    raise ValueError(f"decision rule {rule!r} is not one of {', '.join(DECISION_RULES)}.")


def expected_cost(costs: np.ndarray, labels: np.ndarray, decisions: np.ndarray) -> float:
    """The mean of ``C[y_k][d_k]``: what the decisions cost per example, on average."""
    labels, decisions = np.asarray(labels), np.asarray(decisions)
    if labels.shape != decisions.shape or labels.ndim != 1 or len(labels) == 0:
        raise ValueError(f"labels {labels.shape} and decisions {decisions.shape} must be the same non-empty 1-d shape.")
    return float(np.asarray(costs, dtype=np.float64)[labels, decisions].mean())
