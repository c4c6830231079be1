"""``python -m recipes.bench <subcommand>``: what the recipe's own machinery costs, measured side by side.

One module per subcommand, and what they share:

- :mod:`recipes.bench.overhead`: the full recipe against plain Lightning and a plain PyTorch loop (an MLP).
- :mod:`recipes.bench.checkpoint`: periodic checkpoint stalls, synchronous against asynchronous.
- :mod:`recipes.bench.fit`: the default digits recipe's ``trainer.fit`` against plain Lightning's.
- :mod:`recipes.bench.lm`: the GPT recipe's step and ``trainer.fit`` against plain Lightning and a plain loop.
- :mod:`recipes.bench.startup`: a launch's time to its first step and to exit, phase by phase.
- :mod:`recipes.bench.contention`: the digits step quiet and beside a busy process, per CPU thread setting.
- :mod:`recipes.bench.compression`: gradient compression on 2 processes (bytes, step, accuracy).
- :mod:`recipes.bench.gpu`: the GPU check (a reduced mode on CPU).
- :mod:`recipes.bench.stream`: a recipe streamed from a local S3 server a shaped network away, against in memory
  (with :mod:`recipes.bench.stream_anchor`, one loader epoch in its own process: ours or litdata's).
- :mod:`recipes.bench.chunks`: how fast a split arrives through the fetch-ahead, by chunk size.
- :mod:`recipes.bench.verify`: what checking each streamed chunk's SHA-256 costs its fetch.
- :mod:`recipes.bench.chaos`: the reliability soak's options and entry point (its engine is :mod:`recipes.soak`).

Shared: :mod:`recipes.bench.stats` (paired bootstrap intervals and verdicts; no torch),
:mod:`recipes.bench.runs` (the full recipe in-process less chosen pieces, a step stopwatch),
:mod:`recipes.bench.mlp` (the synthetic MLP workload), :mod:`recipes.bench.subcommands` (the options and
the dispatch), :mod:`recipes.bench.output` (the figures as JSON or as tables). Nothing a benchmark imports
imports the command line back.
"""
