"""Bad input: one clear error naming the bad value, exit code 2, and no MLflow run left RUNNING.

Refusals at start-up run in-process (``fit_in_process``: the CLI's code path without an interpreter start-up each);
the failure in the middle of a run is a real subprocess.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from recipes.classifier import ImageClassifier
from tests.conftest import CONFIGS, FAST, CliResult, free_port, run_fit, run_module, runs_of

DIGITS = ("--config", str(CONFIGS / "digits.yaml"), *FAST)


class ExplodingClassifier(ImageClassifier):
    """Fails at its third training step: a real bug in the middle of a run."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_step == 2:
            raise RuntimeError("boom at step 2")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(("args", "named"), [
    (("--trainer.no_such_key", "1"), "no_such_key"),
    (("--trainer.max_epochs", "many"), "many"),
    (("--trainer.strategy", "warp_drive"), "warp_drive"),
    (("--trainer.accelerator", "cpu", "--trainer.devices", "64"), "trainer.devices=64"),
    (("--data", "datamodules.vision.MNISTDataModule", "--data.init_args.root", "/no/such/folder",
      "--data.init_args.download", "false"), "/no/such/folder"),
    (("--spot.provider", "ibm"), "ibm"),
    (("--cost.instance", "p9.mega"), "p9.mega"),
    (("--cost.market", "spot", "--cost.instance", "p4d.24xlarge"), "p4d.24xlarge"),  # no spot price listed
    # checked where the class lives, at construction: the optimizer's own checks, the module's, the trainer's
    (("--model.init_args.optimizer.init_args.lr", "-1"), "Invalid learning rate: -1.0"),
    (("--model.init_args.optimizer.init_args.weight_decay", "-1"), "Invalid weight_decay value: -1.0"),
    (("--model.init_args.width", "0"), "ImageClassifier(width=0)"),
    (("--model.init_args.in_channels", "0"), "ImageClassifier(in_channels=0)"),
    (("--trainer.val_check_interval", "0"), "trainer.val_check_interval=0"),
    (("--trainer.check_val_every_n_epoch", "0"), "trainer.check_val_every_n_epoch=0"),
    (("--trainer.accumulate_grad_batches", "0"), "trainer.accumulate_grad_batches=0"),
])
def test_bad_value_exits_2_naming_it(tmp_path: Path, args: tuple[str, ...], named: str,
                                     fit_in_process: Callable[..., CliResult]) -> None:
    result = fit_in_process(*DIGITS, *args)
    assert result.returncode == 2, result.stderr[-3000:]
    assert named in result.stderr
    assert "Traceback" not in result.stderr
    assert runs_of(tmp_path, "digits") == []  # nothing started
    assert nothing_written(tmp_path)


def nothing_written(workdir: Path) -> bool:
    """No run directory, lock file, config or manifest was left under ``workdir/runs``."""
    left = sorted(str(p.relative_to(workdir)) for p in (workdir / "runs").rglob("*")) if (workdir / "runs").exists() \
        else []
    assert left == [], left
    return True


@pytest.mark.parametrize(("first", "fixed"), [
    (("--model.init_args.optimizer.init_args.lr", "-1"), ()),
    (("--trainer.val_check_interval", "0"), ()),
    (("--model.init_args.width", "0"), ()),
    (("--model.init_args.width", "0"), ("--fresh", "true")),
])
def test_a_refused_first_launch_never_blocks_the_corrected_one(tmp_path: Path, first: tuple[str, ...],
                                                               fixed: tuple[str, ...],
                                                               fit_in_process: Callable[..., CliResult]) -> None:
    args = (*DIGITS, "--run_name", "a6", "--trainer.max_steps", "3", "--trainer.limit_val_batches", "1",
            "--log_model", "false")
    assert fit_in_process(*args, *first).returncode == 2
    corrected = fit_in_process(*args, *fixed)
    assert corrected.returncode == 0, corrected.stderr[-3000:]
    assert [r.info.status for r in runs_of(tmp_path, "digits")] == ["FINISHED"]


def test_a_first_launch_that_failed_before_any_checkpoint_never_blocks_a_changed_relaunch(tmp_path: Path) -> None:
    """A first launch that failed mid-run (a bug, a bad value no check caught) left a FAILED MLflow run and no
    checkpoint: there is no training state a changed config could be ignored by, so the relaunch starts, in a new
    MLflow run (the failed one keeps its own params)."""
    args = (*DIGITS, "--run_name", "a6", "--trainer.max_steps", "3", "--trainer.limit_val_batches", "1",
            "--log_model", "false")
    failed = run_fit(tmp_path, *args, "--model", "tests.e2e.test_bad_input.ExplodingClassifier",
                     "--model.init_args.optimizer.init_args.lr", "0.5")
    assert failed.returncode == 1 and "boom at step 2" in failed.stderr
    assert not list((tmp_path / "runs/digits/a6/checkpoints").glob("step=*"))
    corrected = run_fit(tmp_path, *args)
    assert corrected.returncode == 0, corrected.stderr[-3000:]
    assert "resuming would keep the checkpoint's training state" not in corrected.stderr
    runs = sorted(runs_of(tmp_path, "digits"), key=lambda r: r.info.start_time)
    assert [r.info.status for r in runs] == ["FAILED", "FINISHED"]
    assert runs[1].data.params["model.init_args.optimizer.init_args.lr"] == "0.003"


