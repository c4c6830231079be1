"""No checkpoint the project reads may run code, and a full disk during a save says so and keeps the previous one.

Every attack here is a real pickle payload (an object whose ``__reduce__`` runs ``exec``) placed where an
attacker with write access to a run's checkpoint folder, or to the bucket it is mirrored to, would put it:

- in a distributed checkpoint's ``.metadata`` (read by torch's ``FileSystemReader`` with plain ``pickle.load``),
  edited in place with the same size, so a size-only record still matches;
- in a non-tensor item of a ``.distcp`` shard (read by torch's default load planner with ``weights_only=False``);
- as a forged newest ``.ckpt`` file whose record the attacker recomputed (size and SHA-256 match).

The test passes only if the payload's marker file never appears, the lookups fall back to the previous good
checkpoint with a warning naming the file, and ``recipes.sample`` refuses with one ``error:`` line.

These are the CLI's cases (``recipes.sample``, relaunches of ``recipes.fit``); the in-process ones (the safe
reader, the lookups, the bucket fetch, a full disk) are in tests/unit/callbacks/storage/test_untrusted_checkpoints.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from callbacks.storage import ckpt_store
from tests.conftest import (
    CONFIGS,
    FAST,
    TINY_GPT,
    Payload,
    cli_env,
    forge_file,
    gpt_dcp_checkpoint,
    run_fit,
    runs_of,
    shard_with_a_payload_item,
    tamper_metadata_same_size,
    tiny_gpt,
)

# dcp.save(..., no_dist=True) warns that it saves in one process, as asked
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# ------------------------------------------------------------------ sampling
def sample(ckpt: Path, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m recipes.sample`` on ``ckpt``; stdout is raw bytes, stderr text."""
    result = subprocess.run([sys.executable, "-m", "recipes.sample", "--ckpt", str(ckpt), "--max-new-bytes", "3"],
                            cwd=cwd, env=cli_env(cwd), capture_output=True, timeout=300)
    result.stderr = result.stderr.decode(errors="replace")
    return result


@pytest.mark.e2e
def test_sample_refuses_tampered_checkpoints_with_exit_2(tmp_path: Path, marker: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from recipes.sample import load_gpt, main

    good = gpt_dcp_checkpoint(tmp_path / "good")
    expected, _ = tiny_gpt(seed=0)
    loaded = load_gpt(good).state_dict()  # the safe reader loads a real one
    assert all(torch.equal(loaded[k], v) for k, v in expected.state_dict().items())

    tampered = gpt_dcp_checkpoint(tmp_path / "tampered")
    tamper_metadata_same_size(tampered, marker)
    result = sample(tampered, tmp_path)  # as a user runs it
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.splitlines() == [f"error: --ckpt {tampered} cannot be loaded safely: .metadata names "
                                          "builtins.exec, which is not an allowed global"]

    in_shard = gpt_dcp_checkpoint(tmp_path / "in-shard")  # a payload in an item a GPT does not even read
    for item in [*in_shard.glob("*.distcp"), in_shard / ".metadata"]:
        item.unlink()
    shard_with_a_payload_item(in_shard, marker)
    forged = tmp_path / "forged.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": TINY_GPT, "x": Payload(marker)}, forged)
    capsys.readouterr()
    for path in (in_shard, forged):
        assert main(["--ckpt", str(path)]) == 2
        captured = capsys.readouterr()
        (line,) = captured.err.splitlines()
        assert line.startswith(f"error: --ckpt {path} cannot be loaded safely: ") and "exec" in line, line
        assert captured.out == "" and not marker.exists()


