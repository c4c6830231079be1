"""The scaling sweep behind ``python -m recipes.scale``, split along its seams.

- :mod:`recipes.speedup.points`: the measured points and the laws fitted to them (no I/O but a CSV).
- :mod:`recipes.speedup.launch`: the training launches at each device count, and the CSV path instead.
- :mod:`recipes.speedup.report`: the files, the MLflow parent run's record and the terminal tables.
"""
