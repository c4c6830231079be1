"""``python -m recipes.bench gpu``: the GPU check of the speed goals, one command, one JSON, one README table.

On one CUDA GPU (about 8 minutes on an H100/H200-class device) it measures, for the gpt-124m recipe
(``configs/gpt-124m.yaml``: bf16-mixed, ``torch.compile``, 16 x 1024-byte windows per step):

- **tokens/s and MFU** of the full recipe (:class:`recipes.run.cli.AtscaleCLI` with the config, every default
  callback, MLflow), MFU against the GPU's dense bf16 peak (:func:`callbacks.throughput.peak_flops`);
- **recipe overhead**: the full recipe's tokens/s over plain Lightning's (same model, data, precision,
  compile, clipping; no logger, checkpointing or progress bar), rounds interleaved, with the bootstrap 95 %
  CI of :func:`recipes.bench.stats.bootstrap_ratio_ci` and its verdict against the goal (>= 0.99);
- **StepTiming's CUDA-event clock against the wall clock**: plain Lightning + StepTiming; the sum of the
  step times it resolves from CUDA events over the window, over the window's wall time (the device
  synchronized at both ends);
- **checkpoint stall** for the model's full training state (weights + AdamW state): the blocked time of
  :class:`callbacks.checkpoint_io.BoundedAsyncCheckpointIO` per save (the first save, which allocates the
  pinned staging buffer, apart), a synchronous :class:`~callbacks.checkpoint_io.AtomicCheckpointIO` save,
  and the floor they are compared with: a device-to-host ``copy_`` of the same tensors into pinned
  buffers allocated beforehand (:func:`recipes.bench.runs.tensors_copy_floor`). Goal: async <= 1.5x the floor.

Throughput is measured as in ``bench overhead``: from the end of the warm-up steps (which hold the
compilation) to the end of the last step, the device synchronized at those two points only. The model is
not logged to MLflow (``--log_model false``: it happens after the last step, outside the window) and
nothing is validated (``limit_val_batches 0``), to keep the command within its time.

Without a GPU (or with ``--device cpu``) it runs a **cpu reduced mode**: the same steps and keys on a tiny
GPT in fp32 without compile, a few steps, no MFU; it says so in the JSON (``mode``) and the table. It is
what the tests run; its figures are not GPU figures.

Writes ``bench_gpu.json`` and ``bench_gpu.md`` (the README-ready table) under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import mlflow
import torch
import yaml
from lightning.pytorch import Callback, Trainer
from lightning_utilities.core.apply_func import apply_to_collection

from callbacks.checkpoint_io import AtomicCheckpointIO, BoundedAsyncCheckpointIO
from callbacks.throughput import peak_flops
from callbacks.timing import PARTS, StepTiming
from recipes.bench.runs import Stopwatch, own_store_uri, run_full_recipe, tensors_copy_floor
from recipes.bench.stats import bootstrap_ratio_ci, verdict, window_throughput
from recipes.run.common import UsageError
from recipes.run.process import quiet_known_noise

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gpt-124m.yaml"
GPU_MODE, CPU_MODE = "gpu", "cpu reduced mode"
#: Goals: MFU on an H100/H200-class GPU, full recipe / plain Lightning, async stall / pinned copy.
GOAL_MFU = 0.45
GOAL_RECIPE_RATIO = 0.99
GOAL_STALL_OVER_FLOOR = 1.5
#: StepTiming's event-clock total may differ from the wall clock by this fraction of the window.
TIMING_TOLERANCE = 0.02
#: The cpu reduced mode's model: GPT's shape scaled down so the whole command takes seconds.
CPU_MODEL = {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 16, "compile": False}
#: Keys of the JSON (tests assert them; the README table is built from them).
KEYS = ("mode", "device", "settings", "model", "throughput", "mfu", "overhead", "step_timing", "checkpoint",
        "goals", "elapsed_s")
VARIANTS = {"b": "plain Lightning", "b+timing": "plain Lightning + StepTiming", "c": "full recipe"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``gpu`` subcommand's options."""
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="cuda: the GPU check; cpu: the cpu reduced mode; auto: cuda when available")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per variant and round, warm-up included (default 250 on GPU, 8 on CPU)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="steps before the throughput window opens: they hold torch.compile's compilation "
                             "(default 50 on GPU, 3 on CPU)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds of every variant (default 3 on GPU, 1 on CPU); no round starts "
                             "after --budget-s")
    parser.add_argument("--budget-s", dest="budget_s", type=float, default=330.0,
                        help="start no further round after this many seconds (the checkpoint part follows)")
    parser.add_argument("--saves", type=int, default=4,
                        help="asynchronous checkpoint saves timed (the first, which allocates the buffer, apart)")
    parser.add_argument("--max-bytes", dest="max_bytes", type=int, default=None,
                        help="bytes of the text corpus encoded (default 16 MB on GPU, 200 kB on CPU)")
    parser.add_argument("--out", default="runs/bench-gpu", help="folder for bench_gpu.json and bench_gpu.md")
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the table")


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings: the GPU or CPU branch, chosen explicitly, and the defaults of that branch.

    Raises:
        UsageError: for ``--device cuda`` without a GPU, or a count out of range (named).
    """
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available (use --device cpu for the cpu reduced mode)")
    gpu = {"steps": 250, "warmup": 50, "rounds": 3, "max_bytes": 16_000_000}
    cpu = {"steps": 8, "warmup": 3, "rounds": 1, "max_bytes": 200_000}
    settings = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in (gpu if cuda else cpu).items()}
    settings["saves"], settings["budget_s"] = args.saves, args.budget_s
    for name in ("steps", "warmup", "rounds", "max_bytes"):
        if settings[name] < 1:
            raise UsageError(f"--{name.replace('_', '-')} {settings[name]} must be >= 1")
    if not settings["budget_s"] > 0:
        raise UsageError(f"--budget-s {settings['budget_s']} must be > 0")
    if settings["saves"] < 2:
        raise UsageError(f"--saves {settings['saves']} must be >= 2 (the first save allocates the buffer)")
    if settings["steps"] <= settings["warmup"] + 1:
        raise UsageError(f"--steps {settings['steps']} must exceed --warmup {settings['warmup']} + 1")
    settings["mode"] = GPU_MODE if cuda else CPU_MODE
    return settings


def recipe_config(mode: str) -> dict[str, Any]:
    """The gpt-124m recipe's model, data and trainer settings (the cpu reduced mode shrinks the model)."""
    config = yaml.safe_load(CONFIG.read_text())
    model = dict(config["model"]["init_args"])
    optimizer = model.pop("optimizer")["init_args"]
    data = dict(config["data"]["init_args"])
    trainer = {k: config["trainer"][k] for k in ("precision", "gradient_clip_val")}
    if mode == CPU_MODE:
        model.update(CPU_MODEL)
        data.update(block_size=CPU_MODEL["block_size"], batch_size=4)
        trainer["precision"] = "32-true"
    return {"model": model, "optimizer": optimizer, "data": data, "trainer": trainer}