@pytest.mark.parametrize(("uri", "named"), [
    ("bogus://x", "bogus://x"),
    ("file:///proc/nope", "file:///proc/nope"),
    ("sqlite:////nonexistent/dir/x.db", "/nonexistent/dir"),
])
def test_a_tracking_store_that_cannot_be_used_exits_2_naming_it(tmp_path: Path, uri: str, named: str,
                                                                fit_in_process: Callable[..., CliResult]) -> None:
    result = fit_in_process(*DIGITS, MLFLOW_TRACKING_URI=uri)
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and named in line
    assert not Path("/nonexistent").exists()  # the store's folder is not made up
    assert nothing_written(tmp_path)


def test_unreachable_tracking_server_exits_2_naming_it(fit_in_process: Callable[..., CliResult]) -> None:
    uri = f"http://127.0.0.1:{free_port()}"
    result = fit_in_process(*DIGITS, MLFLOW_TRACKING_URI=uri)
    assert result.returncode == 2
    assert f"MLflow tracking server {uri} is unreachable" in result.stderr
    assert "Traceback" not in result.stderr


def test_failure_mid_run_marks_the_mlflow_run_failed(tmp_path: Path) -> None:
    result = run_fit(tmp_path, *DIGITS, "--model", "tests.e2e.test_bad_input.ExplodingClassifier")
    assert result.returncode == 1
    assert "boom at step 2" in result.stderr  # a real bug keeps its traceback
    (run,) = runs_of(tmp_path, "digits")
    assert run.info.status == "FAILED"


# ------------------------------------------------------------------------------------ every other tool
def lightning_checkpoint(path: Path, module: torch.nn.Module) -> Path:
    """A checkpoint file as Lightning writes one: the weights and the module's hyperparameters."""
    import lightning

    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                "pytorch-lightning_version": lightning.__version__, "global_step": 0, "epoch": 0}, path)
    return path


def classifier_dcp_checkpoint(path: Path) -> Path:
    """A distributed checkpoint of the digits classifier, laid out as our FSDP run writes one (shards, meta.pt)."""
    import torch.distributed.checkpoint as dcp

    model = ImageClassifier(width=4)
    dcp.save({"state_dict": model.state_dict()}, checkpoint_id=path, no_dist=True)
    torch.save({"hyper_parameters": dict(model.hparams), "global_step": 0, "epoch": 0}, path / "meta.pt")
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny GPT's checkpoint (what recipes.sample takes) and two it does not: a digits file and an FSDP folder."""
    from recipes.gpt import GPT
    from tests.conftest import TINY_GPT

    folder = tmp_path_factory.mktemp("checkpoints")
    return {"gpt": lightning_checkpoint(folder / "gpt.ckpt", GPT(**TINY_GPT)),
            "digits-ckpt": lightning_checkpoint(folder / "digits.ckpt", ImageClassifier(width=4)),
            "digits-fsdp": classifier_dcp_checkpoint(folder / "digits-fsdp")}


def sweep_args(workdir: Path) -> list[str]:
    space = workdir / "space.yaml"
    space.write_text('{"model.init_args.optimizer.init_args.lr": {"type": "float", "low": 0.001, "high": 0.1}}')
    return ["--config", str(CONFIGS / "digits.yaml"), "--space", str(space), "--trials", "2", "--name", "s"]


