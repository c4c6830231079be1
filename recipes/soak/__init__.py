"""The chaos soak: a digits run driven through seeded random faults, relaunched after each, then checked.

A benchmark of the recipe's fault tolerance, not a CI test: ``python -m recipes.bench chaos --faults 10``.
An uninterrupted reference run comes first; every launch after a fault must resume from the newest checkpoint
that verifies, lose no checkpoint, exit as its fault allows, and the run must end bitwise equal to the
reference, with one MLflow run.

Which module holds what (each imports only those above it, and none imports ``recipes.bench``):

- :mod:`recipes.soak.faults`: the fault kinds, the plan drawn from the seed, the invariants, the records;
- :mod:`recipes.soak.launch`: one ``recipes.fit`` process group, and the parsers of what it printed;
- :mod:`recipes.soak.observe`: the MLflow store (through ``MlflowClient``) and the checkpoints that verify;
- :mod:`recipes.soak.disk`: the tmpfs the ``disk_full`` fault fills;
- :mod:`recipes.soak.bucket`: moto's S3 server behind the proxy the ``bucket_outage`` fault takes down;
- :mod:`recipes.soak.dataset`: the streamed set the ``chunk_damaged`` and ``dataset_replaced`` faults damage and
  replace, and the judges of what a launch that met it printed;
- :mod:`recipes.soak.soak`: :class:`~recipes.soak.soak.Soak`, one chain: the reference, the faults, the checks;
- :mod:`recipes.soak.report`: the JSON report over every chain and its tables.

The ``chaos`` subcommand's options and entry point, which drive the chains, are :mod:`recipes.bench.chaos`, beside
the other benchmarks.
"""