class DeviceStopwatch(Stopwatch):
    """Step ends, the device synchronized at the ends of the throughput window only (steps ``marks``)."""

    def __init__(self, marks: set[int]) -> None:
        super().__init__()
        self.marks = marks

    def on_train_batch_end(self, trainer: Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if len(self.ends) + 1 in self.marks and pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def _data(cfg: dict[str, Any], settings: dict[str, Any]) -> pl.LightningDataModule:
    from datamodules.text import TextDataModule

    return TextDataModule(**{**cfg["data"], "max_bytes": settings["max_bytes"]})


def _model(cfg: dict[str, Any]) -> pl.LightningModule:
    from recipes.gpt import GPT

    return GPT(**cfg["model"], optimizer=functools.partial(torch.optim.AdamW, **cfg["optimizer"]))


def run_plain(cfg: dict[str, Any], settings: dict[str, Any], root: Path, timing: bool) -> dict[str, Any]:
    """Plain Lightning (no logger, checkpointing, progress bar, validation), optionally with StepTiming."""
    steps, warmup = settings["steps"], settings["warmup"]
    torch.manual_seed(42)
    watch = DeviceStopwatch({warmup, steps})
    timer = StepTiming(warmup_steps=warmup, log_every_n_steps=steps, plot=False, calibrate_comm=False)
    callbacks: list[Callback] = [timer, watch] if timing else [watch]
    trainer = Trainer(accelerator="gpu" if settings["mode"] == GPU_MODE else "cpu", devices=1,
                      max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                      callbacks=callbacks, default_root_dir=root, **cfg["trainer"])
    trainer.fit(_model(cfg), datamodule=_data(cfg, settings))
    out: dict[str, Any] = {"ends": watch.ends}
    if timing:
        means = timer.mean_parts()
        out["event_s"] = sum(means[p] for p in PARTS) * timer.steps if means else 0.0
        out["event_steps"] = timer.steps
    return out


def run_recipe(cfg: dict[str, Any], settings: dict[str, Any], root: Path, index: int) -> dict[str, Any]:
    """The full recipe: ``AtscaleCLI`` with ``configs/gpt-124m.yaml`` (the cpu reduced mode shrinks the model)."""
    steps, warmup = settings["steps"], settings["warmup"]
    recipe = ["--config", str(CONFIG), "--experiment", "bench-gpu", "--trainer.max_steps", str(steps),
              "--trainer.limit_val_batches", "0", "--trainer.val_check_interval", str(steps),
              "--trainer.log_every_n_steps", str(min(10, steps)), "--data.init_args.max_bytes",
              str(settings["max_bytes"]), "--log_model", "false"]
    if settings["mode"] == CPU_MODE:
        recipe += ["--trainer.accelerator", "cpu", "--trainer.precision", cfg["trainer"]["precision"]]
        recipe += [arg for key, value in CPU_MODEL.items() for arg in (f"--model.init_args.{key}", str(value))]
        recipe += ["--data.init_args.block_size", str(cfg["data"]["block_size"]),
                   "--data.init_args.batch_size", str(cfg["data"]["batch_size"])]
    watch = DeviceStopwatch({warmup, steps})
    quiet_known_noise()
    ends, fit_s = run_full_recipe(recipe, root, index, watch=watch, keep_files=False)  # a temporary root
    return {"ends": ends, "fit_s": fit_s}


def checkpoint_state(cfg: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The model's full training state as Lightning checkpoints it: weights and AdamW state after one step."""
    torch.manual_seed(0)
    model = _model({**cfg, "model": {**cfg["model"], "compile": False}}).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), **cfg["optimizer"])
    x = torch.randint(0, 256, (2, cfg["model"]["block_size"]), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = model.loss((x, x))
    loss.backward()
    optimizer.step()
    return {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()],
            "global_step": 1, "epoch": 0}


