"""The byte-level GPT recipe: formulas by hand and a tiny model on one device, in process
(the CLI under DDP and FSDP: tests/e2e/test_gpt_cli.py).
"""

from __future__ import annotations

import importlib
import itertools
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch.callbacks import throughput_monitor

from callbacks.lm_baselines import LMBaselines
from callbacks.throughput import TokenThroughput, dense_peak_tflops
from datamodules.text import TextDataModule, default_root
from recipes import sample
from recipes.gpt import GPT, bits_per_byte, lr_factor
from tests.conftest import RecordingLogger

REPO = Path(__file__).resolve().parents[3]
TINY = {"block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32}
BATCH = 8


# ----------------------------------------------------------------- formulas
def test_bits_per_byte_is_nats_over_ln2() -> None:
    assert bits_per_byte(3 * math.log(2)) == 3.0
    assert bits_per_byte(math.log(256)) == 8.0  # a uniform guess over bytes
    assert float(bits_per_byte(torch.tensor(3 * math.log(2)))) == 3.0


def test_palm_flops_by_hand() -> None:
    model = GPT(**TINY)
    # per block: 2 LayerNorms 4*32, qkv 32*96, proj 32*32, MLP 32*128 + 128*32 = 12,416; two blocks 24,832;
    # tied embedding/head 256*32 = 8,192; final LayerNorm 64; position embedding 32*32 = 1,024 (left out)
    assert model.num_params(exclude_position_embedding=False) == 34_112
    assert model.num_params() == 33_088
    # 6 N + 12 L H Q T = 6 * 33,088 + 12 * 2 * 32 * 32 = 198,528 + 24,576
    assert model.flops_per_token(32) == 223_104
    assert model.flops_per_token(32, training=False) == 74_368  # 2 N + 4 L H Q T
    # torch's FLOP counter counts the matmuls only: the same formula without the 320 LayerNorm parameters
    with torch.device("meta"):
        meta = GPT(**TINY)
        idx = torch.zeros(1, 32, dtype=torch.long)
    counted = measure_flops(meta, lambda: meta(idx), lambda out: out.sum())
    assert counted == 6 * (33_088 - 320) * 32 + 12 * 2 * 32 * 32 * 32 == 7_077_888


def test_lr_warmup_then_cosine() -> None:
    factors = [lr_factor(step, warmup_steps=10, decay_steps=110, min_ratio=0.1) for step in (0, 4, 9, 10, 60, 110, 500)]
    assert factors == pytest.approx([0.1, 0.5, 1.0, 1.0, 0.55, 0.1, 0.1], abs=1e-12)


def test_dense_peak_table() -> None:
    assert dense_peak_tflops("NVIDIA H200") == 989.0
    assert dense_peak_tflops("NVIDIA H200 NVL") == 835.0
    assert dense_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert dense_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert dense_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert dense_peak_tflops("NVIDIA L4") == 121.0
    assert dense_peak_tflops("NVIDIA L40") is None and dense_peak_tflops("Tesla T4") is None


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match=r"GPT\(n_head=5\) must divide n_embd=32"):
        GPT(n_head=5, n_embd=32)


