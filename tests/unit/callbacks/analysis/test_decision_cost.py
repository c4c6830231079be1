"""Cost-sensitive evaluation (issue 14), fast: the cost math against hand-computed values, the torchmetrics
metric, the baselines' costs and the classifier's logged keys (the served model: test_decision_cost_e2e.py).

The 3-class toy used throughout (rows = truth, columns = decision)::

    C = [[0, 1, 4],        p (4 examples)        p @ C (expected cost of deciding 0, 1, 2)   label
         [2, 0, 1],        [0.5, 0.1, 0.4]       [2.2, 0.9, 2.1]   argmax 0, Bayes 1         2
         [5, 1, 0]]        [0.2, 0.7, 0.1]       [1.9, 0.3, 1.5]   argmax 1, Bayes 1         0
                           [0.3, 0.3, 0.4]       [2.6, 0.7, 1.5]   argmax 2, Bayes 1         0
                           [0.1, 0.2, 0.7]       [3.9, 0.8, 0.6]   argmax 2, Bayes 2         2

argmax decisions cost C[2][0] + C[0][1] + C[0][2] + C[2][2] = 5 + 1 + 4 + 0 = 10, mean 2.5;
Bayes decisions cost C[2][1] + C[0][1] + C[0][1] + C[2][2] = 1 + 1 + 1 + 0 = 3, mean 0.75.
(The first example: deciding 0 risks 0.1*2 + 0.4*5 = 2.2, deciding 1 only 0.5*1 + 0.4*1 = 0.9.)
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from callbacks.analysis.decision_cost import (
    CostMatrixError,
    argmax_decisions,
    bayes_decisions,
    check_cost_matrix,
    decide,
    decision_costs,
    expected_cost,
    load_cost_matrix,
    zero_one,
)
from callbacks.baselines import Baselines, fit_baselines
from datamodules.digits import DigitsDataModule
from recipes.classifier import ImageClassifier
from recipes.compare import baselines_for, default_mode
from recipes.metrics import ExpectedCost
from tests.conftest import CONFIGS, RecordingLogger

C = [[0, 1, 4], [2, 0, 1], [5, 1, 0]]
P = np.array([[0.5, 0.1, 0.4], [0.2, 0.7, 0.1], [0.3, 0.3, 0.4], [0.1, 0.2, 0.7]])
Y = np.array([2, 0, 0, 2])


def test_toy_decisions_and_expected_costs_by_hand() -> None:
    costs = check_cost_matrix(C)
    assert decision_costs(costs, P) == pytest.approx(
        np.array([[2.2, 0.9, 2.1], [1.9, 0.3, 1.5], [2.6, 0.7, 1.5], [3.9, 0.8, 0.6]]), abs=1e-12)
    assert argmax_decisions(P).tolist() == [0, 1, 2, 2]
    assert bayes_decisions(costs, P).tolist() == [1, 1, 1, 2]
    assert expected_cost(costs, Y, argmax_decisions(P)) == 2.5
    assert expected_cost(costs, Y, bayes_decisions(costs, P)) == 0.75
    assert decide(costs, P, "bayes").tolist() == [1, 1, 1, 2]
    with pytest.raises(ValueError, match="'cheapest' is not one of argmax, bayes"):
        decide(costs, P, "cheapest")


def test_zero_one_matrix_gives_error_rate_and_bayes_is_argmax() -> None:
    costs = zero_one(3)
    assert costs.tolist() == [[0, 1, 1], [1, 0, 1], [1, 1, 0]]
    assert bayes_decisions(costs, P).tolist() == argmax_decisions(P).tolist()
    assert expected_cost(costs, Y, argmax_decisions(P)) == 0.75  # 3 of 4 wrong
    matrix = load_cost_matrix(None, 3)
    assert matrix.is_zero_one and matrix.classes == ("0", "1", "2") and matrix.source == "0/1 default"


def test_torchmetrics_expected_cost_matches_by_hand_over_two_batches() -> None:
    logits = torch.log(torch.tensor(P))
    argmax, bayes = ExpectedCost(C, "argmax"), ExpectedCost(C, "bayes")
    for metric in (argmax, bayes):
        metric.update(logits[:3], torch.tensor(Y[:3]))
        metric.update(logits[3:], torch.tensor(Y[3:]))
    assert (argmax.compute().item(), bayes.compute().item()) == (2.5, 0.75)
    assert not list(argmax.state_dict())  # nothing of it in a checkpoint
    with pytest.raises(ValueError, match=r"^ExpectedCost\(decision='min'\) is not one of argmax, bayes.$"):
        ExpectedCost(C, "min")


def test_loads_yaml_with_classes_and_story_and_csv(tmp_path: Path) -> None:
    digits = load_cost_matrix(CONFIGS / "costs" / "digits-cheques.yaml", 10)
    assert digits.costs[3, 8] == 10 and digits.costs[8, 3] == 1 and digits.costs[5, 5] == 0  # overpay 10, underpay 1
    assert digits.classes == tuple("0123456789") and digits.story.startswith("A cheque-reading machine")
    csv = tmp_path / "c.csv"
    csv.write_text("# truth 0, 1, 2\n0, 1, 4\n2,0,1\n\n5, 1, 0  # a comment\n")
    assert load_cost_matrix(csv, 3).costs.tolist() == C
    yml = tmp_path / "c.yaml"
    yml.write_text("costs: [[0, 1, 4], [2, 0, 1], [5, 1, 0]]\nclasses: [cat, dog, eel]\n")
    assert load_cost_matrix(yml, 3).classes == ("cat", "dog", "eel")
    assert load_cost_matrix(yml, 3, classes=["a", "b", "c"]).classes == ("a", "b", "c")  # the config's win
    assert load_cost_matrix("c.csv", 3, base_dirs=[tmp_path]).costs.tolist() == C  # relative: also base_dirs


@pytest.mark.parametrize(("rows", "message"), [
    ([[0, 1], [1, 0]], "cost matrix (inline) has 2 rows; 3 classes need a 3x3 matrix."),
    ([[0, 1, 4], [2, 0], [5, 1, 0]], "cost matrix (inline): row 1 has 2 entries [2, 0]; a 3x3 matrix needs 3."),
    ([[0, 1, 4], [2, 0, -1], [5, 1, 0]], "cost matrix (inline): row 1, column 2 is -1; costs must not be negative."),
    ([[0, 1, 4], [2, 0, "ten"], [5, 1, 0]], "cost matrix (inline): row 1, column 2 is 'ten', not a number."),
    ([[0, 1, 4], [None, 0, 1], [5, 1, 0]], "cost matrix (inline): row 1, column 0 is None, not a number."),
    ([[0, True, 4], [2, 0, 1], [5, 1, 0]], "cost matrix (inline): row 0, column 1 is True, not a number."),
    ([[0, 1, "inf"], [2, 0, 1], [5, 1, 0]], "cost matrix (inline): row 0, column 2 is 'inf'; costs must be finite."),
    ("0,1;1,0", None),
])
def test_bad_matrix_names_the_value(rows: object, message: str | None) -> None:
    with pytest.raises(CostMatrixError) as err:
        load_cost_matrix(rows if not isinstance(rows, str) else [rows], 3)
    if message is not None:
        assert str(err.value) == message


@pytest.mark.parametrize(("name", "text", "message"), [
    ("c.csv", "0,1,4\n2,0,x\n5,1,0\n", "cost matrix (c.csv): row 1, column 2 is 'x', not a number."),
    ("c.yaml", "costs: [[0, 1], [1, 0]]\n", "cost matrix (c.yaml) has 2 rows; 3 classes need a 3x3 matrix."),
    ("c.yaml", "matrix: [[0, 1], [1, 0]]\n", "cost matrix file c.yaml has no 'costs:' key (found: matrix)."),
    ("c.yaml", "costs: [[0, 1, 4], [2, 0, 1], [5, 1, 0]]\nclasses: [a, b]\n",
     "cost matrix (c.yaml): classes ['a', 'b'] must list 3 names, one per row."),
    ("c.txt", "0 1 4\n", "cost matrix file c.txt must end in .yaml, .yml or .csv."),
    ("absent.csv", None, "cost matrix file absent.csv not found (give a .yaml or .csv file, or the rows inline)."),
])
def test_bad_file_names_the_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, text: str | None,
                                  message: str) -> None:
    monkeypatch.chdir(tmp_path)
    if text is not None:
        (tmp_path / name).write_text(text)
    with pytest.raises(CostMatrixError) as err:
        load_cost_matrix(name, 3)
    assert str(err.value) == message


def test_classifier_rejects_bad_costs_naming_them() -> None:
    with pytest.raises(ValueError, match=r"^ImageClassifier\(costs=\[...\]\): cost matrix \(inline\): row 0, "
                                         r"column 1 is -2; costs must not be negative.$"):
        ImageClassifier(num_classes=2, costs=[[0, -2], [1, 0]])
    with pytest.raises(ValueError, match=r"^ImageClassifier\(costs='no.yaml'\): cost matrix file no.yaml not found"):
        ImageClassifier(num_classes=2, costs="no.yaml")


def test_baselines_costs_by_hand() -> None:
    # majority: train labels are mostly 0, so it always decides 0; val truths 2, 0, 1 -> C[2][0] + 0 + C[1][0] = 7
    corners = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])  # one cluster per class, far apart
    y_train = np.array([0] * 6 + [1] * 3 + [2] * 3)
    x_train = corners[y_train] + np.tile([[0.0, 0.0], [0.5, 0.0], [0.0, 0.5]], (4, 1))
    y_val = np.array([2, 0, 1])
    x_val = corners[y_val] + 0.25
    results = fit_baselines(x_train, y_train, x_val, y_val, cost_matrix=np.array(C, dtype=float))
    assert results["baseline/majority_expected_cost"] == pytest.approx(7 / 3, abs=1e-12)
    assert results["baseline/majority_acc"] == pytest.approx(1 / 3, abs=1e-12)
    # the linear model separates these: no error, no cost, whichever rule
    assert (results["baseline/linear_acc"], results["baseline/linear_expected_cost"],
            results["baseline/linear_bayes_expected_cost"]) == (1.0, 0.0, 0.0)
    assert set(fit_baselines(x_train, y_train, x_val, y_val)) == {"baseline/majority_acc", "baseline/linear_acc"}


def test_summary_rows_compare_each_baseline_with_the_model_metric_of_its_kind() -> None:
    baselines = Baselines(metric="val/acc")
    baselines.results = {"baseline/linear_acc": 0.9, "baseline/linear_expected_cost": 0.5,
                         "baseline/linear_bayes_expected_cost": 0.25}
    rows = baselines.summary_rows({"val/acc": 0.95, "val/expected_cost": 0.25, "val/bayes_expected_cost": 0.125})
    assert rows == [("baseline/linear_acc", "0.9000  (model +0.0500)"),
                    ("baseline/linear_expected_cost", "0.5000  (model -0.2500)"),
                    ("baseline/linear_bayes_expected_cost", "0.2500  (model -0.1250)")]


def test_compare_and_promote_pick_cost_baselines_and_min() -> None:
    assert default_mode("val/expected_cost") == default_mode("cost/usd") == "min"
    assert baselines_for("val/expected_cost") == ("baseline/linear_expected_cost", "baseline/majority_expected_cost")
    assert baselines_for("val/bayes_expected_cost")[0] == "baseline/linear_bayes_expected_cost"
    assert baselines_for("val/acc") == ("baseline/linear_acc", "baseline/majority_acc")


@pytest.fixture(scope="module")
def short_fit() -> tuple[pl.Trainer, ImageClassifier, DigitsDataModule, RecordingLogger]:
    pl.seed_everything(0)
    model = ImageClassifier(costs=str(CONFIGS / "costs" / "digits-cheques.yaml"), decision="bayes")
    datamodule, logger = DigitsDataModule(), RecordingLogger()
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=2, logger=logger, callbacks=[Baselines()],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", devices=1)
    trainer.fit(model, datamodule=datamodule)
    return trainer, model, datamodule, logger


def test_classifier_logs_costs_equal_to_the_numpy_math_on_the_val_set(short_fit: tuple) -> None:
    trainer, model, datamodule, logger = short_fit
    logged = {k for _, m in logger.calls for k in m}
    assert {"val/expected_cost", "val/bayes_expected_cost", "baseline/majority_expected_cost",
            "baseline/linear_expected_cost", "baseline/linear_bayes_expected_cost"} <= logged
    model.eval()
    with torch.no_grad():
        batches = [(model(x).softmax(-1).double().numpy(), y.numpy()) for x, y in datamodule.val_dataloader()]
    probs, labels = np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])
    costs = model.cost_matrix.numpy()
    assert len(labels) == 360
    assert trainer.callback_metrics["val/expected_cost"].item() == pytest.approx(
        expected_cost(costs, labels, argmax_decisions(probs)), abs=1e-6)
    assert trainer.callback_metrics["val/bayes_expected_cost"].item() == pytest.approx(
        expected_cost(costs, labels, bayes_decisions(costs, probs)), abs=1e-6)
