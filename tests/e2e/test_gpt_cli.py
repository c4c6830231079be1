"""The byte-level GPT recipe through the real CLI under DDP and FSDP (the model itself: tests/unit/recipes/test_gpt.py).

The CLI runs (2 processes each, gloo) share one temporary working directory, one corpus cache and
one MLflow store: DDP for 6 steps; FSDP for 3 steps, then relaunched with the same run name and
``max_steps`` 6. With the same seed the FSDP run's per-step ``train/loss`` and ``val/loss`` (read
back from MLflow) match DDP's within 1e-4 nats (float32; the two only reduce gradients in a
different order), before and after the resume.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pytest
import torch

from datamodules.text import TextDataModule
from recipes import sample
from recipes.bench import stats as bench_stats
from recipes.gpt import GPT
from tests.conftest import cli_env, run_fit, run_module

REPO = Path(__file__).resolve().parents[2]
LOSS_TOLERANCE = 1e-4  # nats, FSDP vs DDP per step
RUN_TIMEOUT_S = 500  # each of the module's three 2-process CLI runs
# The module fixture runs the slow part before the first test, each run under its own subprocess timeout
# (RUN_TIMEOUT_S); pytest-timeout times the test functions alone, so a slow machine does not fail the first test.
pytestmark = pytest.mark.timeout(600, func_only=True)


# ------------------------------------------------------- the CLI, DDP and FSDP
CLI_OVERRIDES = [
    "--trainer.max_steps", "6", "--trainer.log_every_n_steps", "1", "--trainer.val_check_interval", "2",
    "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
    "--trainer.enable_progress_bar", "false", "--async_checkpoint", "false",
    "--model.init_args.block_size", "32", "--model.init_args.n_layer", "2", "--model.init_args.n_head", "4",
    "--model.init_args.n_embd", "32", "--model.init_args.warmup_steps", "1",
    "--model.init_args.decay_steps", "6",  # the same LR schedule whatever max_steps a launch has
    "--data.init_args.block_size", "32", "--data.init_args.batch_size", "4", "--data.init_args.max_bytes", "60000",
    "--data.init_args.val_windows", "4",
]


def run_cli(cwd: Path, strategy: str, run_name: str, *extra: str) -> subprocess.CompletedProcess:
    # MLflow infers a logged model's pip requirements in a subprocess that re-imports everything (15-20 s on
    # 2 cores); after 1 s it falls back to its default list. The model is still logged; its list is not under test.
    env = cli_env(cwd, MLFLOW_REQUIREMENTS_INFERENCE_TIMEOUT="1")
    return run_fit(cwd, "--config", str(REPO / "configs/gpt.yaml"), "--config",
                   str(REPO / f"configs/strategy/{strategy}.yaml"), *CLI_OVERRIDES, "--run_name", run_name, *extra,
                   env=env, timeout=RUN_TIMEOUT_S, check=True)


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """DDP for 6 steps; FSDP for 3 steps, then relaunched with the same run name and max_steps 6."""
    cwd = tmp_path_factory.mktemp("cli")
    ddp = run_cli(cwd, "ddp", "ddp")
    first = run_cli(cwd, "fsdp", "fsdp", "--trainer.max_steps", "3")
    first_checkpoints = sorted(p.name for p in (cwd / "runs/gpt/fsdp/checkpoints").iterdir())
    resumed = run_cli(cwd, "fsdp", "fsdp")
    client = mlflow.MlflowClient(f"sqlite:///{cwd}/mlflow.db")
    found = client.search_runs([client.get_experiment_by_name("gpt").experiment_id])
    runs = {r.info.run_name: r for r in found}
    assert sorted(r.info.run_name for r in found) == ["ddp", "fsdp"]  # the relaunch continued "fsdp"
    return SimpleNamespace(cwd=cwd, ddp=ddp, first=first, resumed=resumed, client=client, runs=runs,
                           first_checkpoints=first_checkpoints)


def history(cli: SimpleNamespace, run_name: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in cli.client.get_metric_history(cli.runs[run_name].info.run_id, key))


def test_fsdp_and_ddp_losses_agree(cli: SimpleNamespace) -> None:
    for key, steps in (("train/loss", list(range(6))), ("val/loss", [1, 3, 5])):
        ddp, fsdp = history(cli, "ddp", key), history(cli, "fsdp", key)
        assert [s for s, _ in ddp] == [s for s, _ in fsdp] == steps
        for (step, a), (_, b) in zip(ddp, fsdp, strict=True):  # FSDP's steps 3-5 come after its resume
            assert abs(a - b) < LOSS_TOLERANCE, f"{key} at step {step}: DDP {a:.6f} vs FSDP {b:.6f}"
    losses = [v for _, v in history(cli, "ddp", "train/loss")]
    assert losses[0] == pytest.approx(math.log(256), abs=0.2) and losses[-1] < losses[0] - 0.2


def test_fsdp_checkpoint_is_a_directory_and_resumes_the_same_run(cli: SimpleNamespace) -> None:
    assert "step=00000003.ckpt" in cli.first_checkpoints
    shard_dir = cli.cwd / "runs/gpt/fsdp/checkpoints/step=00000006.ckpt"
    assert shard_dir.is_dir() and sorted(p.name for p in shard_dir.glob("*.distcp")) == ["__0_0.distcp",
                                                                                          "__1_0.distcp"]
    assert "Resuming from runs/gpt/fsdp/checkpoints/step=00000003.ckpt (step 3)" in cli.resumed.stderr
    assert cli.runs["fsdp"].info.status == "FINISHED"
    assert history(cli, "fsdp", "spot/lost_steps") == [(3, 0.0)]  # nothing redone: it went on from step 3


def test_cli_logs_bits_per_byte_and_baselines(cli: SimpleNamespace) -> None:
    metrics = cli.runs["ddp"].data.metrics
    assert metrics["val/bpb"] == pytest.approx(metrics["val/loss"] / math.log(2), rel=1e-6)
    dm = TextDataModule(block_size=32, max_bytes=60_000, val_windows=4, cache_dir=str(cli.cwd / "data/cache/text"))
    expected = dm.baseline_bits_per_byte()
    assert metrics["baseline/bigram_bpb"] == pytest.approx(expected["bigram"], rel=1e-12)
    assert metrics["baseline/unigram_bpb"] == pytest.approx(expected["unigram"], rel=1e-12)
    assert "baseline/bigram_bpb" in cli.ddp.stdout  # the end summary's rows


def _greedy_by_hand(model: torch.nn.Module, prompt: bytes, new_bytes: int) -> bytes:
    """Greedy decoding written out: the argmax of the last position's logits, one byte at a time."""
    idx = list(prompt)
    with torch.no_grad():
        for _ in range(new_bytes):
            logits = model(torch.tensor([idx[-model.hparams.block_size:]]))[0, -1]
            idx.append(int(logits.argmax()))
    return bytes(idx)