def test_tied_embedding_stays_one_parameter_after_fully_shard(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = GPT(**TINY)
        model._device_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
        model.configure_model()
        net = model.transformer
        assert net.lm_head.weight is net.wte.weight and isinstance(net.wte.weight, DTensor)
        assert len(list(net.parameters())) == 2 + 2 * 8 + 2  # wte(=head), wpe; 8 a block; ln_f weight and bias
        logits = model(torch.randint(0, 256, (2, 32)))
        logits.sum().backward()
        assert net.wte.weight.grad is not None and logits.shape == (2, 32, 256)
    finally:
        torch.distributed.destroy_process_group()


def _build(spec: dict[str, Any], **overrides: Any) -> Any:
    module, _, name = spec["class_path"].rpartition(".")
    args = {k: v for k, v in (spec.get("init_args") or {}).items() if k != "optimizer"}
    return getattr(importlib.import_module(module), name)(**{**args, **overrides})


@pytest.mark.parametrize(("config", "params", "block"),
                         [("gpt.yaml", 821_504, 128), ("gpt-124m.yaml", 85_169_664, 1024)])
def test_shipped_configs_build(config: str, params: int, block: int) -> None:
    cfg = yaml.safe_load((REPO / "configs" / config).read_text())
    assert cfg["checkpoint"] == {"monitor": "val/loss", "mode": "min"}
    assert cfg["model"]["init_args"]["block_size"] == cfg["data"]["init_args"]["block_size"] == block
    assert cfg["model"]["init_args"]["optimizer"]["class_path"] == "torch.optim.AdamW"
    with torch.device("meta"):
        model = _build(cfg["model"])
    assert model.num_params() == params
    data = _build(cfg["data"])
    assert (data.block_size, data.root.name) == (block, default_root().name)
    kinds = sorted(type(_build(spec)).__name__ for spec in cfg["trainer"]["callbacks"])
    assert kinds == ["LMBaselines", "TokenThroughput"]


# -------------------------------------------------------- one device, in process
def tiny_datamodule(cache_dir: Path) -> TextDataModule:
    return TextDataModule(block_size=32, batch_size=BATCH, max_bytes=60_000, val_windows=16,
                          cache_dir=str(cache_dir))


def fit_tiny(tmp: Path, steps: int, throughput: TokenThroughput) -> SimpleNamespace:
    pl.seed_everything(0)
    dm = tiny_datamodule(tmp / "cache")
    model = GPT(**TINY, warmup_steps=2,
                optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1))
    logger, baselines = RecordingLogger(), LMBaselines()
    trainer = pl.Trainer(max_steps=steps, val_check_interval=steps, log_every_n_steps=1, num_sanity_val_steps=0,
                         logger=logger, callbacks=[throughput, baselines], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         gradient_clip_val=1.0, accelerator="cpu", devices=1)
    with pytest.MonkeyPatch.context() as patch:  # every ThroughputMonitor clock reading is 1 s after the last
        clock = itertools.count(0.0, 1.0)
        patch.setattr(throughput_monitor, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
        trainer.fit(model, datamodule=dm)
    return SimpleNamespace(trainer=trainer, model=model, dm=dm, logger=logger, baselines=baselines,
                           throughput=throughput)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    tmp = tmp_path_factory.mktemp("tiny")
    flops_per_batch = 223_104 * BATCH
    run = fit_tiny(tmp, 40, TokenThroughput(peak_tflops=2 * flops_per_batch / 1e12, window_size=2))
    run.ckpt = tmp / "tiny.ckpt"
    run.trainer.save_checkpoint(run.ckpt)
    run.tmp = tmp
    return run


def test_one_device_training_learns(tiny: SimpleNamespace) -> None:
    losses = [value for _, value in tiny.logger.values("train/loss")]
    assert len(losses) == 40
    # near-uniform at initialisation (ln 256; the tied head slightly favours repeating the input byte)
    assert losses[0] == pytest.approx(math.log(256), abs=0.2)
    unigram_nats = tiny.baselines.results["baseline/unigram_bpb"] * math.log(2)
    assert sum(losses[-5:]) / 5 < unigram_nats  # it learned more than byte frequencies in 40 steps
    metrics = tiny.trainer.callback_metrics
    assert float(metrics["val/bpb"]) == pytest.approx(float(metrics["val/loss"]) / math.log(2), rel=1e-6)


def test_throughput_and_mfu_are_exact_with_a_fake_clock(tiny: SimpleNamespace) -> None:
    assert tiny.model.flops_per_batch is not None
    last = tiny.throughput.last
    assert last["train/device/tokens_per_sec"] == BATCH * 32  # one batch of 8 x 32 tokens per fake second
    assert last["train/device/flops_per_sec"] == 223_104 * BATCH
    assert last["train/device/mfu"] == pytest.approx(0.5, rel=1e-9)
    assert tiny.throughput.summary_rows({})[0] == ("tokens/s", "256 (per device 256)")
    assert tiny.throughput.summary_rows({})[1][1].startswith("50.0% of ")


def test_baselines_are_logged_and_summarised(tiny: SimpleNamespace) -> None:
    expected = tiny.dm.baseline_bits_per_byte()
    logged = dict(tiny.logger.calls[0][1]) if tiny.logger.calls[0][0] == 0 else {}
    assert logged == {"baseline/unigram_bpb": expected["unigram"], "baseline/bigram_bpb": expected["bigram"]}
    assert 3.0 < expected["bigram"] < expected["unigram"] < 8.0
    rows = tiny.baselines.summary_rows({"val/bpb": 4.0})
    assert rows[1] == ("baseline/bigram_bpb", f"{expected['bigram']:.4f}  (model {4.0 - expected['bigram']:+.4f})")


def test_mfu_unavailable_on_cpu_without_a_peak(tmp_path: Path) -> None:
    run = fit_tiny(tmp_path, 3, TokenThroughput(window_size=2))
    assert run.throughput.available_flops is None
    assert "train/device/mfu" not in run.trainer.logged_metrics
    assert run.throughput.last["train/device/tokens_per_sec"] == BATCH * 32
    assert run.throughput.summary_rows({})[1] == (
        "MFU", "unavailable: no peak FLOP/s known for cpu (set the TokenThroughput callback's peak_tflops)")


# ------------------------------------------------------------------- sampling
@pytest.mark.e2e
@pytest.mark.slow(covered_by="tests/e2e/test_readme_commands.py::test_readme_command")  # its `recipes.sample` line
def test_sample_prints_the_requested_bytes(tiny: SimpleNamespace) -> None:
    out = subprocess.run([sys.executable, "-m", "recipes.sample", "--ckpt", str(tiny.ckpt), "--prompt", "def ",
                          "--max-new-bytes", "25", "--seed", "3"], capture_output=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert len(out.stdout) == len(b"def ") + 25 + 1 and out.stdout.startswith(b"def ")
    model = sample.load_gpt(tiny.ckpt)
    expected = model.generate(torch.tensor([list(b"def ")]), 25, temperature=0.8, top_k=50,
                              generator=torch.Generator().manual_seed(3))
    assert out.stdout == bytes(expected[0].tolist()) + b"\n"


def test_sample_missing_checkpoint_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert sample.main(["--ckpt", str(tmp_path / "missing.ckpt")]) == 2
    assert capsys.readouterr().err == f"error: --ckpt {tmp_path / 'missing.ckpt'} does not exist.\n"
