# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The five steps on digits, in a notebook
#
# The [tutorial](../guides/tutorial.md) runs these steps from a terminal; here the same runs start from cells,
# with `train` from `recipes`. A run started here is the command's run: the same run directory, MLflow run,
# checkpoints and resume as `python -m recipes.fit`. One device trains in this kernel; DDP starts its ranks as
# new processes. Interrupting the kernel checkpoints the run; running its cell again resumes it exactly.
#
# Short on purpose: 4 epochs, then 1 epoch of DDP.

# %%
# ruff: noqa: E402, B018 (a notebook: imports in the cell that uses them; a cell's last expression is its output)
import os
from pathlib import Path

# Jupyter starts in this file's folder; the configs are paths from the repository's root
os.chdir(next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "configs" / "digits.yaml").is_file()))
os.environ.setdefault("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")

from recipes import train

# %% [markdown]
# ## 1. Baselines and cost-sensitive metrics
#
# The digits are cheque amounts: reading a 1 as a 7 costs more than the reverse
# (`configs/costs/digits-cheques.yaml`). Every run logs what its mistakes cost, deciding by the most probable
# class (`val/expected_cost`) and by the least expected cost (`val/bayes_expected_cost`), beside a majority
# class and a logistic regression trained on the same split (`baseline/...`; the `model` figure in brackets is
# the network's value minus the baseline's).

# %%
EPOCHS = 4
run = train("configs/digits.yaml", trainer={"max_epochs": EPOCHS},
            model={"init_args": {"lr_scheduler": {"init_args": {"T_max": EPOCHS}}}})
run

# %% [markdown]
# ## 2. Track every experiment
#
# The run is in MLflow: its config as params, every metric, the run directory's files, the servable model.
# `mlflow ui --backend-store-uri sqlite:///mlflow.db` shows it; from a cell, a query:

# %%
import mlflow

runs = mlflow.search_runs(experiment_names=["digits"], order_by=["attributes.start_time"])
runs[["tags.mlflow.runName", "status", "params.trainer.max_epochs", "metrics.val/acc", "metrics.val/expected_cost"]]

# %% [markdown]
# Where the time of a step went (measured by `StepTiming`, drawn at the end of the run):

# %%
from IPython.display import Image

Image(filename=str(run.run_dir / "time_breakdown.png"), width=640)

# %% [markdown]
# ## 3. Scale out
#
# The same recipe on two processes (DDP, gloo on this CPU; `trainer={"devices": 8}` on an 8-GPU node). They
# start as new processes, never as forks of this kernel; their progress shows here.

# %%
ddp = train("configs/digits.yaml", "configs/strategy/ddp.yaml", trainer={"max_epochs": 1})
ddp

# %% [markdown]
# Each run measures its serial share `s` (data loading, the optimizer, validation: what more devices do not
# divide) and projects Amdahl's speedup `1 / (s + (1 - s) / N)`. On a shared 2-core machine a measured speedup
# says little, so the projection is what to read (`python -m recipes.scale` measures one on real devices).

# %%
import matplotlib.pyplot as plt
import numpy as np

from callbacks.analysis.scaling import amdahl_speedup

devices = np.array([1, 2, 4, 8, 16, 32, 64])
fig, ax = plt.subplots(figsize=(5, 3.2))
for label, r in (("1 process", run), ("DDP, 2 processes", ddp)):
    s = r.metrics["amdahl/serial_fraction"]
    ax.plot(devices, amdahl_speedup(devices, s), marker="o", label=f"{label}: s = {s:.3f}")
ax.plot(devices, devices, "k:", label="linear")
ax.set(xscale="log", yscale="log", xlabel="devices", ylabel="projected speedup", title="Amdahl from each run")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## 4. Cut cost with spot and checkpoints
#
# `recipes.plan` prices the run's measured steps on a cloud instance per market: spot is cheaper but gets
# interrupted; the checkpoints (every epoch, and at once on a notice) bound what an interruption loses. The
# same notice is what *Interrupt kernel* sends a run in this kernel: it saves, `train` returns it as
# `interrupted`, and running the cell again resumes it.

# %%
import json
import subprocess
import sys

import pandas as pd


def tool(*args: str) -> str:
    """One of the project's commands, as from a terminal; its output (or its one error line)."""
    done = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else done.stderr.strip()


plan = json.loads(tool("recipes.plan", "--run", str(run.run_dir), "--instance", "a3-highgpu-8g",
                       "--interruption-rate", "0.05", "--devices", "1,8,64", "--json"))
costs = pd.DataFrame(plan["rows"])[["devices", "market", "instances", "wall_h", "cost_usd"]]
costs.assign(wall_s=(costs.wall_h * 3600).round(1), cost_usd=costs.cost_usd.round(3)).drop(columns="wall_h")

# %% [markdown]
# ## 5. Compare, promote, serve
#
# Runs side by side by the metric that matters, then the best one registered as `champion`, refused unless it
# beats the logistic regression's expected cost:

# %%
print(tool("recipes.compare", "--experiment", "digits", "--metric", "val/expected_cost"))

# %%
print(tool("recipes.promote", "--experiment", "digits", "--metric", "val/expected_cost", "--mode", "min"))

# %% [markdown]
# The champion, loaded as `mlflow models serve` would serve it, decides a few validation digits by least
# expected cost:

# %%
from datamodules.digits import DigitsDataModule

data = DigitsDataModule()
data.setup("fit")
images, labels = next(iter(data.val_dataloader()))
champion = mlflow.pyfunc.load_model("models:/digits@champion")
answers = pd.DataFrame(champion.predict(images[:8].numpy()))
answers.assign(truth=labels[:8].numpy())[["truth", "decision", "expected_cost"]]
