"""The benchmarks' synthetic workload: an MLP LightningModule and a random tensor data set of a chosen size.

What ``bench overhead`` and ``bench checkpoint`` train; the full recipe loads them by class path
(``--model recipes.bench.mlp.BenchModule``).
"""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from callbacks.analysis import keys


# ------------------------------------------------------------------ model and data
def mlp(features: int, hidden: int, layers: int, classes: int) -> nn.Sequential:
    """``layers`` hidden Linear+ReLU blocks of width ``hidden``."""
    blocks: list[nn.Module] = []
    width = features
    for _ in range(layers):
        blocks += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*blocks, nn.Linear(width, classes))


class BenchModule(pl.LightningModule):
    """The benchmark's classifier: an MLP on random features, AdamW, as the recipes train.

    Args:
        features: input width.
        hidden: hidden width.
        layers: hidden layers.
        classes: output classes.
        lr: learning rate.
        optimizer: ``adamw`` (as the recipes) or ``sgd`` (no optimizer state: the checkpoint is the weights).
    """

    def __init__(self, features: int = 1024, hidden: int = 1024, layers: int = 2, classes: int = 10,
                 lr: float = 1e-3, optimizer: Literal["adamw", "sgd"] = "adamw") -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)  # the recipe's LogModel rebuilds the module from them
        self.net = mlp(features, hidden, layers, classes)
        self.lr = lr
        self.optimizer = optimizer

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log(keys.TRAIN_LOSS_KEY, loss)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log(keys.VAL_ACC_KEY, (self(x).argmax(-1) == y).float().mean())

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def random_set(samples: int, features: int, classes: int, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, features, generator=generator),
                         torch.randint(0, classes, (samples,), generator=generator))


class BenchData(pl.LightningDataModule):
    """Random features and labels, generated once (the same for every variant).

    Args:
        steps: training batches per epoch.
        batch_size: samples per batch.
        features: input width.
        classes: label count.
    """

    def __init__(self, steps: int = 40, batch_size: int = 256, features: int = 1024, classes: int = 10) -> None:
        super().__init__()
        self.steps, self.batch_size, self.features, self.classes = steps, batch_size, features, classes

    @override
    def setup(self, stage: str) -> None:
        self.train_set = random_set(self.steps * self.batch_size, self.features, self.classes)
        self.val_set = random_set(self.batch_size, self.features, self.classes, seed=1)

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size)

    @override
    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def example_input(self) -> torch.Tensor:
        return self.val_set.tensors[0][:2]
