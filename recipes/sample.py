"""Sample text from a trained byte-level GPT: ``python -m recipes.sample --ckpt PATH --prompt "def "``.

Loads the checkpoint (a ``.ckpt`` file, or the directory of shards an FSDP run saves), appends
``--max-new-bytes`` sampled bytes to the prompt and writes prompt and continuation to stdout as
raw bytes (a byte-level model may emit invalid UTF-8; the terminal shows what it can)::

    python -m recipes.sample --ckpt runs/gpt/<run_name>/checkpoints/<best>.ckpt --prompt "def " \\
        --max-new-bytes 200 --temperature 0.8 --top-k 50 --seed 0

Exit codes: 0 done, 2 bad input (a missing checkpoint, a bad option, a checkpoint that would run code
or is not one).

A checkpoint may come from anywhere: nothing in it is run. A file is loaded weights-only; a
directory's ``.metadata`` and non-tensor items go through ``callbacks.storage.safe_load``'s allow-lists.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from recipes.run.common import USAGE_EXIT_CODE, ArgumentParser, parse_or_exit

if TYPE_CHECKING:
    from recipes.gpt import GPT



def load_gpt(path: Path, map_location: str = "cpu") -> GPT:
    """A GPT from a Lightning checkpoint file, or from a distributed (FSDP) checkpoint directory.

    Raises:
        CheckpointRejected: the checkpoint would run code to load, or is not a checkpoint.
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
    parser = ArgumentParser(prog="python -m recipes.sample", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ckpt", required=True, help="checkpoint file (or FSDP checkpoint directory)")
    parser.add_argument("--prompt", default="\n", help="text to continue (UTF-8)")
    parser.add_argument("--max-new-bytes", type=int, default=200, help="bytes to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 is greedy")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest bytes (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda")
    return parse_or_exit(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = Path(args.ckpt)
    problem = None
    if not path.exists():
        problem = f"--ckpt {args.ckpt} does not exist."
    elif path.is_dir() and not (path / "meta.pt").is_file():
        problem = f"--ckpt {args.ckpt} is a directory but not a distributed checkpoint (no meta.pt in it)."
    elif args.max_new_bytes < 0 or args.top_k < 0 or args.temperature < 0:
        problem = "--max-new-bytes, --top-k and --temperature must be >= 0."
    elif not args.prompt:
        problem = "--prompt must not be empty (the model needs one byte to start from)."
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return USAGE_EXIT_CODE

    import torch

    from callbacks.storage.safe_load import CheckpointRejected, describe

    try:
        model = load_gpt(path)
    except CheckpointRejected as err:
        print(f"error: --ckpt {args.ckpt} cannot be loaded safely: {describe(err, path)}", file=sys.stderr)
        return USAGE_EXIT_CODE
    model = model.to(args.device).eval()
    prompt = torch.tensor([list(args.prompt.encode())], dtype=torch.long, device=args.device)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    out = model.generate(prompt, args.max_new_bytes, temperature=args.temperature, top_k=args.top_k or None,
                         generator=generator)
    sys.stdout.buffer.write(bytes(out[0].tolist()) + b"\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