def test_sample_from_an_fsdp_checkpoint_directory(cli: SimpleNamespace,
                                                  capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    """At temperature 0 the FSDP directory's sample is the one-device (DDP file) checkpoint's greedy decoding."""
    ckpt = cli.cwd / "runs/gpt/fsdp/checkpoints/step=00000006.ckpt"
    assert sample.main(["--ckpt", str(ckpt), "--prompt", "import ", "--max-new-bytes", "12",
                        "--temperature", "0"]) == 0
    out = capsysbinary.readouterr().out
    ddp_file = cli.cwd / "runs/gpt/ddp/checkpoints/step=00000006.ckpt"
    assert ddp_file.is_file()
    one_device = GPT.load_from_checkpoint(ddp_file, map_location="cpu", weights_only=True).eval()
    expected = _greedy_by_hand(one_device, b"import ", 12)
    assert out == expected + b"\n", (out, expected)
    assert sample.main(["--ckpt", str(ddp_file), "--prompt", "import ", "--max-new-bytes", "12",
                        "--temperature", "0"]) == 0
    assert capsysbinary.readouterr().out == expected + b"\n"


# ------------------------------------------------------- its benchmark command
@pytest.mark.slow(covered_by="tests/unit/recipes/bench/test_bench_lm.py::test_every_variant_runs_in_every_place_equally_often")
def test_bench_lm_runs_each_variant_every_round_and_reports_their_ratios(tmp_path: Path) -> None:
    """``python -m recipes.bench lm``, tiny: the figures it reports follow from the runs it made (no speed
    figure is asserted: the lead measures on a quiet machine)."""
    result = run_module("recipes.bench", "lm", "--steps", "8", "--rounds", "2", "--max-rounds", "2", "--json",
                        "--out", str(tmp_path / "out"), cwd=tmp_path, timeout=500)
    assert result.returncode == 0, result.stderr[-5000:]
    figures = json.loads(result.stdout)
    assert figures["rounds_run"] == 2 and figures["tokens_per_step"] == 16 * 128  # configs/gpt.yaml's batch x block
    assert {v: len(r) for v, r in figures["runs"].items()} == {"torch": 2, "lightning": 2, "recipe": 2}
    recipe, plain = ([r[k] for r in figures["runs"][v]] for v, k in (("recipe", "step_s"), ("lightning", "step_s")))
    assert figures["step_ratio"] == pytest.approx(sum(recipe) / sum(plain))
    low, high = figures["step_ci95"]
    assert low <= figures["step_ratio"] <= high
    assert figures["step_verdict"] == bench_stats.verdict_at_most(low, high, 1.03)
    assert "Traceback" not in result.stderr
    # six fits in one process, the second round's after MLflow's model logging imported pytorch_lightning:
    # none of them prints Lightning's device lines or its logger advertisement
    for noise in ("GPU available", "`Trainer.fit` stopped", "💡 Tip", "INFO:"):
        assert noise not in result.stderr, noise
