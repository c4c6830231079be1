"""``python -m recipes.bench <subcommand>``: see :mod:`recipes.bench.cli`."""

from recipes.bench.cli import main
from recipes.run.shutdown import run_and_exit

if __name__ == "__main__":
    run_and_exit(main)
