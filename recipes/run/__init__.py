"""The machinery around a run: what ``python -m recipes.fit`` does besides training, and what the tools share.

- :mod:`recipes.run.cli`: the LightningCLI and the run's flow (store, resume, fit, wrap-up).
- :mod:`recipes.run.process`: what a launch sets for its process (signals, log filters, the collector, NVML).
- :mod:`recipes.run.context`: where a run lives and what it resumes from (the resume policy, testable alone).
- :mod:`recipes.run.cli_callbacks`: the CLI's own callbacks (config.yaml to MLflow, run files to object
  storage, the best-k kept across machines).
- :mod:`recipes.run.resumable_logger`: the MLflow logger that resumes a run.
- :mod:`recipes.run.tracking`: the MLflow store made whole or not at all, runs found by their directory,
  secrets redacted.
- :mod:`recipes.run.lock`: one live process per run directory.
- :mod:`recipes.run.shutdown`: how a process ends (copied alone into other projects).
- :mod:`recipes.run.common`: what every tool shares: usage errors and exit codes, the parser (finite floats,
  ``sys.argv`` redacted once parsed), names and output places checked before any work, the tracking URI, run
  lookups, metric and tag names (no torch or Lightning).
- :mod:`recipes.run.compat`: the couplings to private Lightning and MLflow internals, one test each.
"""
