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

Relaunching with the same ``--run_name`` resumes the run. Exit codes: 0 done, 2 bad input, 75 stopped to be
relaunched (an interruption notice after its checkpoint, a lost peer, a hang, streamed data out of reach: requeue
it), 130 Ctrl-C, 1 anything else.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

#: ``--cpu_threads``: ``auto`` (default), ``adaptive``, ``torch`` (OpenMP's own defaults) or a count per process.
CPU_THREADS_FLAG = "--cpu_threads"


def cpu_threads_setting(argv: Sequence[str]) -> str:
    """The ``--cpu_threads`` value on the command line (``--cpu_threads N`` or ``--cpu_threads=N``), else ``auto``."""
    value = "auto"
    for index, arg in enumerate(argv):
        if arg == CPU_THREADS_FLAG and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith(CPU_THREADS_FLAG + "="):
            value = arg.split("=", 1)[1]
    return value


def cpu_thread_env(setting: str, env: Mapping[str, str]) -> dict[str, str]:
    """Environment to set before torch (and its OpenMP runtime) is imported, for ``--cpu_threads setting``.

    ``auto``, ``adaptive`` and ``torch`` leave OpenMP as it is: its threads spin while they wait, the
    fastest on a quiet machine; ``adaptive`` then lets the CLI's ``AdaptiveCpuThreads`` drop threads
    while other work holds cores, at the price of bitwise resume (see ``callbacks.cpu_threads``). An
    explicit count is exported as ``OMP_NUM_THREADS`` (so every process a launcher starts uses it) with
    sleeping waits (``OMP_WAIT_POLICY=PASSIVE``: a fixed count cannot step aside, so it must not spin);
    OpenMP reads both once, at start-up: hence here, before any torch import. A policy or count already
    in the environment (the user's, or a launcher's) always wins.
    """
    if setting in ("auto", "adaptive", "torch"):
        return {}
    out = {} if "OMP_WAIT_POLICY" in env else {"OMP_WAIT_POLICY": "PASSIVE"}
    if "OMP_NUM_THREADS" not in env:
        out["OMP_NUM_THREADS"] = setting  # checked by the CLI (a positive integer), which also sets torch's count
    return out


def main(args: list[str] | None = None) -> int:
    """Parse, decide, train and report (:func:`recipes.run.cli.run_cli`); returns the process's exit code.

    Once the run is recorded, a SIGTERM or SIGINT can no longer change the outcome: one raised inside the exit
    handlers (MLflow's flush) would otherwise end a complete run with -15.
    """
    from recipes.run.cli import run_cli  # here, not at the top: `python -m recipes.fit` sets OpenMP's environment first
    from recipes.run.process import ignore_stop_signals

    code = run_cli(args)
    ignore_stop_signals()
    return code


if __name__ == "__main__":
    from callbacks.utils.launch_clock import mark_launch

    mark_launch()  # the bill starts here, not when a shell that exec'd this process started
    # before torch (and its OpenMP runtime) is imported; only as a program: importing this module changes nothing
    os.environ.update(cpu_thread_env(cpu_threads_setting(sys.argv[1:]), os.environ))
    from datamodules.urls import excepthook
    from recipes.run.shutdown import run_and_exit

    sys.excepthook = excepthook  # a traceback never prints a URL's credentials
    run_and_exit(main)  # ends without the interpreter's teardown (recipes.run.shutdown says why)