def bench_checkpoint_stall(state: dict[str, Any], root: Path, saves: int) -> dict[str, Any]:
    """Blocked time per async save (first apart), one sync save, and the pinned copy floor of the same tensors."""
    tensors: list[torch.Tensor] = []
    apply_to_collection(state, torch.Tensor, tensors.append)
    floor = tensors_copy_floor(tensors)
    cuda = any(t.is_cuda for t in tensors)
    root.mkdir(parents=True, exist_ok=True)
    io = BoundedAsyncCheckpointIO(AtomicCheckpointIO())
    blocked = []
    try:
        for index in range(saves):
            io.drain()  # the previous write is done: time the stall, not the bound's wait
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            io.save_checkpoint(state, root / f"async-{index % 2}.ckpt")
            blocked.append(time.perf_counter() - started)
    finally:
        io.teardown()
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    AtomicCheckpointIO().save_checkpoint(state, root / "sync.ckpt")
    sync_s = time.perf_counter() - started
    later = statistics.median(blocked[1:])
    return {"bytes": floor["bytes"], "tensors": len(tensors), "floor_copy_s": floor["copy_s"],
            "floor_pinned": bool(floor["pinned"]), "clone_s": floor["clone_s"], "async_first_s": blocked[0],
            "async_blocked_s": later, "async_all_s": blocked, "sync_s": sync_s,
            "async_over_floor": later / floor["copy_s"] if floor["copy_s"] > 0 else float("nan"),
            "async_over_sync": later / sync_s if sync_s > 0 else float("nan")}


