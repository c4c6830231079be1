"""The model summary of the image classifier counts its FLOPs: one example image of the datamodule's shape."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.model_summary import ModelSummary

from datamodules.digits import DigitsDataModule
from recipes.classifier import ImageClassifier


def test_the_summary_counts_the_flops_of_one_digit(tmp_path: Path) -> None:
    model = ImageClassifier(num_classes=10, in_channels=1, width=32)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, logger=False,
                      default_root_dir=tmp_path, enable_progress_bar=False, enable_checkpointing=False)
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=32))
    assert tuple(model.example_input_array.shape) == (1, 1, 8, 8)
    # multiply-adds x 2 of the two 3x3 convolutions on 8x8 and the two linear layers (ReLU and pooling: none)
    conv1 = 2 * 1 * 32 * 9 * 8 * 8
    conv2 = 2 * 32 * 64 * 9 * 8 * 8
    head = 2 * (64 * 16) * 128 + 2 * 128 * 10
    assert ModelSummary(model).total_flops == conv1 + conv2 + head == 2_660_864


def test_an_example_input_given_by_the_user_is_kept(tmp_path: Path) -> None:
    import torch

    model = ImageClassifier(num_classes=10, in_channels=1, width=4)
    model.example_input_array = torch.zeros(3, 1, 8, 8)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, logger=False,
                      default_root_dir=tmp_path, enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False)
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=32))
    assert tuple(model.example_input_array.shape) == (3, 1, 8, 8)
