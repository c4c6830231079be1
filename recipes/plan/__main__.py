"""``python -m recipes.plan`` (and ``python -m recipes.plan batch``): see :mod:`recipes.plan`."""

from recipes.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
