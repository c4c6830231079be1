"""``python -m recipes.bench <subcommand>``: see :mod:`recipes.bench.subcommands`."""

from recipes.bench.subcommands import main
from recipes.run.shutdown import run_and_exit

if __name__ == "__main__":
    run_and_exit(main)
