"""``python -m recipes.scale``: see :mod:`recipes.scale`."""

from recipes.scale import main

if __name__ == "__main__":
    raise SystemExit(main())
