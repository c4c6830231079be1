"""``python -m recipes.sweep``: see :mod:`recipes.sweep`."""

import sys

from recipes.sweep import main

if __name__ == "__main__":
    sys.exit(main())
