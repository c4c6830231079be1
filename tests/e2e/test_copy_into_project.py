"""Each callback, datamodule and task, copied into another project with the files its docstring names, trains there.

For every top-level module of ``callbacks/`` and ``datamodules/``, and the tasks' LightningModules of
``recipes/`` (``classifier.py``, ``gpt.py``), the test reads its docstring's "Copy with it" line, copies the
module and exactly those files into a temporary project outside the repository under another package name
(``myproj/cbs/`` for callbacks, ``myproj/dms/`` for datamodules, ``myproj/tasks/`` for tasks, a task's file
from ``callbacks/`` beside it; every folder gets an empty ``__init__.py``), and runs a script there in a subprocess
that constructs the callback (or datamodule), fits a tiny LightningModule with it on the CPU and
checks what it produced (the metrics it logs, the files it writes, the batches it yields).

The repository is made unimportable in that subprocess: no ``PYTHONPATH``, the temporary project as
the working directory, and ``harness.py`` (the script's first import) removes the repository's
editable-install finder from ``sys.meta_path``/``sys.path_hooks`` and any ``sys.path`` entry inside
the repository, then asserts that ``callbacks``, ``datamodules`` and ``recipes`` cannot be found. At
the end it asserts that no loaded module came from the repository. A file the docstring forgot, or a
file read relative to the repository, therefore fails the run (``test_a_missing_file_fails_the_copy``
shows the harness catching one).
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import CORPUS_FILES, run_script, seed_mlflow_db, write_corpus, write_mnist

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"callbacks": "cbs", "datamodules": "dms", "recipes": "tasks"}  # repository package -> name in the copy

# ------------------------------------------------------------------------------------------------ the copy


def copy_list(module: Path) -> list[str]:
    """The files a module's docstring says to copy with it, relative to its package folder (braces expanded)."""
    doc = ast.get_docstring(ast.parse(module.read_text())) or ""
    match = re.search(r"^Copy with it\b(.*?)(?:\n\s*\n|\Z)", doc, re.S | re.M)
    assert match, f"{module.relative_to(REPO)}: no 'Copy with it' line in its docstring"
    text = " ".join(match.group(1).split())
    if "works alone" in text:
        assert "``" not in text, f"{module.name}: 'works alone' and files named: {text!r}"
        return []
    # the preamble names the base folder and the __init__.py rule, not files to copy
    text = re.sub(r"\(paths under ``[^`]+``, each folder with an ``__init__\.py``\)", "", text)
    files: list[str] = []
    for span in re.findall(r"``([^`]+)``", text):
        if not re.search(r"\.(py|yaml)$", span):
            continue  # an argument name in a remark, e.g. timing's ``comm_hook``
        span = span.removeprefix(f"{module.parent.name}/")  # datamodules write ``datamodules/loaders.py``
        braces = re.search(r"\{([^}]*)\}", span)
        parts = braces.group(1).split(",") if braces else [""]
        files += [span[: braces.start()] + p.strip() + span[braces.end():] if braces else span for p in parts]
    assert files, f"{module.name}: the 'Copy with it' line names no file: {text!r}"
    return files


def make_project(root: Path, package: str, module: str, files: list[str]) -> Path:
    """``root/myproj/<cbs|dms|tasks>/`` holding ``module`` and ``files``, an empty ``__init__.py`` in each folder.

    A file of another of the repository's packages (a task's ``callbacks/analysis/decision_cost.py``) is put
    beside the module, as its docstring says."""
    source = REPO / package
    target = root / "myproj" / PACKAGES[package]
    for rel in [f"{module}.py", *files]:
        other = rel.split("/", 1)[0] in PACKAGES and rel.split("/", 1)[0] != package
        origin, place = (REPO / rel, target / Path(rel).name) if other else (source / rel, target / rel)
        assert origin.is_file(), f"{package}/{module}.py names {rel}, which does not exist"
        place.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(origin, place)
    for folder in [root / "myproj", *(p for p in target.rglob("*") if p.is_dir()), target]:
        (folder / "__init__.py").touch()
    return target


