"""Image classification task: a LightningModule with a small CNN, or any torchvision model by name.

Besides accuracy, every validation logs what the model's mistakes cost under a misclassification cost
matrix from the config (``model.costs``; default 0/1, which makes the expected cost the error rate):
the cost of its argmax decisions and of the cost-aware Bayes decisions (see
:mod:`callbacks.analysis.decision_cost`). ``model.decision`` picks the rule the served model uses.

One module serves every strategy: on one device and under DDP it is a plain module; under
``ModelParallelStrategy`` (our FSDP, see ``configs/strategy/fsdp.yaml``) ``configure_model``
shards it with FSDP2's ``fully_shard`` over the data-parallel mesh.

Copy with it (paths under ``recipes/``, each folder with an ``__init__.py``): ``metrics.py``, ``run/errors.py``,
and ``callbacks/analysis/decision_cost.py`` and ``callbacks/analysis/keys.py`` put beside them, under their own
names (the imports of decision_cost and keys fall back to that place when no ``callbacks`` package is there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn
from typing_extensions import override

from .metrics import ExpectedCost
from .run.errors import check_optimizer

try:  # in this repository
    from callbacks.analysis import keys
    from callbacks.analysis.decision_cost import CostMatrixError, load_cost_matrix
except ModuleNotFoundError as missing:  # copied into another project (see "Copy with it" above)
    if missing.name != "callbacks":
        raise
    from . import keys  # type: ignore[no-redef]
    from .decision_cost import CostMatrixError, load_cost_matrix  # type: ignore[no-redef]

#: Where a relative cost-matrix path is looked up after the working directory (the shipped configs name
#: ``configs/costs/...`` relative to the repository).
REPO = Path(__file__).resolve().parents[1]


def small_cnn(in_channels: int, num_classes: int, width: int, dropout: float) -> nn.Sequential:
    """Two conv blocks and a linear head: enough for 8x8 digits, MNIST and a CIFAR-10 baseline."""
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(2 * width * 16, 4 * width),
        nn.ReLU(),
        nn.Linear(4 * width, num_classes),
    )


def torchvision_model(name: str, in_channels: int, num_classes: int) -> nn.Module:
    """A torchvision architecture by name (random init: no weight download), adapted to the input."""
    import torchvision

    try:
        model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    except ValueError as err:
        known = ", ".join(sorted(torchvision.models.list_models(module=torchvision.models)))
        raise ValueError(f"ImageClassifier(backbone={name!r}) is not a torchvision model; known: {known}") from err
    if in_channels != 3:
        first = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
        replacement = nn.Conv2d(
            in_channels,
            first.out_channels,
            first.kernel_size,
            first.stride,
            first.padding,
            bias=first.bias is not None,
        )
        for parent in model.modules():
            for child_name, child in parent.named_children():
                if child is first:
                    setattr(parent, child_name, replacement)
    return model


class ImageClassifier(pl.LightningModule):
    """Cross-entropy classifier with torchmetrics accuracy and the expected cost of its decisions.

    Args:
        num_classes: number of labels.
        in_channels: image channels (1 for digits and MNIST, 3 for CIFAR-10).
        backbone: ``"small_cnn"`` or the name of any torchvision classification model
            (``"resnet18"``, ``"mobilenet_v3_small"``, ...), randomly initialised.
        width: channels of the small CNN's first conv layer.
        dropout: dropout before the small CNN's head.
        optimizer: the optimizer, from the config (default AdamW, lr 3e-3).
        lr_scheduler: an optional LR scheduler, from the config; stepped every epoch.
        costs: the misclassification cost matrix, ``costs[i][j]`` = cost of deciding ``j`` when the
            truth is ``i``: a YAML or CSV file (a relative path is looked up in the working directory, then
            in the repository), the rows inline, or ``None`` for 0/1 (expected cost = error rate).
        decision: the decision rule of the served model: ``"argmax"`` (most probable class) or ``"bayes"``
            (least expected cost under the predicted probabilities). Both are scored every validation.
        class_names: the classes' names, for the served model (default: the cost file's ``classes:``,
            else ``"0"``, ``"1"``...).

    Logged metrics: ``train/loss``, ``train/acc`` (per step); ``val/loss``, ``val/acc``,
    ``val/expected_cost`` (argmax decisions), ``val/bayes_expected_cost`` (Bayes decisions) per epoch.

    Raises:
        ValueError: fewer than 2 classes; a small CNN's ``width`` or ``in_channels`` below 1 or ``dropout``
            outside [0, 1); a value the optimizer or the LR scheduler refuses (a negative learning rate);
            a cost matrix of the wrong shape, with a negative, non-finite or non-numeric entry, or a missing
            file (the message names the value).

    Example::

        model = ImageClassifier(num_classes=10, in_channels=1)
        logits = model(torch.zeros(4, 1, 8, 8))   # (4, 10)
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        backbone: str = "small_cnn",
        width: int = 32,
        dropout: float = 0.1,
        optimizer: OptimizerCallable = lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=1e-4),
        lr_scheduler: LRSchedulerCallable | None = None,
        costs: str | list[list[Any]] | None = None,
        decision: Literal["argmax", "bayes"] = "argmax",
        class_names: list[str] | None = None,
    ) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"ImageClassifier(num_classes={num_classes!r}) needs at least 2 classes.")
        for name, value in (("in_channels", in_channels), ("width", width)):
            if value < 1:
                raise ValueError(f"ImageClassifier({name}={value!r}) must be >= 1.")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"ImageClassifier(dropout={dropout!r}) must lie in [0, 1).")
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"], logger=False)
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        if backbone == "small_cnn":
            self.net = small_cnn(in_channels, num_classes, width, dropout)
        else:
            self.net = torchvision_model(backbone, in_channels, num_classes)
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        try:
            matrix = load_cost_matrix(costs, num_classes, class_names, base_dirs=[REPO])
        except CostMatrixError as err:
            given = repr(costs) if isinstance(costs, str) else "[...]"
            raise CostMatrixError(f"ImageClassifier(costs={given}): {err}") from None
        if decision not in ("argmax", "bayes"):
            raise ValueError(f"ImageClassifier(decision={decision!r}) is not 'argmax' or 'bayes'.")
        self.decision = decision
        self.class_names = list(matrix.classes)
        self.cost_story = matrix.story
        self.register_buffer("cost_matrix", torch.as_tensor(matrix.costs, dtype=torch.float64), persistent=False)
        self.val_cost = ExpectedCost(matrix.costs, "argmax")
        self.val_bayes_cost = ExpectedCost(matrix.costs, "bayes")
        check_optimizer("ImageClassifier", lambda: self._optimizers(self.parameters()))

    def _optimizers(self, params: Any) -> Any:
        """The configured optimizer over ``params``, with its LR scheduler if one is configured."""
        optimizer = self.optimizer_factory(params)
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer)}

    @override
    def setup(self, stage: str) -> None:
        """Give the model summary one example image of the datamodule's shape: it then counts FLOPs and sizes.

        Not under a sharding strategy: the summary's forward runs on rank zero alone, and a sharded module's
        forward gathers its parameters from every rank.
        """
        datamodule = self.trainer.datamodule
        size, channels = getattr(datamodule, "image_size", None), getattr(datamodule, "in_channels", None)
        sharded = isinstance(self.trainer.strategy, (FSDPStrategy, ModelParallelStrategy))
        if self.example_input_array is None and isinstance(size, int) and isinstance(channels, int) and not sharded:
            self.example_input_array = torch.zeros(1, channels, size, size)

    @override
    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        dp_mesh = mesh["data_parallel"]
        for layer in self.net:
            if any(p.requires_grad for p in layer.parameters(recurse=False)):
                fully_shard(layer, mesh=dp_mesh)
        fully_shard(self.net, mesh=dp_mesh)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log(keys.TRAIN_LOSS_KEY, loss, prog_bar=True)
        self.log(keys.TRAIN_ACC_KEY, self.train_acc, on_step=True, on_epoch=False)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log(keys.VAL_LOSS_KEY, F.cross_entropy(logits, y), sync_dist=True)
        self.log(keys.VAL_ACC_KEY, self.val_acc, prog_bar=True)
        self.val_cost(logits, y)
        self.val_bayes_cost(logits, y)
        self.log(keys.VAL_COST_KEY, self.val_cost)
        self.log(keys.VAL_BAYES_COST_KEY, self.val_bayes_cost)

    @override
    def configure_optimizers(self) -> Any:
        return self._optimizers(self.parameters())
