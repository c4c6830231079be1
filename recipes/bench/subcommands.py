"""``python -m recipes.bench``: the subcommands' options, their checks, and the dispatch to each benchmark."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

import torch
from rich.console import Console

from recipes.bench import chaos
from recipes.bench import chunks as bench_chunks
from recipes.bench import compression as bench_compression
from recipes.bench import lm as bench_lm
from recipes.bench import startup as bench_startup
from recipes.bench import stream as bench_stream
from recipes.bench import verify as bench_verify
from recipes.bench.checkpoint import CHECKPOINT_MARGIN, bench_checkpoint, print_checkpoint
from recipes.bench.contention import bench_contention, print_contention
from recipes.bench.fit import GOAL_FIT_RATIO, bench_fit, bench_fit_ablation, print_fit, print_fit_ablation
from recipes.bench.output import emit
from recipes.bench.overhead import (
    C_OVER_B_CI_FLOOR,
    GOAL_C_OVER_A,
    GOAL_C_OVER_B,
    GOAL_SHORT_GAP_US,
    SHORT_STEP,
    VARIANTS,
    bench_ablation,
    bench_overhead,
    print_ablation,
    print_overhead,
)
from recipes.bench.runs import PIECES
from recipes.run.common import ArgumentParser, UsageError, check_output_dir, check_output_file
from recipes.run.process import quiet_lightning_info

PROG = "python -m recipes.bench"


# --------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    over = sub.add_parser("overhead", help="plain PyTorch vs plain Lightning vs the full recipe",
                          description="Throughput of one MLP trained as (a) a plain PyTorch loop, (b) plain "
                                      f"Lightning, (c) the full recipe; goals c/b >= {GOAL_C_OVER_B} with its 95% CI "
                                      f"above {C_OVER_B_CI_FLOOR}, c/a >= {GOAL_C_OVER_A}.")
    over.add_argument("--steps", type=int, default=40, help="optimizer steps per variant and round, warm-up included")
    over.add_argument("--warmup", type=int, default=10, help="steps before the throughput window opens")
    over.add_argument("--rounds", type=int, default=3,
                      help="rounds of all variants, interleaved (at least this many; the best round of each is "
                           "shown, the bootstrap CI of the mean ratio decides)")
    over.add_argument("--max-rounds", dest="max_rounds", type=int, default=15,
                      help="keep adding rounds until both verdicts are decided (c/b met or missed, c/a's CI narrower "
                           f"than {(1 - GOAL_C_OVER_A) * 100:.0f}%%), or this many rounds: then the verdict may say "
                           "'inconclusive'")
    over.add_argument("--variants", type=lambda text: [p for p in text.split(",") if p], default=None,
                      help=f"only these variants, comma-separated, b and c among them ({','.join(VARIANTS)}; "
                           "default all): 'b,c' puts the two runs c/b compares side by side in every round")
    over.add_argument("--ablate", action="store_true",
                      help="instead: the full recipe with each default piece (MLflow, system metrics, progress "
                           "bar, spot, cost, checkpointing, baselines, manifest, model logging, StepTiming) "
                           "turned off in turn, --rounds interleaved rounds; prints what each costs")
    over.add_argument("--short", action="store_true",
                      help="a model whose plain step is about 1 ms (MLP 64 wide, batch 32, 600 steps, 100 warm-up; "
                           "replaces those settings): goal, the recipe's median step at most plain Lightning's + "
                           f"{GOAL_SHORT_GAP_US:.0f} us")
    over.add_argument("--batch-size", dest="batch_size", type=int, default=256, help="samples per step")
    over.add_argument("--features", type=int, default=1024, help="input features of the MLP")
    over.add_argument("--hidden", type=int, default=1536, help="width of the MLP's hidden layers")
    over.add_argument("--layers", type=int, default=2, help="hidden layers of the MLP")
    ckpt = sub.add_parser("checkpoint", help="periodic checkpoint stall, sync vs async",
                          description="How long periodic checkpoints stall the training loop, synchronous vs "
                                      "asynchronous writer; goals: async effective <= 10% of sync, staging <= 2x the "
                                      "memory-copy floor.")
    ckpt.add_argument("--steps", type=int, default=40, help="optimizer steps per writer and round, warm-up included")
    ckpt.add_argument("--warmup", type=int, default=5, help="steps before the timed window (their saves not counted)")
    ckpt.add_argument("--every", type=int, default=10, help="save a checkpoint every this many steps")
    ckpt.add_argument("--rounds", type=int, default=3,
                      help="rounds of each writer (none, sync, async), interleaved (at least this many)")
    ckpt.add_argument("--max-rounds", dest="max_rounds", type=int, default=12,
                      help="add rounds until the 95%% CI of the async/sync effective stall lies wholly below or "
                           f"above the goal or is narrower than {CHECKPOINT_MARGIN:g}, or this many rounds")
    ckpt.add_argument("--batch-size", dest="batch_size", type=int, default=8, help="samples per step")
    ckpt.add_argument("--features", type=int, default=4096, help="input features of the MLP")
    ckpt.add_argument("--hidden", type=int, default=4096,
                      help="width of the hidden layers: 2 x Linear(4096, 4096) is 134 MB of fp32 state")
    ckpt.add_argument("--layers", type=int, default=2, help="hidden layers of the MLP (the checkpointed state)")
    chaos.add_arguments(sub.add_parser("chaos", help="seeded random faults on one digits run, relaunched after "
                                                     "each, then checked (see recipes/soak/)"))
    cont = sub.add_parser("contention", help="the digits recipe's step quiet and beside a busy process, per "
                                             "CPU thread setting",
                          description="Step time of the default digits recipe's model and data, quiet and beside one "
                                      "CPU-bound busy loop, for torch's default threads (spinning waits: the "
                                      "default --cpu_threads auto), OMP_WAIT_POLICY=PASSIVE, a short spin "
                                      "(GOMP_SPINCOUNT=10000), one thread, --cpu_threads adaptive, and DDP on 2 "
                                      "processes.")
    cont.add_argument("--steps", type=int, default=400, help="optimizer steps per run, warm-up included")
    cont.add_argument("--settings", type=lambda text: [p for p in text.split(",") if p], default=None,
                      help="only these settings, by first word (auto,passive,spin10k,1,adaptive,DDP-2)")
    cont.add_argument("--warmup", type=int, default=10, help="steps before the timed window")
    cont.add_argument("--rounds", type=int, default=3, help="rounds of every setting, interleaved; medians shown")
    cont.add_argument("--json", action="store_true", help="print the figures as JSON")
    bench_compression.add_arguments(sub.add_parser(
        "compression", help="dense, fp16, PowerSGD and top-k on the digits recipe, 2 processes: bytes, step, accuracy",
        description=(bench_compression.__doc__ or "").splitlines()[0]))
    from recipes.bench import gpu as bench_gpu

    bench_gpu.add_arguments(sub.add_parser(
        "gpu", help="the GPU check: gpt-124m tokens/s and MFU, recipe overhead, StepTiming's CUDA clock, "
                    "checkpoint stall vs a pinned copy (a cpu reduced mode without a GPU)",
        description=bench_gpu.__doc__.splitlines()[0] if bench_gpu.__doc__ else None))
    bench_lm.add_arguments(sub.add_parser(
        "lm", help="the GPT recipe's step and trainer.fit vs plain Lightning's and a plain PyTorch loop's",
        description=bench_lm.__doc__.splitlines()[0] if bench_lm.__doc__ else None))
    bench_startup.add_arguments(sub.add_parser(
        "startup", help="a launch's time to its first step and to exit, phase by phase (fresh and relaunch)",
        description=bench_startup.__doc__.splitlines()[0] if bench_startup.__doc__ else None))
    bench_stream.add_arguments(sub.add_parser(
        "stream", help="a recipe streamed from a local S3 server a shaped network away vs in memory: throughput, "
                  "data wait, cache; litdata's loader beside ours (--anchor); a set 10x the cache (--large-mb)",
        description=bench_stream.__doc__.splitlines()[0] if bench_stream.__doc__ else None))
    bench_chunks.add_arguments(sub.add_parser(
        "chunks", help="how fast a split arrives through the fetch-ahead by chunk size, a shaped store away",
        description=bench_chunks.__doc__.splitlines()[0] if bench_chunks.__doc__ else None))
    bench_verify.add_arguments(sub.add_parser(
        "verify", help="what checking each streamed chunk's SHA-256 costs its fetch (plain vs verified, medians)",
        description=bench_verify.__doc__.splitlines()[0] if bench_verify.__doc__ else None))
    fit = sub.add_parser("fit", help="the default digits recipe's trainer.fit vs plain Lightning's, side by side",
                         description="trainer.fit of `python -m recipes.fit --config configs/digits.yaml` (in this "
                                     "process) and of plain Lightning on the same ImageClassifier, DigitsDataModule, "
                                     "epochs and validation (no logger, checkpointing or progress bar), interleaved "
                                     f"rounds; goal: the recipe's median <= {GOAL_FIT_RATIO}x plain's, its rounds "
                                     "spread no wider.")
    fit.add_argument("--epochs", type=int, default=20, help="epochs of both fits (the recipe's default)")
    fit.add_argument("--rounds", type=int, default=10, help="rounds of both, interleaved; the medians decide")
    fit.add_argument("--ablate", action="store_true",
                     help="instead: the recipe's trainer.fit with each default piece turned off in turn")
    fit.add_argument("--pieces", type=lambda text: [p for p in text.split(",") if p], default=None,
                     help=f"with --ablate: only these pieces, comma-separated ({', '.join(PIECES)})")
    for p in (over, ckpt, fit):
        p.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
        p.add_argument("--out", default=None, help="keep run files here (default: a temporary directory)" if p is ckpt
                       else "keep every round's run files here (default: a temporary directory, where each round's "
                            "checkpoints and artifacts are dropped once it is over)")
        p.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "short", False):  # the ~1 ms step's model and data replace those settings
            vars(args).update(SHORT_STEP)
        if getattr(args, "out", None) is not None:  # before any round: a place that takes no files is bad input
            (check_output_file if args.command == "chaos" else check_output_dir)("--out", args.out)  # chaos: a report
        if args.command == "chaos":
            return chaos.main(args)
        if args.command == "compression":
            return bench_compression.run(args)
        if args.command == "lm":
            return bench_lm.run(args)
        if args.command == "startup":
            return bench_startup.run(args)
        if args.command == "stream":
            return bench_stream.run(args)
        if args.command == "verify":
            return bench_verify.run(args)
        if args.command == "chunks":
            return bench_chunks.run(args)
        if args.command == "gpu":
            from recipes.bench import gpu as bench_gpu

            quiet_lightning_info()
            warnings.filterwarnings("ignore")
            return bench_gpu.main(args, Console(stderr=True))
        if args.command == "contention":
            if args.steps <= args.warmup + 1 or args.rounds < 1 or args.warmup < 1:
                raise UsageError("contention needs --rounds >= 1, --warmup >= 1 and --steps > --warmup + 1")
            console = Console(stderr=args.json)
            figures = bench_contention(args, console)
            emit(figures, args.json, lambda: print_contention(figures, console))
            return 0
        if args.command == "fit":
            unknown = [p for p in args.pieces or [] if p not in PIECES]
            if unknown:
                raise UsageError(f"--pieces {','.join(unknown)}: not one of {', '.join(PIECES)}")
            for name in ("epochs", "rounds", "threads"):
                if getattr(args, name) < 1:
                    raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
        if args.command == "overhead" and args.variants is not None:
            unknown = [v for v in args.variants if v not in VARIANTS]
            if unknown or not {"b", "c"} <= set(args.variants):
                raise UsageError(f"--variants {','.join(args.variants)}: each one of {', '.join(VARIANTS)}, "
                                 "with b and c among them")
        for name in ("steps", "rounds", "max_rounds", "batch_size", "hidden", "layers", "features", "threads",
                     "warmup"):
            if args.command != "fit" and getattr(args, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
        if args.command != "fit" and args.steps <= args.warmup:
            raise UsageError(f"--steps {args.steps} must exceed --warmup {args.warmup}")
        if args.command == "checkpoint" and not 1 <= args.every < args.steps - args.warmup:
            raise UsageError(f"--every {args.every}: needs at least one save after the {args.warmup} warm-up "
                             f"steps of {args.steps}")
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    quiet_lightning_info()
    warnings.filterwarnings("ignore")
    console = Console(stderr=args.json)
    if args.command == "fit" and args.ablate:
        figures = bench_fit_ablation(args, console)
        printer = print_fit_ablation
    elif args.command == "fit":
        figures = bench_fit(args, console)
        printer = print_fit
    elif args.command == "overhead" and args.ablate:
        figures = bench_ablation(args, console)
        printer = print_ablation
    elif args.command == "overhead":
        figures = bench_overhead(args, console)
        printer = print_overhead
    else:
        figures = bench_checkpoint(args, console)
        printer = print_checkpoint
    emit(figures, args.json, lambda: printer(figures, console))
