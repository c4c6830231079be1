"""A plain (non-editable) ``pip install .`` works from another directory, price catalog included.

How, without downloading the dependencies (~6 GB of torch & co.):

1. The repository is copied to a temporary folder (without ``.git``, caches and run outputs) and a
   wheel is built from it with the running interpreter's pip: ``pip wheel --no-deps
   --no-build-isolation`` (the build backend, setuptools, comes from the running environment).
   The wheel must hold every ``.py`` file of ``callbacks/``, ``datamodules/`` and ``recipes/``, and
   the price catalog ``callbacks/analysis/prices.yaml`` as package data.
2. A fresh virtualenv (``python -m venv --without-pip``) gets that wheel with ``pip --python
   <venv python> install --no-deps``, before anything else is visible in it, so pip sees no other
   atscale there.
3. Only then the dependencies are made importable: a ``.pth`` file in the new venv's site-packages
   names the running environment's site-packages (``sysconfig.get_paths()["purelib"]``, and
   ``platlib`` when different). A path listed in a ``.pth`` is appended to ``sys.path`` after the
   venv's own site-packages, and the ``.pth`` files inside it are not processed (it is not a site
   directory), so the repository's editable install there (``__editable__.atscale-*.pth`` and its
   finder) never runs and the new venv's own copy of atscale wins. The script checks exactly that:
   no ``__editable__`` finder in ``sys.meta_path``, and ``callbacks.__file__`` (and
   ``CostTracker``'s catalog) inside the new venv's site-packages.
4. From a third directory, with no ``PYTHONPATH``, ``CostTracker()``, ``SpotCheckpoint()`` and
   ``StepTiming()`` are constructed and a short fit with them runs and logs their metrics.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("callbacks", "datamodules", "recipes")
NOT_SOURCE = (".git", ".venv", "venv", ".ruff_cache", ".pytest_cache", "__pycache__", "build", "dist",
              "*.egg-info", "runs", "mlruns", "data", "lightning_logs")

SCRIPT = """
    import sys
    from pathlib import Path

    site = Path(sys.argv[1]).resolve()
    assert not any(getattr(f, "__module__", "").startswith("__editable__") for f in sys.meta_path), sys.meta_path

    import callbacks
    import datamodules
    import recipes

    for package in (callbacks, datamodules, recipes):
        assert site in Path(package.__file__).resolve().parents, (package.__name__, package.__file__)

    import lightning.pytorch as pl
    import torch
    from callbacks import CostTracker, SpotCheckpoint, StepTiming
    from callbacks.analysis import prices
    from lightning.pytorch.loggers.logger import Logger
    from torch.utils.data import DataLoader, TensorDataset

    assert prices.DEFAULT_CATALOG.is_file() and site in prices.DEFAULT_CATALOG.resolve().parents, prices.DEFAULT_CATALOG
    assert CostTracker(instance="a3-highgpu-1g").price == 11.06  # on demand, from the shipped catalog


    class Recorder(Logger):
        name, version = "recorder", 0

        def __init__(self):
            super().__init__()
            self.metrics = {}

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            self.metrics.update({k: float(v) for k, v in metrics.items()})


    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    x = torch.randn(32, 4)
    loader = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4)
    cost, spot, timing = CostTracker(), SpotCheckpoint(), StepTiming(warmup_steps=1, log_every_n_steps=2)
    recorder = Recorder()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=recorder, log_every_n_steps=2,
                         callbacks=[cost, spot, timing], enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir="run")
    trainer.fit(Tiny(), train_dataloaders=loader)
    assert trainer.global_step == 6
    assert recorder.metrics["cost/usd"] == 0.0 and recorder.metrics["cost/billed_s"] > 0  # cpu-local is free
    assert recorder.metrics["time/step_s"] > 0, sorted(recorder.metrics)
    # SpotCheckpoint's save at the run's last step, in ModelCheckpoint's folder (run/<logger>/version_<n>/checkpoints)
    saved = sorted(p.relative_to("run").as_posix() for p in Path("run").rglob("step=*.ckpt"))
    assert saved == ["recorder/version_0/checkpoints/step=00000006.ckpt"], saved
    print("INSTALL-TEST-OK")
"""


def test_plain_install_runs_from_another_directory(tmp_path: Path) -> None:
    import setuptools  # noqa: F401  the build backend, used without build isolation: required, never skipped

    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and not k.startswith(("PIP_", "ATSCALE_", "MLFLOW_", "SLURM_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"})

    def run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
        result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        assert result.returncode == 0, (f"{cmd} exited {result.returncode}:\n"
                                        f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
        return result

    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--wheel-dir", str(wheels), str(source)],
        cwd=tmp_path)
    (wheel,) = wheels.glob("atscale-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "callbacks/analysis/prices.yaml" in names
    sources = {p.relative_to(REPO).as_posix() for package in PACKAGES for p in (REPO / package).rglob("*.py")}
    assert sources == {n for n in names if n.endswith(".py")}

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)], cwd=tmp_path)
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=tmp_path).stdout.strip())
    assert (site / "callbacks" / "analysis" / "prices.yaml").is_file()
    assert not list(site.glob("__editable__*"))
    shared = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "zz_shared_dependencies.pth").write_text("".join(f"{path}\n" for path in shared))

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "use_it.py").write_text(textwrap.dedent(SCRIPT))
    result = run([str(python), "use_it.py", str(site)], cwd=elsewhere)
    assert "INSTALL-TEST-OK" in result.stdout