#: ``(module, arguments, the value the one line must name)``; ``{gpt}``-style items are the checkpoints above,
#: ``{sweep}`` a sweep's required arguments, ``{digits}`` the digits config, ``{csv}`` measurements to fit,
#: ``{escape}`` a name that leads out of the runs root.
TOOL_BAD_VALUES = [
    ("recipes.plan", ["--step-time", "3", "--steps", "10000", "--serial-fraction", "0.05", "--instance",
                      "a3-highgpu-1g", "--plot", "/nonexistent/dir/p.png"], "/nonexistent/dir/p.png"),
    ("recipes.plan", ["batch", "--b-noise", "1000", "--s-min", "100", "--step-times", "32:0.01,64:0.015", "--plot",
                      "/nonexistent/dir/p.png"], "/nonexistent/dir/p.png"),
    ("recipes.compare", ["--experiment", "digits", "--plot", "/nonexistent/dir/p.png"], "/nonexistent/dir/p.png"),
    ("recipes.promote", ["--experiment", "digits", "--name", "../x;rm"], "../x;rm"),
    ("recipes.promote", ["--experiment", "digits", "--alias", "a b/../c"], "a b/../c"),
    ("recipes.sample", ["--ckpt", "{gpt}", "--temperature", "nan"], "--temperature: 'nan'"),
    ("recipes.sample", ["--ckpt", "{gpt}", "--temperature", "inf"], "--temperature: 'inf'"),
    ("recipes.sample", ["--ckpt", "{gpt}", "--device", "bogus"], "--device bogus"),
    pytest.param("recipes.sample", ["--ckpt", "{gpt}", "--device", "cuda"], "--device cuda",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
    ("recipes.sample", ["--ckpt", "{gpt}", "--max-new-bytes", "1000000000000"], "--max-new-bytes 1000000000000"),
    ("recipes.sample", ["--ckpt", "{gpt}", "--prompt", os.fsdecode(b"def \xff\xfe")], "--prompt"),
    ("recipes.sample", ["--ckpt", "{digits-ckpt}"], "digits.ckpt"),
    ("recipes.sample", ["--ckpt", "{digits-fsdp}"], "digits-fsdp"),
    ("recipes.scale", ["--config", "{digits}", "--out", "/proc/x"], "/proc/x"),
    ("recipes.scale", ["--config", "{digits}", "--runs_root", "/proc/self"], "/proc/self"),
    ("recipes.scale", ["--config", "{digits}", "--experiment", "{escape}"], "../../"),  # out of the runs root
    ("recipes.scale", ["--from-csv", "{csv}", "--experiment", "../x"], "../x"),
    ("recipes.bench", ["checkpoint", "--out", "/proc/x"], "/proc/x"),
    ("recipes.sweep", ["{sweep}", "--stale-after", "-5"], "--stale-after -5"),
    ("recipes.sweep", ["{sweep}", "--stale-after", "nan"], "--stale-after: 'nan'"),
]


@pytest.mark.parametrize(("module", "args", "named"), TOOL_BAD_VALUES,
                         ids=lambda v: v.split(".")[-1] if isinstance(v, str) and v.startswith("recipes.") else
                         " ".join(v)[-40:] if isinstance(v, list) else "")
def test_every_tool_refuses_a_bad_value_in_one_line(tmp_path: Path, module: str, args: list[str], named: str,
                                                    checkpoints: dict[str, Path]) -> None:
    csv = tmp_path / "points.csv"
    csv.write_text("devices,throughput\n1,100\n2,190\n")
    escape = tmp_path.parent / f"{tmp_path.name}-escaped"  # runs/../../<this> from the working directory
    places = {**{f"{{{k}}}": str(v) for k, v in checkpoints.items()}, "{digits}": str(CONFIGS / "digits.yaml"),
              "{csv}": str(csv), "{escape}": f"../../{escape.name}"}
    argv = [item for arg in args for item in (sweep_args(tmp_path) if arg == "{sweep}" else [places.get(arg, arg)])]
    result = run_module(module, *argv, cwd=tmp_path, timeout=120)
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-3000:])
    assert "Traceback" not in result.stderr
    assert result.stdout == ""  # refused before any table was printed
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("error: ") and named in line, line
    assert nothing_written(tmp_path)
    assert not Path("/nonexistent").exists() and not escape.exists()
    assert runs_of(tmp_path, "digits") == [] and runs_of(tmp_path, "scale") == []


# ------------------------------------------------------------------------------------------- secrets
#: A password holding '@': urllib3 and requests split userinfo from host at the LAST '@', so all of MetaB@PWtail88
#: is the secret; each part is looked for apart.
METADATA_URL = "http://bob:MetaB@PWtail88@127.0.0.1:9/"
SECRET_PARTS = ("MetaB", "PWtail88")


@pytest.fixture(scope="module")
def run_with_a_secret(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CliResult]:
    """A short digits run whose spot metadata URL carries a password with an '@' in it."""
    workdir = tmp_path_factory.mktemp("secret")
    result = run_fit(workdir, *DIGITS, "--run_name", "sec", "--trainer.max_steps", "3", "--trainer.limit_val_batches",
                     "1", "--log_model", "false", "--spot.provider", "aws", "--spot.metadata_url", METADATA_URL)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir, result


