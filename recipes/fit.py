"""Train a recipe: ``python -m recipes.fit --config configs/X.yaml [--config Y.yaml] [--key=value ...]``.

One CPU (the default recipe, embedded data, no download)::

    python -m recipes.fit --config configs/digits.yaml

DDP or FSDP on this machine's CPUs (2 processes, gloo) or on every GPU of a node::

    python -m recipes.fit --config configs/digits.yaml --config configs/strategy/ddp.yaml
    python -m recipes.fit --config configs/digits.yaml --config configs/strategy/fsdp.yaml --trainer.devices 8

Two nodes with torchrun (run on each node, NODE_RANK 0 and 1)::

    torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 8 --master-addr $HEAD --master-port 29500 \\
        -m recipes.fit --config configs/digits.yaml --config configs/strategy/ddp.yaml \\
        --trainer.num_nodes 2 --trainer.devices 8 --run_name my-run

SLURM (one task per GPU; SIGUSR1 90 s before the time limit checkpoints and requeues)::

    #SBATCH --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 --signal=USR1@90 --requeue
    srun python -m recipes.fit --config configs/digits.yaml --config configs/strategy/ddp.yaml \\
        --trainer.num_nodes 2 --trainer.devices 8

Relaunching with the same ``--run_name`` resumes the run. Exit codes: 0 done, 2 bad input,
75 interrupted after a checkpoint (requeue it), 1 anything else.
"""

from __future__ import annotations

from recipes.cli import run_cli


def main(args: list[str] | None = None) -> int:
    return run_cli(args)


if __name__ == "__main__":
    raise SystemExit(main())
