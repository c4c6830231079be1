"""The soak's streamed-data faults (recipes/soak/dataset.py): which chunk is damaged, what a launch that met damaged
or replaced data must have printed, and how the soak's loop would catch a requeue into the same damage.

The digits set as ``recipes.prepare digits --chunk_items 64`` writes it has 1,437 training items: 22 chunks of 64 and
one of 29. The e2e soak of these kinds (``tests/e2e/test_chaos.py::test_soak_of_damaged_and_replaced_data``) damages
chunk 18 and its launch stops after 38 steps, as computed here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest
from rich.console import Console

from recipes.soak.dataset import (
    Dataset,
    data_stop_line,
    first_step_with,
    judge_damaged,
    judge_replaced,
    last_read_chunk,
    samples_per_pass,
)
from recipes.soak.faults import DATA_KINDS, INVARIANTS, KINDS, Fault, plan_faults
from recipes.soak.launch import Launch
from recipes.soak.soak import Soak

REPO = Path(__file__).resolve().parents[3]
SIZES = [64] * 22 + [29]
URL = "/soak/data/digits"
DAMAGED = (f"atscale: the streamed data at {URL}/train is damaged: chunk-0-18.bin: SHA-256 3de98dde9ab4, not the "
           "prepared 66d158aa19e5; the run stopped (exit 65, no requeue): prepare the data again (python -m "
           "recipes.prepare ...), then relaunch.")
NOW, BEGAN = "3937fd72904c" + "0" * 52, "9ebd46e62f36" + "1" * 52
REPLACED = (f"atscale: the data at {URL} has index digest 3937fd72904c, not the 9ebd46e62f36 this run began with: "
            "it was prepared again since. Resuming would train on other data; start a new run (--fresh true or "
            "another --run_name), or put the original data back and relaunch.")


def test_the_data_kinds_and_their_invariants_are_known() -> None:
    assert DATA_KINDS == ("chunk_damaged", "dataset_replaced") and set(DATA_KINDS) <= set(KINDS)
    assert INVARIANTS[-2:] == ("prepared_data_only", "no_requeue_loop")
    # the e2e soak's plan (seed 2): the replacement first, in training; the damage in the next launch's start-up
    plan = plan_faults(2, DATA_KINDS, 2)
    assert [(p.kind, p.phase, p.explicit) for p in plan] == [("dataset_replaced", "training", True),
                                                             ("chunk_damaged", "startup", False)]
    mixed = plan_faults(8, ("sigterm", "chunk_damaged"), 3)
    assert {p.phase for p in mixed if p.kind == "chunk_damaged"} == {"startup"}


def test_the_damaged_chunk_is_the_one_the_run_reads_last() -> None:
    assert [samples_per_pass(1437, 32, 1), samples_per_pass(1437, 32, 2), samples_per_pass(1437, 32, 1, 4),
            samples_per_pass(1437, 32, 2, 4)] == [1437, 1437, 128, 256]
    assert last_read_chunk(SIZES, 4, 0, 1, 1437) == 18  # one epoch
    assert last_read_chunk(SIZES, 4, 0, 2, 1437) == 5  # two: the last item of pass 1's order
    assert last_read_chunk(SIZES, 4, 0, 1, 128) == 8  # --batches 4
    # one epoch: chunk 18's first item is in batch 38 of pass 0 (the last window); a launch resumed at 39 reads it
    # at 39 (it is read through the window), and none is left after the last step (44)
    assert [first_step_with(18, SIZES, 4, 0, 1, 1437, 32, start) for start in (0, 38, 39, 44, 45)] == [
        38, 38, 39, 44, None]
    # two epochs: chunk 5 is read in pass 0 too (step 30); resumed past its items there, in pass 1
    assert first_step_with(5, SIZES, 4, 0, 2, 1437, 32, 0) == 30
    assert first_step_with(5, SIZES, 4, 0, 2, 1437, 32, 45) >= 45


def test_a_damaged_launch_is_judged_by_its_exit_line_and_steps() -> None:
    name = "chunk-0-18.bin"
    assert judge_damaged(65, f"x\n{DAMAGED}\n", URL, name, 38, 38) == []
    assert judge_damaged(75, "atscale: the streamed data at x cannot be read\n", URL, name) == [
        ("no_requeue_loop", f"exited 75 on the damaged {name}: a scheduler requeues that code and every relaunch meets "
                            "the same bytes (atscale: the streamed data at x cannot be read)")]
    assert judge_damaged(0, "", URL, name, 45, 38) == [
        ("prepared_data_only", f"it completed step 45, past step 38 whose batch holds items of the damaged {name}")]
    assert judge_damaged(0, "", URL, name) == [
        ("prepared_data_only", f"exited 0: it trained to the end, over the damaged {name} it must read, without "
                               "stopping")]
    assert judge_damaged(1, "Traceback (most recent call last):\nValueError: bad chunk\n", URL, name) == [
        ("clean_exit", f"exited 1 on the damaged {name}, not 65 with one line naming it: ValueError: bad chunk")]
    other = DAMAGED.replace("chunk-0-18", "chunk-0-3")
    assert judge_damaged(65, f"{other}\n", URL, name) == [
        ("clean_exit", f"exit 65 without the one line naming {name} ('atscale: the streamed data at {URL}/train is "
                       f"damaged: {name}: SHA-256 '...): [{other!r}]")]


def test_a_refused_relaunch_on_replaced_data_is_judged_by_its_line_steps_and_run() -> None:
    assert judge_replaced(2, f"{REPLACED}\n", URL, NOW, BEGAN, None, ["KILLED"]) == []
    assert judge_replaced(0, "", URL, NOW, BEGAN, 37, ["FINISHED"]) == [
        ("prepared_data_only", "it trained 37 step(s) on the replacement (index digest 3937fd72904c, not "
                               "9ebd46e62f36)"),
        ("clean_exit", "the run's MLflow run(s) after the refusal: ['FINISHED'] (expected one, KILLED: stopped, "
                       "resumable once the data is back)")]
    assert judge_replaced(75, "x\n", URL, NOW, BEGAN, None, ["KILLED"]) == [
        ("no_requeue_loop", "exited 75 on the replaced data: a scheduler requeues that code into the same data (x)")]
    assert judge_replaced(2, "error: something else\n", URL, NOW, BEGAN, None, ["FAILED"]) == [
        ("clean_exit", f"exit 2 without the one line naming both digests ('atscale: the data at {URL} has index "
                       "digest 3937fd72904c, not the 9ebd46e62f36 this run began with: '...): []"),
        ("clean_exit", "the run's MLflow run(s) after the refusal: ['FAILED'] (expected one, KILLED: stopped, "
                       "resumable once the data is back)")]
    assert data_stop_line(f"a\n{REPLACED}\n") == REPLACED and data_stop_line(f"{DAMAGED}\n") == DAMAGED
    assert data_stop_line("atscale: the streamed data at x cannot be read (NoSuchKey) for 120 s\n") is None


def _prepared(folder: Path, seed: int) -> Path:
    """A two-chunk set in ``recipes.prepare``'s layout (hand-written: what the dataset's moves and digests read)."""
    files = {}
    for split in ("train", "val"):
        (folder / split).mkdir(parents=True)
        chunks = []
        for number in range(2):
            data = bytes((seed * 7 + number + i) % 251 for i in range(300))
            (folder / split / f"chunk-0-{number}.bin").write_bytes(data)
            files[f"{split}/chunk-0-{number}.bin"] = hashlib.sha256(data).hexdigest()
            chunks.append({"filename": f"chunk-0-{number}.bin", "chunk_size": 3})
        (folder / split / "index.json").write_text(json.dumps({"chunks": chunks, "config": {"data_format": ["int"]}}))
    (folder / "atscale.json").write_text(json.dumps({"complete": True, "kind": "images", "files": files,
                                                     "settings": {"split_seed": seed}}))
    return folder


def test_the_dataset_is_damaged_repaired_replaced_and_restored(tmp_path: Path) -> None:
    dataset = Dataset(REPO, tmp_path / "sources", tmp_path / "chain" / "data" / "digits")
    _prepared(dataset.prepared, 0)
    _prepared(dataset.other, 1)
    dataset.install()
    chunk = dataset.folder / "train" / "chunk-0-1.bin"
    prepared = chunk.read_bytes()
    assert dataset.chunks() == [("chunk-0-0.bin", 3), ("chunk-0-1.bin", 3)]
    assert dataset.damage("chunk-0-1.bin", 0.25) == {"mode": "flip", "size": 300, "flipped": 64}
    assert chunk.read_bytes() != prepared and len(chunk.read_bytes()) == 300
    dataset.repair("chunk-0-1.bin")
    assert chunk.read_bytes() == prepared and sorted(p.name for p in chunk.parent.iterdir()) == [
        "chunk-0-0.bin", "chunk-0-1.bin", "index.json"]
    now, began = dataset.replace()
    assert now != began and now == dataset.digest(dataset.other)
    assert json.loads((dataset.folder / "atscale.json").read_text())["settings"] == {"split_seed": 1}
    dataset.restore()
    assert json.loads((dataset.folder / "atscale.json").read_text())["settings"] == {"split_seed": 0}
    assert not dataset.aside.exists() and chunk.read_bytes() == prepared
    assert dataset.settings() == {"batch_size": 32, "shuffle_window": 4, "shuffle_seed": 0}


def _args(tmp_path: Path, kinds: tuple[str, ...]) -> argparse.Namespace:
    return argparse.Namespace(repo=str(REPO), workdir=str(tmp_path), tmpfs_mb=16, store="local", kinds=kinds,
                              ddp=False, epochs=1, batches=0, every=5, workers=2, launch_timeout=60.0)


def test_a_data_kind_makes_every_launch_stream(tmp_path: Path) -> None:
    soak = Soak(_args(tmp_path, ("sigterm", "chunk_damaged")), Console(quiet=True))
    assert soak.dataset is not None
    command = soak.command("r")
    assert command[command.index("--config") + 1] == str(REPO / "configs/digits-stream.yaml")
    assert command[command.index("--experiment") + 1] == "digits"
    assert command[command.index("--data.url") + 1] == str(tmp_path / "data" / "digits")
    reference = soak.command("reference")
    assert reference[reference.index("--data.url") + 1] == str(tmp_path / "data" / "prepared" / "digits")
    plain = Soak(_args(tmp_path, ("sigterm",)), Console(quiet=True)).command("r")
    assert plain[plain.index("--config") + 1] == str(REPO / "configs/digits.yaml") and "--data.url" not in plain


def test_a_relaunch_that_meets_the_damage_again_breaks_no_requeue_loop(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Were the soak to relaunch on exit 65 without putting the prepared bytes back, the next launch meets the same
    damage: the fault it relaunches after is blamed (and ``finished`` fails after three such launches)."""
    soak = Soak(_args(tmp_path, ("chunk_damaged",)), Console(quiet=True))
    run = soak.new_run()
    damaged = Fault(0, "chunk_damaged", run.name, "startup")
    soak.faults.append(damaged)
    soak.awaiting.append(damaged)
    err = tmp_path / "finish.err"
    err.write_text(f"Resuming from x (step 35).\n{DAMAGED}\n")
    relaunch = Launch("finish", run.name, [], 0.0, None, "", str(err), exit_code=65, decided=True, resumed_from=0)
    monkeypatch.setattr(soak, "observe", lambda name: None)
    soak.after_launch(relaunch, damaged)
    assert damaged.problems == [{"invariant": "no_requeue_loop", "detail": "finish met damaged or other data again "
                                 f"after the soak put the prepared data back (exit 65): {DAMAGED[:300]}"}]
    struck = Launch("chunk_damaged", run.name, [], 0.0, None, "", str(err), exit_code=65, decided=True,
                    resumed_from=0)
    damaged.problems.clear()
    soak.after_launch(struck, damaged)  # the fault's own launch: judged by judge_damaged, not here
    assert damaged.problems == []
