"""Sample text from a trained byte-level GPT: ``python -m recipes.sample --ckpt PATH --prompt "def "``.

Loads the checkpoint (a ``.ckpt`` file, or the directory of shards an FSDP run saves), appends
``--max-new-bytes`` sampled bytes to the prompt and writes prompt and continuation to stdout as
raw bytes (a byte-level model may emit invalid UTF-8; the terminal shows what it can)::

    python -m recipes.sample --ckpt runs/gpt/<run_name>/checkpoints/<best>.ckpt --prompt "def " \\
        --max-new-bytes 200 --temperature 0.8 --top-k 50 --seed 0

Exit codes: 0 done, 2 bad input (a missing checkpoint, a bad option, a device that does not run here, a
prompt that is not UTF-8, a checkpoint that would run code or is not a GPT's).

A checkpoint may come from anywhere: nothing in it is run. A file is loaded weights-only; a
directory's ``.metadata`` and non-tensor items go through ``callbacks.storage.safe_load``'s allow-lists.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from recipes.run.common import ArgumentParser, UsageError, parse_or_exit, run_main

if TYPE_CHECKING:
    import torch

    from recipes.gpt import GPT



def load_gpt(path: Path, map_location: str = "cpu") -> GPT:
    """A GPT from a Lightning checkpoint file, or from a distributed (FSDP) checkpoint directory.

    Raises:
        CheckpointRejected: the checkpoint would run code to load, or is not a checkpoint.
        TypeError, KeyError, ValueError, RuntimeError: a checkpoint, but of another model (its hyperparameters
            are not a GPT's, or its weights do not fit one).
    """
    from callbacks.storage import safe_load
    from recipes.gpt import GPT

    if path.is_file():
        safe_load.check_file(path)  # one clear error instead of the one from deep inside Lightning
        return GPT.load_from_checkpoint(path, map_location=map_location, weights_only=True)
    safe_load.check_directory(path)  # every pickled item, also those a GPT does not read (an optimizer's)
    meta = safe_load.safe_torch_load(path / "meta.pt", path / "meta.pt", map_location=map_location)
    model = GPT(**{k: v for k, v in meta["hyper_parameters"].items() if not k.startswith("_")})
    state = {"state_dict": model.state_dict()}
    safe_load.load_distributed(state, path)
    model.load_state_dict(state["state_dict"])
    return model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return parse_or_exit(build_parser(), argv)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m recipes.sample", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ckpt", required=True, help="checkpoint file (or FSDP checkpoint directory)")
    parser.add_argument("--prompt", default="\n", help="text to continue (UTF-8)")
    parser.add_argument("--max-new-bytes", type=int, default=200, help="bytes to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 is greedy")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest bytes (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda")
    return parser


#: The most bytes one call samples: each is a forward pass, so a mistyped count (10**12) would run for days.
MAX_NEW_BYTES = 1 << 20


def check_args(args: argparse.Namespace) -> bytes:
    """The prompt's bytes, once every option is a value this command can use; :class:`UsageError` naming the one
    that is not. Nothing is loaded before these pass."""
    path = Path(args.ckpt)
    if not path.exists():
        raise UsageError(f"--ckpt {args.ckpt} does not exist.")
    if path.is_dir() and not (path / "meta.pt").is_file():
        raise UsageError(f"--ckpt {args.ckpt} is a directory but not a distributed checkpoint (no meta.pt in it).")
    if args.max_new_bytes < 0 or args.top_k < 0 or args.temperature < 0:
        raise UsageError("--max-new-bytes, --top-k and --temperature must be >= 0.")
    if args.max_new_bytes > MAX_NEW_BYTES:
        raise UsageError(f"--max-new-bytes {args.max_new_bytes}: at most {MAX_NEW_BYTES} ({MAX_NEW_BYTES >> 20} MiB) "
                         "per call.")
    if not -(1 << 63) <= args.seed < 1 << 64:
        raise UsageError(f"--seed {args.seed}: a seed is a 64-bit integer.")
    if not args.prompt:
        raise UsageError("--prompt must not be empty (the model needs one byte to start from).")
    try:
        return args.prompt.encode()
    except UnicodeEncodeError as err:  # bytes the locale could not decode (surrogate escapes in sys.argv)
        raise UsageError(f"--prompt is not valid UTF-8 (byte {os.fsencode(args.prompt)[err.start]:#04x} at "
                         f"{err.start}).") from None


def check_device(name: str) -> torch.device:
    """``name`` as a torch device that runs here (one tensor made and read back); :class:`UsageError` if not.

    torch says what is wrong by the type of its failure: an unknown name (``RuntimeError``), a backend this
    build or machine lacks (``RuntimeError``, ``AssertionError``, ``NotImplementedError``), a device with no
    data (``meta``).
    """
    import torch

    try:
        device = torch.device(name)
        (torch.zeros(1, device=device) + 1).cpu()
    except (RuntimeError, AssertionError, NotImplementedError, ValueError) as err:
        reason = " ".join(str(err).split()).split(". ")[0][:200] or type(err).__name__
        raise UsageError(f"--device {name}: not a device that runs here ({reason}).") from None
    return device


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_main(lambda: _sample(args))


def _sample(args: argparse.Namespace) -> int:
    path = Path(args.ckpt)
    prompt_bytes = check_args(args)
    device = check_device(args.device)

    import torch

    from callbacks.storage.safe_load import CheckpointRejected, describe

    try:
        model = load_gpt(path)
    except CheckpointRejected as err:
        raise UsageError(f"--ckpt {args.ckpt} cannot be loaded safely: {describe(err, path)}") from None
    except (TypeError, KeyError, ValueError, RuntimeError) as err:  # a checkpoint, but not of a GPT
        reason = " ".join(str(err).split()).split(": ", 1)[0][:200]  # the gist, not every missing key
        raise UsageError(f"--ckpt {args.ckpt} is not a GPT checkpoint ({type(err).__name__}: {reason}).") from None
    model = model.to(device).eval()
    prompt = torch.tensor([list(prompt_bytes)], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    out = model.generate(prompt, args.max_new_bytes, temperature=args.temperature, top_k=args.top_k or None,
                         generator=generator)
    sys.stdout.buffer.write(bytes(out[0].tolist()) + b"\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
