"""The CLI's one-line messages, from jsonargparse's real error texts (captured from this version)."""

from __future__ import annotations

import pytest

from recipes.cli import parse_error_message, refused_changes, resumable_change

MAX_EPOCHS = ('Parser key "trainer.max_epochs":\n  Does not validate against any of the Union subtypes\n  Subtypes: '
              "[<class 'int'>, <class 'NoneType'>]\n  Errors:\n    - Expected a <class 'int'>\n    - Expected a "
              "<class 'NoneType'>\n  Given value type: <class 'str'>\n  Given value: many")
BATCH = ('Parser key "data":\n  Does not validate against any of the Union subtypes\n  Subtypes: [<class '
         "'lightning.pytorch.core.datamodule.LightningDataModule'>, <class 'NoneType'>]\n  Errors:\n    - Problem "
         "with given class_path 'datamodules.digits.DigitsDataModule':\n        Parser key \"batch_size\":\n          "
         "Expected a <class 'int'>. Got value: x\n    - Expected a <class 'NoneType'>\n  Given value type: <class "
         "'jsonargparse._util.NestedArg'>\n  Given value: NestedArg(key='batch_size', val='x')")
LR = ('Parser key "model":\n  Does not validate against any of the Union subtypes\n  Errors:\n    - Problem with '
      "given class_path 'recipes.classifier.ImageClassifier':\n        Parser key \"optimizer\":\n          Type "
      "typing.Callable expects a function or a callable class: Parser key \"lr\":\n\n            - Expected a path "
      "but abc either not accessible or invalid\n            Errors:\n              - Expected a <class 'float'>\n"
      "            Given value: abc. Got value: Namespace(class_path='torch.optim.AdamW')\n    - Expected a <class "
      "'NoneType'>\n  Given value type: <class 'jsonargparse._util.NestedArg'>\n  Given value: "
      "NestedArg(key='optimizer.init_args.lr', val='abc')")
REFUSED_BY_CLASS = ('Parser key "data":\n  Does not validate against any of the Union subtypes\n  Errors:\n    - '
                    "Problem with given class_path 'datamodules.vision.MNISTDataModule': data/MNIST is missing and "
                    "download is false\n    - Expected a <class 'NoneType'>\n  Given value: NestedArg(key="
                    "'download', val='false')")


@pytest.mark.parametrize(("message", "expected"), [
    (MAX_EPOCHS, "trainer.max_epochs: expected int, got 'many'"),
    (BATCH, "data.init_args.batch_size: expected int, got 'x'"),
    (LR, "model.init_args.optimizer.init_args.lr: expected float, got 'abc'"),
    (REFUSED_BY_CLASS, "data.init_args.download: data/MNIST is missing and download is false"),
    ("unrecognized arguments: --x 1", "unrecognized arguments: --x 1"),
])
def test_parse_error_message(message: str, expected: str) -> None:
    assert parse_error_message(message) == expected


@pytest.mark.parametrize(("key", "resumable"), [
    ("trainer.max_epochs", True), ("spot.every_n_steps", True), ("checkpoint.dirpath", True), ("config", True),
    ("trainer.strategy.init_args.data_parallel_size", True), ("model.init_args.optimizer.init_args.lr", False),
    ("data.init_args.batch_size", False), ("seed_everything", False), ("trainer.precision", False),
    ("checkpoint.monitor", False), ("spotless", False),
])
def test_resumable_change(key: str, resumable: bool) -> None:
    assert resumable_change(key) is resumable


def test_refused_changes_lists_only_changed_keys_that_would_be_ignored() -> None:
    logged = {"trainer.max_epochs": "1", "model.lr": "0.003", "seed_everything": "42", "gone": "x"}
    new = {"trainer.max_epochs": "2", "model.lr": "0.01", "seed_everything": "42", "added": "y"}
    assert refused_changes(logged, new) == [("model.lr", "0.003", "0.01")]


@pytest.mark.parametrize(("max_epochs", "expected"), [(-1, "Epoch 0"), (20, "Epoch 0/19"), (None, "Epoch 0")])
def test_progress_bar_has_no_negative_epoch_total(max_epochs: int | None, expected: str) -> None:
    from types import SimpleNamespace

    from callbacks.progress import RunProgressBar

    bar = RunProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=max_epochs)  # what the description reads
    assert bar._get_train_description(0).strip() == expected