def test_a_password_with_an_at_is_stored_nowhere(run_with_a_secret: tuple[Path, CliResult]) -> None:
    workdir, _ = run_with_a_secret
    run_dir = workdir / "runs/digits/sec"
    (run,) = runs_of(workdir, "digits")
    stored = {"config.yaml": (run_dir / "config.yaml").read_text(),
              "manifest.json": (run_dir / "manifest.json").read_text(),
              "params": repr(run.data.params), "tags": repr(run.data.tags)}
    assert "http://bob:***@127.0.0.1:9/" in stored["config.yaml"]
    leaks = [(where, part) for where, text in stored.items() for part in SECRET_PARTS if part in text]
    assert leaks == []


def test_a_password_with_an_at_is_printed_nowhere(run_with_a_secret: tuple[Path, CliResult]) -> None:
    _, result = run_with_a_secret
    assert [part for part in SECRET_PARTS if part in result.stdout + result.stderr] == []


def test_reproduce_never_prints_the_credentials_of_its_arguments(run_with_a_secret: tuple[Path, CliResult]) -> None:
    """``sys.argv`` is redacted once parsed: LightningCLI, parsing the record in this process, warned with it whole."""
    workdir, _ = run_with_a_secret
    (run,) = runs_of(workdir, "digits")
    result = run_module("recipes.reproduce", run.info.run_id, "--runs_root", "s3://AKIA:secretpw@b/r", "--dry_run",
                        cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "secretpw" not in result.stdout + result.stderr


# ------------------------------------------------------------------- every numeric option of every tool
def tool_parsers() -> dict[str, tuple[argparse.ArgumentParser, list[str]]]:
    """Each tool's parser (the one every tool but fit shares, ``recipes.run.common.ArgumentParser``) and arguments
    that make the rest of its command valid, so that a refusal is the hostile option's: ``{name}`` items are
    filled in by the test (a GPT checkpoint, a CSV of measurements, a sweep's space)."""
    from recipes import compare, plan, promote, reproduce, sample, scale, sweep
    from recipes.bench import subcommands as bench

    tools = {
        "recipes.compare": (compare.build_parser(), ["--experiment", "digits"]),
        "recipes.promote": (promote.build_parser(), ["--experiment", "digits"]),
        "recipes.reproduce": (reproduce.build_parser(), ["0" * 32]),
        "recipes.sample": (sample.build_parser(), ["--ckpt", "{gpt}", "--max-new-bytes", "4"]),
        "recipes.plan": (plan._parser(), ["--step-time", "3", "--steps", "100", "--serial-fraction", "0.05",
                                          "--instance", "a3-highgpu-1g"]),
        "recipes.plan batch": (plan._batch_parser(), ["--b-noise", "1000", "--ref-steps", "100", "--ref-batch", "32",
                                                      "--step-times", "32:0.01", "--params", "1e6",
                                                      "--bandwidth-gbps", "100"]),
        "recipes.scale": (scale.build_parser(), ["--from-csv", "{csv}", "--no-mlflow"]),
        "recipes.sweep": (sweep.build_parser(), ["{sweep}"]),
    }
    subcommands = next(a for a in bench.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in subcommands.choices.items():
        tools[f"recipes.bench {name}"] = (parser, [])
    return tools


#: Hostile values of each type: below every lower bound the tools have, and the floats no bound catches.
HOSTILE = {int: ["-1"], float: ["-1", "nan", "inf"]}
#: Options for which a hostile value is a value (the command then does its work, here a cheap one: run, exit 0).
ACCEPTED = {("recipes.sample", "--seed", "-1"): "any 64-bit seed"}
def hostile_cases() -> list:
    cases = []
    for tool, (parser, base) in tool_parsers().items():
        for action in parser._actions:
            for value in HOSTILE.get(action.type, []) if action.option_strings else []:
                key = (tool, action.option_strings[0], value)
                cases.append(pytest.param(*key, base, id=" ".join(key)))
    return cases


@pytest.mark.parametrize(("tool", "option", "value", "base"), hostile_cases())
def test_every_numeric_option_of_every_tool_refuses_a_hostile_value(tmp_path: Path, tool: str, option: str,
                                                                    value: str, base: list[str],
                                                                    checkpoints: dict[str, Path]) -> None:
    """The walk over every option the tools' parser holds: a new numeric option without a check fails here."""
    csv = tmp_path / "points.csv"
    csv.write_text("devices,throughput\n1,100\n2,190\n")
    places = {"{gpt}": str(checkpoints["gpt"]), "{csv}": str(csv)}
    argv = [item for arg in base for item in (sweep_args(tmp_path) if arg == "{sweep}" else [places.get(arg, arg)])]
    module, *subcommand = tool.split()
    result = run_module(module, *subcommand, *argv, option, value, cwd=tmp_path, timeout=120)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    if (tool, option, value) in ACCEPTED:
        assert result.returncode == 0, result.stderr[-3000:]
        return
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-3000:])
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("error: ") and (option in line or value in line), line
    assert nothing_written(tmp_path)