def bench_gpu(args: argparse.Namespace, console: Any) -> dict[str, Any]:
    """Run every measurement of the mode ``resolve(args)`` chose; return the JSON's figures."""
    started = time.perf_counter()
    settings = resolve(args)
    mode, steps, warmup = settings["mode"], settings["steps"], settings["warmup"]
    cfg = recipe_config(mode)
    device = torch.device("cuda", torch.cuda.current_device()) if mode == GPU_MODE else torch.device("cpu")
    model = _model({**cfg, "model": {**cfg["model"], "compile": False}})
    tokens_per_step = cfg["data"]["batch_size"] * cfg["data"]["block_size"]
    flops_per_token = model.flops_per_token(cfg["data"]["block_size"])
    params = model.num_params()
    del model
    peak = peak_flops(device) if mode == GPU_MODE else None
    rates: dict[str, list[float]] = {key: [] for key in VARIANTS}
    timing: list[dict[str, float]] = []
    fit_s: list[float] = []
    previous_uri = mlflow.get_tracking_uri()
    with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(os.environ):
        root = Path(tmp)
        os.environ.setdefault("MLFLOW_TRACKING_URI", own_store_uri(root))
        for index in range(settings["rounds"]):
            if index and time.perf_counter() - started > settings["budget_s"]:
                console.print(f"--budget-s {settings['budget_s']:.0f} spent: {index} round(s) run", highlight=False)
                break
            order = list(VARIANTS) if index % 2 == 0 else list(VARIANTS)[::-1]
            for key in order:
                if key == "c":
                    run = run_recipe(cfg, settings, root, index)
                    fit_s.append(run["fit_s"])
                else:
                    run = run_plain(cfg, settings, root / key, timing=key == "b+timing")
                ends = run["ends"]
                if len(ends) != steps:
                    raise RuntimeError(f"variant {key} ran {len(ends)} steps, expected {steps}")
                rates[key].append(window_throughput(ends, tokens_per_step, warmup))
                if key == "b+timing":
                    wall = ends[-1] - ends[warmup - 1]
                    timing.append({"event_s": run["event_s"], "wall_s": wall, "ratio": run["event_s"] / wall,
                                   "steps": run["event_steps"]})
                console.print(f"round {index + 1}/{settings['rounds']} ({VARIANTS[key]}): "
                              f"{rates[key][-1]:,.0f} tokens/s", highlight=False)
        state = checkpoint_state(cfg, device)
        stall = bench_checkpoint_stall(state, root / "checkpoints", settings["saves"])
        del state
        mlflow.set_tracking_uri(previous_uri)  # the recipe set it to this run's store, which is now gone
    ratio, low, high = bootstrap_ratio_ci(rates["c"], rates["b"])
    best = {key: max(values) for key, values in rates.items()}
    mfu = None if peak is None else {
        key: best[key] * flops_per_token / peak for key in ("b", "c")}
    timing_ratio = statistics.median(t["ratio"] for t in timing)
    return {
        "mode": mode,
        "device": torch.cuda.get_device_name(device) if mode == GPU_MODE else f"cpu ({os.cpu_count()} cores)",
        "settings": {**settings, "torch": torch.__version__, "config": str(CONFIG.relative_to(CONFIG.parent.parent)),
                     "precision": cfg["trainer"]["precision"], "compile": cfg["model"]["compile"]},
        "model": {"params": params, "flops_per_token": flops_per_token, "tokens_per_step": tokens_per_step,
                  **{k: cfg["model"][k] for k in ("n_layer", "n_head", "n_embd", "block_size")}},
        "throughput": {"tokens_per_s": best, "all": rates, "full_recipe_fit_s": fit_s},
        "mfu": None if mfu is None else {"full_recipe": mfu["c"], "plain_lightning": mfu["b"],
                                         "peak_tflops": peak / 1e12},
        "overhead": {"c/b": ratio, "low": low, "high": high,
                     "rounds_run": len(rates["c"]),
                     "verdict": verdict(low, high, GOAL_RECIPE_RATIO, 1 - GOAL_RECIPE_RATIO)
                     if len(rates["c"]) > 1 else "inconclusive"},
        "step_timing": {"clock": "cuda events" if mode == GPU_MODE else "perf_counter", "rounds": timing,
                        "ratio": timing_ratio, "ok": abs(timing_ratio - 1) <= TIMING_TOLERANCE},
        "checkpoint": stall,
        "goals": {"mfu": GOAL_MFU, "c/b": GOAL_RECIPE_RATIO, "async_over_floor": GOAL_STALL_OVER_FLOOR,
                  "step_timing_tolerance": TIMING_TOLERANCE},
        "elapsed_s": time.perf_counter() - started,
    }