HARNESS = '''
"""Imported first by every script: make the repository unimportable, then shared tiny pieces."""
import importlib
import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(os.environ["COPY_TEST_REPO"])
PACKAGES = [REPO / name for name in ("callbacks", "datamodules", "recipes")]
for finder in list(sys.meta_path):  # setuptools' editable install: a finder class named __editable___*
    if getattr(finder, "__module__", "").startswith("__editable__"):
        PACKAGES += [Path(p) for p in getattr(sys.modules[finder.__module__], "MAPPING", {}).values()]
        sys.meta_path.remove(finder)
sys.path_hooks[:] = [h for h in sys.path_hooks if not getattr(h, "__module__", "").startswith("__editable__")]
sys.path_importer_cache.clear()
ROOTS = {p.parent.resolve() for p in PACKAGES}  # a sys.path entry that makes those packages importable


def _inside(path):
    """Whether a file lies in one of the repository's packages (or its editable install's)."""
    resolved = Path(path).resolve()
    return any(resolved == root or root.resolve() in resolved.parents for root in PACKAGES)


sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() not in ROOTS]
importlib.invalidate_caches()
for name in ("callbacks", "datamodules", "recipes"):
    assert importlib.util.find_spec(name) is None, f"{name} is importable from the copy's project"
assert Path.cwd().resolve() not in ROOTS and REPO.resolve() not in Path.cwd().resolve().parents, Path.cwd()

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.loggers.logger import Logger  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

torch.manual_seed(0)


def no_module_from_the_repository():
    loaded = [m.__name__ for m in list(sys.modules.values()) if _inside(getattr(m, "__file__", None) or "/")]
    assert not loaded, f"modules loaded from the repository: {loaded}"


class Recorder(Logger):
    """Keeps every logged metric: ``history[key]`` is the list of (step, value)."""

    def __init__(self):
        super().__init__()
        self.history = {}

    @property
    def name(self):
        return "recorder"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        for key, value in metrics.items():
            self.history.setdefault(key, []).append((step, float(value)))

    def last(self, key):
        assert key in self.history, f"{key} was not logged; logged: {sorted(self.history)}"
        return self.history[key][-1][1]


class Tiny(pl.LightningModule):
    """Logistic regression; counts its training and validation batches."""

    def __init__(self, features=8, classes=2, lr=0.1):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(classes))
        self.net(torch.zeros(1, features))  # materialise the lazy layer before the optimizer sees it
        self.lr = lr
        self.train_batches = 0
        self.val_batches = 0

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.train_batches += 1
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_batches += 1
        self.log("val/acc", (self(x).argmax(-1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def data(n=64, features=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


class TinyData(pl.LightningDataModule):
    """64 training and 32 validation rows, with the extras some callbacks read."""

    def __init__(self, batch_size=8):
        super().__init__()
        self.batch_size = batch_size
        self.train, self.val = data(64), data(32, seed=1)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=16)

    def example_input(self):
        return self.val.tensors[0][:1]

    def fingerprint(self):
        return "tiny-0"


def trainer(**kwargs):
    kwargs = {"accelerator": "cpu", "devices": 1, "logger": Recorder(), "enable_progress_bar": False,
              "enable_model_summary": False, "enable_checkpointing": False, "num_sanity_val_steps": 0,
              "log_every_n_steps": 1, "default_root_dir": "run", **kwargs}
    return pl.Trainer(**kwargs)


def done():
    """The script's end, as recipes.fit ends: a DDP rank skips the teardown where gloo can abort it (SIGABRT)."""
    from shutdown import destroy_process_group, exit_process  # recipes/run/shutdown.py, copied as a user would

    no_module_from_the_repository()
    destroy_process_group()
    print("COPY-TEST-OK")
    exit_process(0)
'''

# --------------------------------------------------------------------------------------------- the scripts
# Each runs in the copy's project after ``from harness import *``; ``done()`` last.

