"""callbacks.checkpoint_io.PublishGate: a checkpoint is published once training has logged its step, its record
carrying the points the tracking store has not confirmed; neither the step nor the writer waits for it."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
import torch

from callbacks.checkpoint_io import (
    METRICS_PENDING_KEY,
    AtomicCheckpointIO,
    BoundedAsyncCheckpointIO,
    MetricsNotDurable,
    PublishGate,
)
from callbacks.storage import ckpt_store


class Logger:
    """What a logger says at each publication: the points still unconfirmed, and a refusal if any."""

    def __init__(self, points: list | None = None, refused: BaseException | None = None) -> None:
        self.points, self.refused, self.asked = points or [], refused, 0

    def __call__(self) -> tuple[list, BaseException | None]:
        self.asked += 1
        return list(self.points), self.refused


def checkpoint(step: int) -> dict:
    return {"global_step": step, "epoch": 0, "state_dict": {"w": torch.full((4,), float(step))}}


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def pending(path: Path) -> list | None:
    record = ckpt_store.read_record(path)
    return None if record is None else record.extra.get(METRICS_PENDING_KEY, [])


def test_a_written_save_is_published_once_training_passed_its_step_with_the_unconfirmed_points(
        tmp_path: Path) -> None:
    logger = Logger(points=[["train/loss", 0.5, 19, 1000]])
    gate = PublishGate(logger)
    io = BoundedAsyncCheckpointIO(AtomicCheckpointIO(gate=gate))
    path = tmp_path / "step=00000020.ckpt"
    io.save_checkpoint(checkpoint(20), path)
    assert wait_for(path.exists)  # written by the writer...
    time.sleep(0.2)
    assert ckpt_store.read_record(path) is None and logger.asked == 0  # ...not published: step 20 not logged yet
    logger.points.append(["train/loss", 0.4, 20, 1010])  # step 20's own point, logged after its save
    gate.passed(20)  # the loop reached step 21's start
    assert wait_for(lambda: ckpt_store.read_record(path) is not None)
    assert pending(path) == [["train/loss", 0.5, 19, 1000], ["train/loss", 0.4, 20, 1010]]
    later = tmp_path / "step=00000025.ckpt"
    io.save_checkpoint(checkpoint(25), later)
    io.save_checkpoint(checkpoint(26), tmp_path / "step=00000026.ckpt")  # waits for 25's write, not its record
    assert ckpt_store.read_record(later) is None  # still held: training has not passed step 25's logging
    io.teardown()  # the training thread waits: what is left is published at once
    assert pending(later) is not None and pending(tmp_path / "step=00000026.ckpt") is not None


def test_with_uploads_the_next_save_waits_for_the_previous_publication(tmp_path: Path) -> None:
    """One save in flight at most, its upload included; a local run's records are not waited for (above)."""
    from callbacks.storage.remote_store import RemoteCheckpoints

    bucket = tmp_path / "bucket"
    bucket.mkdir()
    local = tmp_path / "local"
    gate = PublishGate(Logger())
    io = BoundedAsyncCheckpointIO(AtomicCheckpointIO(mirror=RemoteCheckpoints(f"file://{bucket}", local), gate=gate))
    first = local / "step=00000025.ckpt"
    io.save_checkpoint(checkpoint(25), first)
    io.save_checkpoint(checkpoint(26), local / "step=00000026.ckpt")  # waits for 25's publication and upload
    assert ckpt_store.read_record(first) is not None  # released: the training thread is past step 25's logging
    assert (bucket / "step=00000025.ckpt").exists()
    io.teardown()


def test_a_save_on_the_training_thread_is_published_at_once(tmp_path: Path) -> None:
    io = AtomicCheckpointIO(gate=PublishGate(Logger()))
    path = tmp_path / "step=00000005.ckpt"
    io.save_checkpoint(checkpoint(5), path)
    assert pending(path) == []  # published, nothing unconfirmed to carry


