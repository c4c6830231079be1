"""Training strategies of the recipes: FSDP2 over every process, whatever their number.

Lightning's ``ModelParallelStrategy(data_parallel_size="auto")`` takes the number of *nodes* as the
data-parallel size (and the devices per node as the tensor-parallel size), so with
``tensor_parallel_size=1`` it refuses any node with more than one device, and a pinned size refuses
every other device count. :class:`FullyShardedDataParallel` shards over all processes of the run:
``--trainer.devices 8`` shards over 8, ``--trainer.devices 1`` runs alone, and a run resumes from its
distributed checkpoint on any of them (``torch.distributed.checkpoint`` reshards model and optimizer).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from recipes.run.compat import set_model_parallel_sizes

__all__ = ["FullyShardedDataParallel"]


class FullyShardedDataParallel(ModelParallelStrategy):
    """``ModelParallelStrategy`` with a data-parallel mesh of every process and no tensor parallelism.

    The module's ``configure_model`` applies ``fully_shard`` over ``self.device_mesh["data_parallel"]``.

    Args:
        **kwargs: ``ModelParallelStrategy``'s other arguments (``save_distributed_checkpoint``,
            ``process_group_backend``, ``timeout``).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, **kwargs)

    @override
    def setup_environment(self) -> None:
        set_model_parallel_sizes(self, self.num_nodes * self.num_processes, 1)
        super().setup_environment()