def markdown(figures: dict[str, Any]) -> str:
    """The README-ready table of the figures (rows named as the JSON's keys are)."""
    gpu = figures["mode"] == GPU_MODE
    s, m, t, o, c = (figures[k] for k in ("settings", "model", "throughput", "overhead", "checkpoint"))
    where = (f"{figures['device']}, torch {s['torch']}" if gpu else
             f"**{CPU_MODE}**: a tiny GPT ({m['params']:,} parameters) in fp32 without compile on "
             f"{figures['device']}, not GPU figures")
    rows = [f"`python -m recipes.bench gpu` — {where}; {o['rounds_run']} interleaved round(s) of {s['steps']} steps "
            f"({s['warmup']} warm-up); {figures['elapsed_s']:.0f} s in all.", "",
            "| measure | result | goal |", "|---|---|---|"]
    rate = t["tokens_per_s"]
    rows.append(f"| tokens/s, full recipe ({s['config']}, {s['precision']}, compile {s['compile']}) | "
                f"{rate['c']:,.0f} (plain Lightning {rate['b']:,.0f}) | |")
    if figures["mfu"] is None:
        rows.append(f"| MFU | not claimed ({'no peak FLOP/s known for this GPU' if gpu else CPU_MODE}) | "
                    f">= {GOAL_MFU:.0%} (GPU) |")
    else:
        f = figures["mfu"]
        rows.append(f"| MFU, full recipe (dense bf16 peak {f['peak_tflops']:,.0f} TFLOP/s) | "
                    f"{f['full_recipe']:.1%} (plain Lightning {f['plain_lightning']:.1%}) | >= {GOAL_MFU:.0%} |")
    rows.append(f"| full recipe / plain Lightning, tokens/s | {o['c/b']:.3f} (95 % CI {o['low']:.3f} .. "
                f"{o['high']:.3f}: {o['verdict']}) | >= {GOAL_RECIPE_RATIO} |")
    st = figures["step_timing"]
    rows.append(f"| StepTiming ({st['clock']}) / wall clock, summed over the window | {st['ratio']:.3f} | "
                f"1 +- {TIMING_TOLERANCE:.0%} |")
    pinned = "pinned device-to-host copy" if c["floor_pinned"] else "host copy into a preallocated buffer"
    size = f"{c['bytes'] / 1e6:,.{0 if gpu else 2}f} MB"
    rows.append(f"| async checkpoint stall per save ({size}: weights + AdamW state) vs "
                f"{pinned} | {c['async_blocked_s'] * 1e3:.1f} ms vs {c['floor_copy_s'] * 1e3:.1f} ms = "
                f"{c['async_over_floor']:.2f}x (first save, which allocates the buffer: "
                f"{c['async_first_s'] * 1e3:.1f} ms) | <= {GOAL_STALL_OVER_FLOOR}x |")
    rows.append(f"| sync checkpoint save (AtomicCheckpointIO) | {c['sync_s'] * 1e3:.1f} ms; async = "
                f"{c['async_over_sync']:.1%} of it | |")
    return "\n".join(rows) + "\n"


def main(args: argparse.Namespace, console: Any) -> int:
    """Run, write ``bench_gpu.json`` and ``bench_gpu.md`` under ``--out``, print the table (or the JSON)."""
    resolve(args)  # bad input before anything starts
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--out {args.out}: cannot create it ({err.strerror or err})") from None
    figures = bench_gpu(args, console)
    table = markdown(figures)
    (out / "bench_gpu.json").write_text(json.dumps(figures, indent=2, default=float) + "\n")
    (out / "bench_gpu.md").write_text(table)
    with contextlib.suppress(BrokenPipeError):
        print(json.dumps(figures, indent=2, default=float) if args.json else table)
    return 0