SCRIPTS = {
    "baselines": """
        import numpy as np
        from myproj.cbs.baselines import Baselines

        class WithArrays(TinyData):
            def baseline_arrays(self):  # 70% class 0, both splits; separable on feature 0
                rng = np.random.default_rng(0)
                arrays = []
                for n in (40, 10):
                    y = np.array([0] * (7 * n // 10) + [1] * (3 * n // 10))
                    x = rng.normal(size=(n, 4))
                    x[:, 0] = np.where(y == 1, 1.0, -1.0) * (np.abs(x[:, 0]) + 0.5)
                    arrays += [x, y]
                return tuple(arrays)

        cb = Baselines()
        t = trainer(max_steps=3, callbacks=[cb])
        t.fit(Tiny(), datamodule=WithArrays())
        assert t.logger.last("baseline/majority_acc") == 0.7, t.logger.history
        assert t.logger.last("baseline/linear_acc") == 1.0, t.logger.history
        assert cb.results == {"baseline/majority_acc": 0.7, "baseline/linear_acc": 1.0}, cb.results
    """,
    "checkpoint_io": """
        from lightning.pytorch.callbacks import ModelCheckpoint
        from myproj.cbs.checkpoint_io import AtomicCheckpointIO
        from myproj.cbs.storage import ckpt_store

        io = AtomicCheckpointIO()
        ckpt = ModelCheckpoint(dirpath="ckpts", every_n_train_steps=2, save_top_k=-1, filename="{step}")
        t = trainer(max_steps=5, callbacks=[ckpt], plugins=[io], enable_checkpointing=True, limit_val_batches=0)
        t.fit(Tiny(), datamodule=TinyData())
        assert t.strategy.checkpoint_io is io
        names = sorted(p.name for p in Path("ckpts").glob("*.ckpt"))
        assert names == ["step=2.ckpt", "step=4.ckpt"], names
        record = ckpt_store.newest_good("ckpts", "*.ckpt")
        assert record is not None and Path(record.path).name == "step=4.ckpt" and record.global_step == 4, record
        # resume through the same plugin
        t2 = trainer(max_steps=6, plugins=[AtomicCheckpointIO()], limit_val_batches=0)
        t2.fit(Tiny(), datamodule=TinyData(), ckpt_path=record.path)
        assert t2.global_step == 6, t2.global_step
    """,
    "compression": """
        import torch.distributed as dist
        from myproj.cbs.compression import GradientCompression
        from myproj.cbs.utils.comm_hooks import composed_hook

        class Checked(Tiny):
            # fp16 compression all-reduces the gradient bucket in float16 and copies it back:
            # every reduced gradient is then exactly a float16 value (float32 gradients are not)
            exact = []

            def on_before_optimizer_step(self, optimizer):
                self.exact.append(all(torch.equal(p.grad, p.grad.half().float()) for p in self.parameters()))

            def on_train_end(self):
                wrapped.append(self.trainer.strategy.model)  # unwrapped again after the fit

        wrapped = []

        cb = GradientCompression("fp16")
        t = trainer(max_steps=4, callbacks=[cb], strategy="ddp", devices=2, limit_val_batches=0)
        model = Checked()
        t.fit(model, datamodule=TinyData())
        assert t.world_size == 2 and dist.get_backend() == "gloo"
        assert cb.active, "GradientCompression did not register its hook"
        (ddp,) = wrapped
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel), type(ddp)
        composed = composed_hook(ddp)
        assert composed is not None and composed.compression == "fp16" and composed.chain, composed
        assert model.exact == [True] * 4, model.exact
        weights = [None, None]
        dist.all_gather_object(weights, model.net[1].weight.detach().tolist())
        assert weights[0] == weights[1]
    """,
    "cost": """
        import yaml
        from myproj.cbs.cost import CostTracker

        catalog = yaml.safe_load(Path("myproj/cbs/analysis/prices.yaml").read_text())["a3-highgpu-1g"]
        cb = CostTracker(instance="a3-highgpu-1g", market="spot")
        assert cb.price == catalog["spot_usd_per_h"], (cb.price, catalog)
        t = trainer(max_steps=4, callbacks=[cb], limit_val_batches=0)
        t.fit(Tiny(), datamodule=TinyData())
        log = t.logger
        spot, on_demand = catalog["spot_usd_per_h"], catalog["on_demand_usd_per_h"]
        assert abs(log.last("cost/savings_pct") - 100 * (1 - spot / on_demand)) < 1e-9
        assert log.last("cost/usd") > 0
        assert abs(log.last("cost/usd") / log.last("cost/usd_on_demand") - spot / on_demand) < 1e-9
        assert log.last("cost/usd") == log.last("cost/usd_spot")
    """,
    "lm_baselines": """
        from myproj.cbs.lm_baselines import LMBaselines

        class WithBpb(TinyData):
            def baseline_bits_per_byte(self):
                return {"unigram": 4.25, "bigram": 3.5}

        cb = LMBaselines()
        t = trainer(max_steps=2, callbacks=[cb], limit_val_batches=0)
        t.fit(Tiny(), datamodule=WithBpb())
        assert t.logger.last("baseline/unigram_bpb") == 4.25 and t.logger.last("baseline/bigram_bpb") == 3.5
    """,
    "lr_scaling": """
        from myproj.cbs.lr_scaling import LRScaling

        cb = LRScaling(mode="linear", base_batch_size=8)
        t = trainer(max_steps=3, callbacks=[cb], limit_val_batches=0)
        t.fit(Tiny(lr=0.1), datamodule=TinyData(batch_size=16))
        log = t.logger
        assert log.last("lr/scale") == 2.0 and log.last("lr/batch") == 16.0, log.history
        assert abs(log.last("lr/actual") - 0.2) < 1e-12, log.history["lr/actual"]
        assert t.optimizers[0].param_groups[0]["lr"] == 0.1  # the scheduled rate is back after each step
    """,
    "manifest": """
        import json
        from myproj.cbs.manifest import Manifest

        t = trainer(max_steps=2, callbacks=[Manifest("run/r1", seed=7, argv=["train.py"])], limit_val_batches=0)
        t.fit(Tiny(), datamodule=TinyData())
        manifest = json.loads(Path("run/r1/manifest.json").read_text())
        assert (manifest["seed"], manifest["world_size"], manifest["data_fingerprint"]) == (7, 1, "tiny-0"), manifest
        assert manifest["command"][1:] == ["train.py"] and manifest["versions"]["torch"] == torch.__version__
        assert any(p.startswith("torch==") for p in manifest["packages"]), manifest["packages"][:5]
    """,
    "mlflow_model": """
        import mlflow
        from lightning.pytorch.loggers import MLFlowLogger
        from myproj.cbs.mlflow_model import LogModel

        uri = f"sqlite:///{Path('mlflow.db').resolve()}"
        logger = MLFlowLogger(experiment_name="copy", tracking_uri=uri)
        cb = LogModel()
        t = trainer(max_steps=3, callbacks=[cb], logger=logger, limit_val_batches=0)
        model = Tiny()
        t.fit(model, datamodule=TinyData())
        assert cb.model_uri is not None and cb.model_uri.startswith("models:/"), cb.model_uri
        mlflow.set_tracking_uri(uri)
        loaded = mlflow.pytorch.load_model(cb.model_uri)
        x = torch.randn(5, 8)
        assert torch.equal(loaded(x), model(x)), "the logged model differs from the trained one"
    """,
    "model_checkpoint": """
        from myproj.cbs.checkpoint_io import AtomicCheckpointIO
        from myproj.cbs.model_checkpoint import PublishedModelCheckpoint
        from myproj.cbs.storage import ckpt_store

        ckpt = PublishedModelCheckpoint(dirpath="ckpts", every_n_train_steps=2, save_top_k=-1, filename="{step}")
        t = trainer(max_steps=4, callbacks=[ckpt], plugins=[AtomicCheckpointIO()], enable_checkpointing=True,
                    limit_val_batches=0)
        t.fit(Tiny(), datamodule=TinyData())
        assert sorted(p.name for p in Path("ckpts").glob("*.ckpt")) == ["step=2.ckpt", "step=4.ckpt"]
        assert ckpt_store.read_record("ckpts/step=4.ckpt").global_step == 4
        assert Path(ckpt.best_model_path).name == "step=4.ckpt", ckpt.best_model_path
    """,
    "noise_scale": """
        import math
        from myproj.cbs.noise_scale import GradientNoiseScale

        cb = GradientNoiseScale(beta=0.5, log_every_n_steps=1)
        t = trainer(max_steps=4, callbacks=[cb], accumulate_grad_batches=2, limit_val_batches=0)
        t.fit(Tiny(), datamodule=TinyData(batch_size=8))
        log = t.logger
        assert cb.mode == "accumulation", (cb.mode, cb.disabled_reason)
        assert (log.last("noise_scale/batch_small"), log.last("noise_scale/batch_used")) == (8.0, 16.0), log.history
        assert math.isfinite(log.last("noise_scale/b_simple")) and log.last("noise_scale/grad_sq_norm") > 0
    """,
    "cpu_threads": """
        import torch
        from myproj.cbs.cpu_threads import AdaptiveCpuThreads

        before = torch.get_num_threads()
        cb = AdaptiveCpuThreads(candidates=[2, 1], probe_every=2, window=2, probe_steps=2, settle_steps=0)
        t = trainer(max_steps=16, callbacks=[cb], limit_val_batches=0)
        t.fit(Tiny(), datamodule=TinyData())
        # the first probe follows the 2-step window: both counts were timed, then one kept
        assert t.global_step == 16 and set(cb.probed) == {1, 2}, cb.probed
        assert t.logger.history["cpu/threads"][0] == (0, 2.0), t.logger.history["cpu/threads"]
        assert cb.chooser is None and torch.get_num_threads() == before  # the process as it was found
    """,
    "elastic": """
        from myproj.cbs.elastic import ElasticResume

        cb = ElasticResume(keep_global_batch=True)
        t = trainer(max_steps=4, callbacks=[cb], limit_val_batches=0)
        t.fit(Tiny(), datamodule=TinyData())
        # one process: the run's global batch is one per-device batch, recorded for a resume elsewhere
        assert cb.state_dict() == {"world_size": 1, "accumulate": 1, "global_units": 1}, cb.state_dict()
        assert t.logger.history["elastic/world_size"] == [(0, 1.0)], t.logger.history["elastic/world_size"]
    """,
    "progress": """
        from myproj.cbs.progress import RunProgressBar

        bar = RunProgressBar()
        t = trainer(max_steps=3, max_epochs=-1, callbacks=[bar], enable_progress_bar=True, limit_val_batches=0)
        t.fit(Tiny(), datamodule=TinyData())
        assert t.progress_bar_callback is bar and t.global_step == 3
        assert bar._get_train_description(0) == "Epoch 0", bar._get_train_description(0)
    """,
    "spot": """
        from myproj.cbs.checkpoint_io import AtomicCheckpointIO
        from myproj.cbs.spot import SpotCheckpoint
        from myproj.cbs.storage import ckpt_store

        # a real SIGTERM after step 5 (the fire drill), saves every 2 steps, Daly's interval from the first save
        cb = SpotCheckpoint(every_n_steps=2, drill_steps=[5], every_minutes="auto", interruption_rate=0.1,
                            keep=2, dirpath="ckpts")
        t = trainer(max_steps=20, callbacks=[cb], plugins=[AtomicCheckpointIO()], limit_val_batches=0)
        t.fit(Tiny(), datamodule=TinyData())
        assert cb.interrupted and t.global_step == 5, (cb.interrupted, t.global_step)
        assert t.logger.last("spot/interruptions") == 1.0 and t.logger.last("spot/interval_s") > 0
        names = sorted(p.name for p in Path("ckpts").glob("step=*.ckpt"))
        assert names == ["step=00000004.ckpt", "step=00000005.ckpt"], names
        newest = ckpt_store.newest_good("ckpts")
        assert newest is not None and newest.global_step == 5, newest
        resumed = SpotCheckpoint(keep=2, dirpath="ckpts")
        t2 = trainer(max_steps=8, callbacks=[resumed], plugins=[AtomicCheckpointIO()], limit_val_batches=0)
        t2.fit(Tiny(), datamodule=TinyData(), ckpt_path=newest.path)
        assert t2.global_step == 8 and resumed.interruptions == 1 and not resumed.interrupted
        assert ckpt_store.newest_good("ckpts").global_step == 8
    """,
    "throughput": """
        from myproj.cbs.throughput import TokenThroughput

        class Tokens(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.emb, self.out = torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256)

            def training_step(self, batch, batch_idx):
                x, y = batch
                return torch.nn.functional.cross_entropy(self.out(self.emb(x)).flatten(0, 1), y.flatten())

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        x = torch.randint(0, 256, (40, 12))
        loader = DataLoader(TensorDataset(x, x.roll(-1, 1)), batch_size=4)  # 10 batches of 4 x 12 tokens
        cb = TokenThroughput(window_size=2)
        t = trainer(max_steps=6, callbacks=[cb])
        t.fit(Tokens(), train_dataloaders=loader)
        log = t.logger
        assert log.last("train/lengths") == 6 * 4 * 12, log.history.get("train/lengths")
        assert log.last("train/device/tokens_per_sec") > 0
        assert "train/device/mfu" not in log.history  # no peak FLOP/s known on a CPU
    """,
    "timing": """
        from myproj.cbs.timing import StepTiming

        cb = StepTiming(warmup_steps=1, log_every_n_steps=2)
        t = trainer(max_steps=5, callbacks=[cb], limit_val_batches=0)
        t.fit(Tiny(), datamodule=TinyData())
        log = t.logger
        parts = ["time/data_s", "time/forward_s", "time/backward_s", "time/optimizer_s"]
        # every part of a real step takes time; one process exposes no communication; the step is their sum
        assert all(log.last(k) > 0 for k in parts) and log.last("time/comm_exposed_s") == 0.0, log.history
        assert abs(log.last("time/step_s") - sum(log.last(k) for k in parts)) <= 1e-12, log.history
        assert log.last("time/samples_per_s") > 0
        assert Path("run/time_breakdown.png").stat().st_size > 0
    """,
    # ------------------------------------------------------------------------------------- datamodules
    "digits": """
        from myproj.dms.digits import DigitsDataModule

        dm = DigitsDataModule(batch_size=64)
        model = Tiny(features=64, classes=10)
        t = trainer(max_epochs=1, limit_val_batches=1.0)
        t.fit(model, datamodule=dm)
        # 1797 images, 20% (360) held out: 1437 training rows -> 23 batches of 64; validation 2 of 256
        assert (len(dm.train_set), len(dm.val_set)) == (1437, 360)
        assert (model.train_batches, model.val_batches, t.global_step) == (23, 2, 23)
        assert "val/acc" in t.logger.history
    """,
    "streaming": """
        import hashlib
        import json
        from pathlib import Path

        import numpy as np
        from litdata.streaming.writer import BinaryWriter
        from myproj.dms.streaming import StreamingImageDataModule

        # chunks as recipes.prepare writes them (litdata's writer, as litdata.optimize uses it), and atscale.json
        # with every file's SHA-256 (the datamodule reads no file it does not list)
        for split, count in (("train", 64), ("val", 16)):
            writer = BinaryWriter(f"stream/{split}", chunk_size=16)
            for i in range(count):
                writer[i] = {"x": np.full((1, 8, 8), i / 100, dtype=np.float32), "y": i % 10}
            writer.done()
            writer.merge()
        files = {p.relative_to("stream").as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                 for p in Path("stream").rglob("*") if p.is_file()}
        with open("stream/atscale.json", "w") as handle:
            json.dump({"kind": "images", "complete": True, "num_classes": 10, "files": files}, handle)
        dm = StreamingImageDataModule("stream", batch_size=8, cache_dir="cache")
        model = Tiny(features=64, classes=10)
        t = trainer(max_epochs=1, limit_val_batches=1.0)
        t.fit(model, datamodule=dm)
        assert (len(dm.train_set), len(dm.val_set)) == (64, 16)
        assert (model.train_batches, model.val_batches, t.global_step) == (8, 1, 8)
        assert len(dm.fingerprint()) == 64
    """,
    "text": """
        from myproj.dms.text import TextDataModule

        class Bytes(Tiny):
            def __init__(self):
                super().__init__(features=8, classes=8)
                self.emb, self.out = torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256)
                self.shapes = set()

            def forward(self, x):
                return self.out(self.emb(x))

            def training_step(self, batch, batch_idx):
                x, y = batch
                assert torch.equal(y[:, :-1], x[:, 1:]) and x.dtype == torch.int64
                self.shapes.add(tuple(x.shape))
                self.train_batches += 1
                return torch.nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

            def validation_step(self, batch, batch_idx):
                self.val_batches += 1

        dm = TextDataModule(root="corpus", block_size=8, batch_size=4, num_samples=40, val_windows=8,
                            cache_dir="cache")
        model = Bytes()
        t = trainer(max_epochs=1)
        t.fit(model, datamodule=dm)
        assert (model.train_batches, model.val_batches, t.global_step) == (10, 2, 10)
        assert model.shapes == {(4, 8)}, model.shapes
        assert set(dm.baseline_bits_per_byte()) == {"unigram", "bigram"}
    """,
    "classifier": """
        from myproj.tasks.classifier import ImageClassifier
        from torch.utils.data import TensorDataset

        class Images(TinyData):  # 8x8 one-channel images, the class from their mean
            def __init__(self):
                super().__init__(batch_size=8)
                x = torch.randn(96, 1, 8, 8, generator=torch.Generator().manual_seed(0))
                y = (x.mean(dim=(1, 2, 3)) > 0).long()
                self.train, self.val = TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])

        try:
            ImageClassifier(num_classes=2, costs=[[0, -1], [1, 0]])
        except ValueError as err:  # the copied decision_cost checks the matrix
            assert "-1" in str(err), err
        else:
            raise AssertionError("a negative cost was accepted")
        model = ImageClassifier(num_classes=2, width=4, costs=[[0, 1], [1, 0]], decision="bayes")
        t = trainer(max_epochs=2)
        t.fit(model, datamodule=Images())
        log = t.logger
        # a 0/1 matrix: the expected cost is the error rate, and the Bayes decision the argmax (32 images: exact)
        assert log.last("val/expected_cost") == 1 - log.last("val/acc"), log.history
        assert log.last("val/bayes_expected_cost") == log.last("val/expected_cost"), log.history
        assert t.global_step == 16
    """,
    "gpt": """
        from myproj.tasks.gpt import GPT

        class Bytes(TinyData):  # windows of 9 bytes: 8 inputs, 8 next-byte targets
            def __init__(self):
                super().__init__(batch_size=4)
                data = torch.randint(0, 256, (40, 9), generator=torch.Generator().manual_seed(0))
                self.train = TensorDataset(data[:32, :-1], data[:32, 1:])
                self.val = TensorDataset(data[32:, :-1], data[32:, 1:])

        model = GPT(block_size=8, n_layer=1, n_head=2, n_embd=16)
        t = trainer(max_steps=4)
        t.fit(model, datamodule=Bytes())
        assert t.global_step == 4 and len(t.logger.history["train/loss"]) == 4, t.logger.history
    """,
    "vision": """
        from myproj.dms.vision import MNISTDataModule

        dm = MNISTDataModule(root="data", download=False, batch_size=16, val_fraction=0.2)
        model = Tiny(features=28 * 28, classes=10)
        t = trainer(max_epochs=1)
        t.fit(model, datamodule=dm)
        assert (len(dm.train_set), len(dm.val_set)) == (80, 20)
        assert (model.train_batches, model.val_batches, t.global_step) == (5, 1, 5)
        x, y = next(iter(dm.train_dataloader()))
        assert x.shape == (16, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    """,
}