# --------------------------------------------------------------- the real CLI
@pytest.mark.e2e
def test_relaunch_after_a_forged_newest_checkpoint_resumes_from_the_previous(tmp_path: Path, marker: Path) -> None:
    """Every checkpoint of the newest step (the spot one and the best one) forged: the run goes on from the
    one before."""
    args = ("--config", str(CONFIGS / "digits.yaml"), "--spot.every_n_steps", "10", "--log_model", "false",
            "--run_name", "forged", *FAST)
    run_fit(tmp_path, *args, "--trainer.max_epochs", "2", check=True)
    ckpt_dir = tmp_path / "runs/digits/forged/checkpoints"
    steps = {path: ckpt_store.read_record(path).global_step for path in ckpt_store.candidates(ckpt_dir)}
    newest_step = max(steps.values())
    forged = sorted(path for path, step in steps.items() if step == newest_step)
    previous = max((p for p in steps if steps[p] < newest_step and p.name.startswith("step=")), key=steps.get)
    assert len(forged) == 2 and previous.name == f"step={newest_step - 10:08d}.ckpt"
    for path in forged:
        forge_file(path, marker, "zip")
    result = run_fit(tmp_path, *args, "--trainer.max_epochs", "3")
    assert result.returncode == 0, result.stderr[-4000:]
    for path in forged:
        assert f"Checkpoint {path.relative_to(tmp_path)} cannot be loaded safely (" in result.stderr
    assert f"Resuming from {previous.relative_to(tmp_path)} (step {steps[previous]})" in result.stderr, \
        result.stderr[-4000:]
    (run,) = runs_of(tmp_path, "digits")
    assert run.info.run_name == "forged" and run.info.status == "FINISHED"


@pytest.mark.e2e
@pytest.mark.slow(covered_by="tests/unit/callbacks/storage/test_untrusted_checkpoints.py::"
                             "test_tampered_metadata_is_skipped_for_the_previous_directory")
def test_fsdp_relaunch_after_tampered_metadata_resumes_from_the_previous(tmp_path: Path, marker: Path) -> None:
    """FSDP (2 processes, gloo): ``.metadata`` of every newest checkpoint edited in place, same size; one of
    them under a record of older code (total size only), so the allow-list unpickler is what refuses it."""
    args = ("--config", str(CONFIGS / "digits.yaml"), "--config", str(CONFIGS / "strategy/fsdp.yaml"),
            "--spot.every_n_steps", "10", "--log_model", "false", "--run_name", "fsdp", *FAST)
    run_fit(tmp_path, *args, "--trainer.max_epochs", "1", check=True)
    ckpt_dir = tmp_path / "runs/digits/fsdp/checkpoints"
    steps = {path: ckpt_store.read_record(path).global_step for path in ckpt_store.candidates(ckpt_dir)}
    assert all(path.is_dir() for path in steps)
    tampered = sorted(path for path, step in steps.items() if step == max(steps.values()))
    previous = ckpt_dir / "step=00000020.ckpt"
    assert [p.name for p in tampered] == ["best-000-00000023.ckpt", "step=00000023.ckpt"] and previous in steps
    for path in tampered:
        tamper_metadata_same_size(path, marker)
    size_only = tampered[1]
    record = json.loads(ckpt_store.meta_path(size_only).read_text())
    del record["files"]
    ckpt_store.meta_path(size_only).write_text(json.dumps(record))

    result = run_fit(tmp_path, *args, "--trainer.max_epochs", "2")
    assert result.returncode == 0, result.stderr[-4000:]
    assert (f"Checkpoint {tampered[0].relative_to(tmp_path)} fails its SHA-256 check on .metadata (corrupt or "
            "changed); skipping it.") in result.stderr
    assert (f"Checkpoint {size_only.relative_to(tmp_path)} cannot be loaded safely (.metadata names builtins.exec, "
            "which is not an allowed global); skipping it.") in result.stderr
    assert f"Resuming from {previous.relative_to(tmp_path)} (step 20)" in result.stderr, result.stderr[-4000:]
    (run,) = runs_of(tmp_path, "digits")
    assert run.info.run_name == "fsdp" and run.info.status == "FINISHED"