def test_what_a_save_replaces_goes_after_its_publication(tmp_path: Path) -> None:
    gate = PublishGate(Logger())
    io = BoundedAsyncCheckpointIO(AtomicCheckpointIO(gate=gate))
    old, new = tmp_path / "best-a.ckpt", tmp_path / "best-b.ckpt"
    io.save_checkpoint(checkpoint(1), old)
    gate.passed(1)
    io.drain()
    io.save_checkpoint(checkpoint(9), new)
    io.remove_checkpoint(old)
    assert wait_for(new.exists)
    time.sleep(0.2)
    assert old.exists()  # the successor is written but not published: the old one stays
    gate.finish()
    assert wait_for(lambda: not old.exists())
    assert ckpt_store.read_record(new) is not None


def test_a_refusing_store_stops_the_run_at_its_next_save_and_the_record_keeps_the_points(tmp_path: Path) -> None:
    refused = RuntimeError("write failed")
    refused.__cause__ = sqlite3.OperationalError("database or disk is full")
    gate = PublishGate(Logger(points=[["val/acc", 0.9, 9, 5]], refused=refused))
    io = BoundedAsyncCheckpointIO(AtomicCheckpointIO(gate=gate))
    path = tmp_path / "step=00000010.ckpt"
    io.save_checkpoint(checkpoint(10), path)
    gate.passed(10)
    assert wait_for(lambda: ckpt_store.read_record(path) is not None)
    assert pending(path) == [["val/acc", 0.9, 9, 5]]  # what the relaunch logs again
    with pytest.raises(MetricsNotDurable, match=r"through step 10 \(database or disk is full\)") as raised:
        io.save_checkpoint(checkpoint(11), tmp_path / "step=00000011.ckpt")
    assert raised.value.__cause__ is refused
    gate.finish()
    io.teardown()


def test_a_publication_that_fails_is_raised_when_the_training_thread_waits(tmp_path: Path, monkeypatch) -> None:
    gate = PublishGate(Logger())
    io = BoundedAsyncCheckpointIO(AtomicCheckpointIO(gate=gate))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_store, "write_record", full_disk)
    io.save_checkpoint(checkpoint(3), tmp_path / "step=00000003.ckpt")
    gate.finish()
    with pytest.raises(OSError, match="could not write the record"):
        io.teardown()
    assert not (tmp_path / "step=00000003.ckpt").exists()  # an unrecorded checkpoint is never left to be used


def test_the_wait_for_training_ends_after_its_timeout(tmp_path: Path) -> None:
    gate = PublishGate(Logger(), timeout_s=0.3)
    io = BoundedAsyncCheckpointIO(AtomicCheckpointIO(gate=gate))
    path = tmp_path / "step=00000002.ckpt"
    io.save_checkpoint(checkpoint(2), path)  # training never passes step 2 (no gate.passed)
    assert wait_for(lambda: ckpt_store.read_record(path) is not None, timeout=5)
    io.teardown()


def test_the_training_thread_never_waits_on_the_gates_lock_while_no_publication_waits() -> None:
    """``passed`` took the condition's lock at every step, behind the publisher whenever it held it."""
    import threading

    gate = PublishGate(Logger())
    with gate._cond:  # the publisher holds the lock (publishing a record, say)
        stepper = threading.Thread(target=lambda: [gate.passed(step) for step in range(1, 1001)], daemon=True)
        stepper.start()
        stepper.join(timeout=30)
        assert not stepper.is_alive()  # 1,000 steps went by without the lock
    # a publication waiting for step 1,005 is woken by the step that reaches it, not before
    done = threading.Event()
    publisher = threading.Thread(target=lambda: (gate._when_logged(seq=10, step=1005, publish=lambda points: None),
                                                 done.set()), daemon=True)
    gate._release_upto = 0  # no training-thread wait releases it: only the steps do
    publisher.start()
    assert wait_for(lambda: gate._waiting_for == 1005)
    gate.passed(1004)
    assert not done.wait(0.2)
    gate.passed(1005)
    assert done.wait(30) and gate._waiting_for is None