CALLBACKS = sorted(p.stem for p in (REPO / "callbacks").glob("*.py") if p.stem != "__init__")
DATAMODULES = ["digits", "streaming", "text", "vision"]
#: The tasks' LightningModules (recipes/), copied as a user copies a model into their own project.
TASKS = ["classifier", "gpt"]


def write_data(module: str, project: Path) -> None:
    """The local data the datamodules read (no network): a small corpus, MNIST in its raw IDX files."""
    if module == "text":
        write_corpus(project / "corpus", CORPUS_FILES)
    elif module == "vision":
        ids = np.arange(120)
        images = np.broadcast_to((ids % 256).astype(np.uint8)[:, None, None, None], (120, 1, 28, 28)).copy()
        write_mnist(project / "data", images[:100], images[100:])
    elif module == "mlflow_model":
        seed_mlflow_db(project)


def run_in_project(project: Path, script: str, timeout: float = 300) -> subprocess.CompletedProcess:
    (project / "harness.py").write_text(HARNESS)
    shutil.copy2(REPO / "recipes/run/shutdown.py", project / "shutdown.py")
    (project / "run_copy.py").write_text("from harness import *  # noqa: F403\n" + textwrap.dedent(script)
                                         + "\ndone()\n")
    env = {k: v for k, v in os.environ.items()
           if k != "PYTHONPATH" and not k.startswith(("ATSCALE_", "SLURM_", "MLFLOW_"))}
    env.update({"COPY_TEST_REPO": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONDONTWRITEBYTECODE": "1"})
    return run_script(project / "run_copy.py", cwd=project, env=env, timeout=timeout)


def test_every_callback_and_datamodule_has_a_script() -> None:
    assert sorted(CALLBACKS) == sorted(set(SCRIPTS) - set(DATAMODULES) - set(TASKS))
    assert sorted(p.stem for p in (REPO / "datamodules").glob("*.py")) == sorted(
        ["__init__", "loaders", "compat", "worker_signals", "verified_chunks", "stream_stops", "urls", "streamed_items",
         "fetch_ahead", *DATAMODULES])


def test_copy_lists_are_read_as_written() -> None:
    assert copy_list(REPO / "callbacks" / "spot.py") == [
        "checkpoint_io.py", "storage/ckpt_store.py", "storage/safe_load.py", "storage/remote_store.py",
        "utils/notices.py", "utils/rng.py", "utils/compat.py", "utils/agreement.py", "utils/watchdog.py",
        "utils/launcher.py", "utils/save_schedule.py", "utils/drills.py", "utils/resume_record.py",
        "utils/comm_hooks.py", "utils/steps_file.py", "analysis/ckpt_interval.py", "analysis/keys.py"]
    assert copy_list(REPO / "callbacks" / "cost.py") == ["analysis/cost_model.py", "analysis/prices.py",
                                                         "analysis/goodput.py", "analysis/keys.py",
                                                         "analysis/prices.yaml",
                                                         "utils/steps_file.py", "utils/goodput_clock.py",
                                                         "utils/launch_clock.py", "utils/compat.py",
                                                         "utils/goodput_plot.py", "utils/cost_rows.py"]
    assert copy_list(REPO / "callbacks" / "progress.py") == ["utils/compat.py"]
    assert copy_list(REPO / "datamodules" / "text.py") == ["loaders.py", "compat.py", "worker_signals.py"]
    assert copy_list(REPO / "recipes" / "classifier.py") == ["metrics.py", "run/errors.py",
                                                             "callbacks/analysis/decision_cost.py",
                                                             "callbacks/analysis/keys.py"]
    assert copy_list(REPO / "recipes" / "gpt.py") == ["run/errors.py", "callbacks/analysis/keys.py"]


@pytest.mark.parametrize("module", [*CALLBACKS, *DATAMODULES, *TASKS])
def test_copy_trains_in_another_project(module: str, tmp_path: Path) -> None:
    package = "datamodules" if module in DATAMODULES else "recipes" if module in TASKS else "callbacks"
    project = tmp_path / "project"
    assert not project.resolve().is_relative_to(REPO)
    files = copy_list(REPO / package / f"{module}.py")
    make_project(project, package, module, files)
    write_data(module, project)
    result = run_in_project(project, SCRIPTS[module])
    assert result.returncode == 0 and "COPY-TEST-OK" in result.stdout, (
        f"{package}/{module}.py with {files} failed in the copy (exit {result.returncode}):\n"
        f"{result.stdout[-2000:]}\n{result.stderr[-6000:]}")


def test_a_missing_file_fails_the_copy(tmp_path: Path) -> None:
    """The harness catches a hidden dependency: cost.py copied without analysis/ cannot import."""
    project = tmp_path / "project"
    make_project(project, "callbacks", "cost", [])
    result = run_in_project(project, "from myproj.cbs.cost import CostTracker\n")
    assert result.returncode == 1 and "COPY-TEST-OK" not in result.stdout
    assert "ModuleNotFoundError: No module named 'myproj.cbs.analysis'" in result.stderr, result.stderr[-3000:]
