"""Spot safety in one process: cloud notices over real HTTP on loopback, dead endpoints, write faults."""

from __future__ import annotations

import errno
import json
import logging
import multiprocessing
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from callbacks.checkpoint_io import AtomicCheckpointIO
from callbacks.spot import CHECKPOINT_PATTERN, SpotCheckpoint, rng_state, set_rng_state
from callbacks.storage import ckpt_store
from callbacks.utils import notices
from datamodules.digits import DigitsDataModule
from recipes.classifier import ImageClassifier
from tests.conftest import RecordingLogger, free_port

REPO = Path(__file__).resolve().parents[3]


class FakeMetadata(BaseHTTPRequestHandler):
    """Impersonates the AWS, GCP and Azure metadata services; raises a notice after ``flip_after`` polls."""

    polls = 0
    flip_after = 3
    bad_headers: list[str] = []

    def log_message(self, *args: object) -> None:  # keep test output quiet
        pass

    def _reply(self, status: int, body: bytes = b"") -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:
        if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            return self._reply(200, b"TOKEN")
        self._reply(400)

    def do_GET(self) -> None:
        cls = type(self)
        cls.polls += 1
        noticed = cls.polls > cls.flip_after
        if self.path == "/latest/meta-data/spot/instance-action":
            if self.headers.get("X-aws-ec2-metadata-token") != "TOKEN":
                cls.bad_headers.append(self.path)
                return self._reply(401)
            body = json.dumps({"action": "terminate", "time": "2026-11-30T12:00:00Z"}).encode()
            return self._reply(200, body) if noticed else self._reply(404)
        if self.path == "/computeMetadata/v1/instance/preempted":
            if self.headers.get("Metadata-Flavor") != "Google":
                cls.bad_headers.append(self.path)
                return self._reply(403)
            return self._reply(200, b"TRUE" if noticed else b"FALSE")
        if self.path == "/metadata/scheduledevents?api-version=2020-07-01":
            if self.headers.get("Metadata") != "true":
                cls.bad_headers.append(self.path)
                return self._reply(400)
            events = [{"EventId": "E1", "EventType": "Preempt", "NotBefore": "soon"}] if noticed else []
            return self._reply(200, json.dumps({"DocumentIncarnation": 1, "Events": events}).encode())
        self._reply(404)


@pytest.fixture
def metadata_server() -> Iterator[str]:
    FakeMetadata.polls, FakeMetadata.bad_headers = 0, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeMetadata)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _trainer(tmp_path: Path, spot: SpotCheckpoint, max_epochs: int = 30) -> pl.Trainer:
    return pl.Trainer(default_root_dir=tmp_path, max_epochs=max_epochs, callbacks=[spot],
                      plugins=[AtomicCheckpointIO()], logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1,
                      use_distributed_sampler=False)


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_each_cloud_notice_saves_and_stops(tmp_path: Path, metadata_server: str, provider: str) -> None:
    spot = SpotCheckpoint(provider=provider, metadata_url=metadata_server, poll_interval_s=0.01,
                          dirpath=str(tmp_path / "ckpt"))
    trainer = _trainer(tmp_path, spot)
    trainer.fit(ImageClassifier(), datamodule=DigitsDataModule())
    assert FakeMetadata.bad_headers == []
    assert spot.interrupted and spot.notice is not None and spot.notice.source == provider
    assert trainer.global_step < 30 * 45  # stopped early
    record = ckpt_store.newest_good(tmp_path / "ckpt", CHECKPOINT_PATTERN)
    assert record is not None and record.global_step == trainer.global_step
    assert spot.interruptions == 1


@pytest.mark.parametrize(("provider", "check"), [("aws", notices.check_aws), ("gcp", notices.check_gcp),
                                                  ("azure", notices.check_azure)])
def test_notice_checks_parse_each_provider(metadata_server: str, provider: str, check) -> None:
    FakeMetadata.flip_after = 1
    try:
        assert check(metadata_server) is None
        notice = check(metadata_server)
    finally:
        FakeMetadata.flip_after = 3
    assert notice is not None and notice.source == provider
    if provider == "aws":
        assert notice.detail == "terminate at 2026-11-30T12:00:00Z"


def test_hanging_endpoint_does_not_hold_up_training(tmp_path: Path) -> None:
    """A metadata service that never answers: training finishes while the first poll still hangs."""
    asked, release = threading.Event(), threading.Event()

    class Hanging(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.set()
            release.wait()  # no answer until the test is over, however long training takes
            self.send_response(503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hanging)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    spot = SpotCheckpoint(provider="gcp", metadata_url=f"http://127.0.0.1:{server.server_address[1]}",
                          metadata_timeout_s=120.0, dirpath=str(tmp_path / "ckpt"))
    seen: dict[str, int] = {}

    class PollerProbe(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            assert asked.wait(timeout=60)  # the first poll has reached the endpoint before the first step

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            assert spot._poller is not None
            seen.update(polls=spot._poller.polls, failures=spot._poller.failures)

    try:
        trainer = _trainer(tmp_path, spot, max_epochs=2)
        trainer.callbacks.append(PollerProbe())
        trainer.fit(ImageClassifier(), datamodule=DigitsDataModule())
    finally:
        release.set()
        server.shutdown()
        server.server_close()
    assert trainer.global_step == 2 * 23 and not spot.interrupted  # 1437 samples, batches of 64
    # every step ran while the one and only poll still waited for its answer
    assert seen == {"polls": 1, "failures": 0}


def test_unreachable_endpoint_warns_once_and_backs_off(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()  # closed once it returns: connection refused
    seen: list[notices.Notice] = []
    poller = notices.NoticePoller("aws", seen.append, f"http://127.0.0.1:{port}", interval_s=0.01,
                                  timeout_s=0.2, max_backoff_s=0.08)
    waits: list[float] = []
    original_wait = poller._stop.wait
    poller._stop.wait = lambda t: (waits.append(t), original_wait(0))[1]  # record waits, don't sleep
    with caplog.at_level(logging.WARNING, logger="callbacks.utils.notices"):
        poller.start()
        deadline = time.monotonic() + 10
        while poller.failures < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        poller.stop()
    assert seen == []
    assert poller.failures >= 6
    assert waits[:4] == [0.02, 0.04, 0.08, 0.08]  # doubling, capped at max_backoff_s
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1


def test_signal_sets_flag_only_and_handler_is_restored(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    spot = SpotCheckpoint(drill_steps=[7], signals=["SIGTERM", "SIGUSR1"], dirpath=str(tmp_path / "ckpt"))
    trainer = _trainer(tmp_path, spot, max_epochs=2)
    trainer.fit(ImageClassifier(), datamodule=DigitsDataModule())
    assert spot.interrupted and spot.notice == notices.Notice("signal", "SIGTERM")
    assert trainer.global_step == 7  # the drill fires once 7 steps are done; that state is saved
    assert signal.getsignal(signal.SIGUSR1) == before
    state = torch.load(tmp_path / "ckpt" / "step=00000007.ckpt", weights_only=True)
    assert state["callbacks"]["SpotCheckpoint"]["drills_fired"] == ["step:7"]
    (rank0_rng,) = state["atscale"]["rng"]
    assert sorted(rank0_rng) == ["numpy", "python", "torch"]


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path: Path) -> None:
    import numpy as np

    torch.manual_seed(3)
    state = rng_state()
    torch.save({"rng": state}, tmp_path / "rng.pt")
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True)["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def _pickled_objects(value: object) -> int:
    """Objects ``torch.save`` pickles one by one for ``value`` (a tensor's storage is one record)."""
    if isinstance(value, dict):
        return 1 + sum(_pickled_objects(k) + _pickled_objects(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return 1 + sum(_pickled_objects(v) for v in value)
    return 1


def test_rng_state_is_a_few_tensors_not_thousands_of_ints() -> None:
    # every checkpoint carries it: as Python ints (5,056 for torch's state, 624 + 625 for NumPy's and Python's)
    # it cost the writer thread ~6 ms of pickling per save, holding the GIL the training step needs
    state = rng_state()
    assert _pickled_objects(state) < 30


def test_rng_state_saved_as_plain_lists_by_earlier_versions_still_restores() -> None:
    import numpy as np

    torch.manual_seed(5)
    np_state = np.random.get_state()
    old = {"python": random.getstate(),
           "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
           "torch": torch.get_rng_state().tolist()}
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    set_rng_state(old)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def _write_checkpoints_until_killed(folder: str, first_written: Any) -> None:
    """A writer process: checkpoints of 8 MB, one after another, each a step later, until it is killed."""
    io, step = AtomicCheckpointIO(), 0
    while True:
        step += 1
        io.save_checkpoint({"w": torch.full((2_000_000,), float(step)), "global_step": step, "epoch": 0},
                           f"{folder}/step={step:08d}.ckpt")
        first_written.set()


@pytest.mark.e2e
def test_sigkill_during_checkpoint_writes_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    # Each writer is a real process killed by a real SIGKILL; they are forked from a fork server that imported
    # torch once (multiprocessing's "forkserver", a single-threaded parent), not started as new interpreters
    # that would each spend seconds importing torch before their first write.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])  # this module (the writer's), and torch with it
    rng = random.Random(0)
    for attempt in range(8):
        first_written = context.Event()
        proc = context.Process(target=_write_checkpoints_until_killed, args=(str(tmp_path), first_written))
        proc.start()
        assert first_written.wait(timeout=120), f"attempt {attempt}: the writer wrote nothing in 120 s"
        time.sleep(rng.uniform(0.0, 0.3))  # then somewhere inside a later write
        proc.kill()
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
        record = ckpt_store.newest_good(tmp_path)
        assert record is not None, f"attempt {attempt}: no good checkpoint left"
        state = torch.load(record.path, weights_only=True)
        assert state["global_step"] == record.global_step
        assert torch.equal(state["w"], torch.full((2_000_000,), float(record.global_step)))


def test_truncated_newest_checkpoint_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    io = AtomicCheckpointIO()
    for step in (10, 20):
        io.save_checkpoint({"w": torch.arange(1000), "global_step": step, "epoch": 0}, tmp_path / f"s{step}.ckpt")
    with open(tmp_path / "s20.ckpt", "r+b") as handle:
        handle.truncate(500)
    with caplog.at_level(logging.WARNING):
        record = ckpt_store.newest_good(tmp_path)
    assert record is not None and record.global_step == 10
    assert "s20.ckpt is truncated or changed (500 bytes" in caplog.text


def test_full_disk_raises_a_clear_error_and_keeps_the_previous(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    io = AtomicCheckpointIO()
    io.save_checkpoint({"w": torch.arange(1000), "global_step": 1, "epoch": 0}, tmp_path / "a.ckpt")

    def full_disk(obj: object, handle) -> None:
        handle.write(b"x" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match=r"could not write checkpoint .*b\.ckpt \(No space left on device\)") as err:
        io.save_checkpoint({"w": torch.arange(1000), "global_step": 2, "epoch": 0}, tmp_path / "b.ckpt")
    monkeypatch.undo()
    assert err.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt", "a.ckpt.meta.json"]  # no debris
    record = ckpt_store.newest_good(tmp_path)
    assert record is not None and record.global_step == 1
    assert torch.equal(torch.load(record.path, weights_only=True)["w"], torch.arange(1000))


def test_prune_keeps_newest_good_and_removes_debris(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    for step in (1, 2, 3, 4):
        io.save_checkpoint({"global_step": step, "epoch": 0}, tmp_path / f"step={step:08d}.ckpt")
    orphan = tmp_path / "step=00000000.ckpt"  # a save killed before its record
    orphan.write_bytes(b"partial")
    import os

    os.utime(orphan, (1, 1))
    removed = ckpt_store.prune(tmp_path, CHECKPOINT_PATTERN, keep=2)
    assert sorted(p.name for p in removed) == ["step=00000000.ckpt", "step=00000001.ckpt", "step=00000002.ckpt"]
    assert [r.name for r in ckpt_store.candidates(tmp_path)] == ["step=00000004.ckpt", "step=00000003.ckpt"]


class _StubTrainer:
    num_nodes = 1
    is_global_zero = False


class _StubRankZero(_StubTrainer):
    is_global_zero = True
    global_step = 0
    loggers: list = []


def test_auto_interval_is_dalys_optimum_for_the_measured_save(caplog: pytest.LogCaptureFixture) -> None:
    import math

    per_hour = 1 - math.exp(-1 / 24)  # one interruption a day on average: MTBF 24 h
    spot = SpotCheckpoint(every_minutes="auto", interruption_rate=per_hour)
    with caplog.at_level(logging.WARNING, logger="callbacks.utils.save_schedule"):
        spot._choose_interval(_StubRankZero(), save_cost_s=300.0)  # a 5-minute save
    assert spot.interval_s is not None
    assert spot.interval_s / 60 == pytest.approx(116.7, abs=0.05)  # Daly's published case
    assert caplog.messages == ["SpotCheckpoint(every_minutes='auto'): saving every 116.7 min (Daly's optimum for the "
                               "first save's 300.00 s loop stall and a 24.0 h MTBF)."]


def test_fixed_interval_far_from_optimum_warns(caplog: pytest.LogCaptureFixture) -> None:
    import math

    spot = SpotCheckpoint(every_minutes=10, interruption_rate=1 - math.exp(-1 / 24))
    with caplog.at_level(logging.WARNING, logger="callbacks.utils.save_schedule"):
        spot._choose_interval(_StubRankZero(), save_cost_s=300.0)
    assert spot.interval_s == 600.0  # a fixed interval is kept
    assert "more than 2x away from Daly's optimum of 116.7 min" in caplog.text


def test_auto_interval_needs_an_interruption_rate() -> None:
    with pytest.raises(ValueError, match=r"every_minutes=.auto.*interruption_rate > 0"):
        SpotCheckpoint(every_minutes="auto")


class _TermDuringSanityCheck(ImageClassifier):
    """Sends this process a real SIGTERM from inside the sanity check's first validation step."""

    def validation_step(self, batch: object, batch_idx: int) -> object:
        if self.trainer.sanity_checking and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().validation_step(batch, batch_idx)


def test_sigterm_during_the_sanity_check_is_ours_not_lightnings(tmp_path: Path) -> None:
    """Lightning's handler (installed after setup) would end the run with an exception; ours saves and stops."""
    spot = SpotCheckpoint(dirpath=str(tmp_path / "ckpt"))
    trainer = pl.Trainer(default_root_dir=tmp_path, max_epochs=2, callbacks=[spot], plugins=[AtomicCheckpointIO()],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, accelerator="cpu", devices=1, use_distributed_sampler=False,
                         num_sanity_val_steps=2)
    trainer.fit(_TermDuringSanityCheck(), datamodule=DigitsDataModule())
    assert spot.interrupted and spot.notice == notices.Notice("signal", "SIGTERM")
    assert trainer.global_step == 1  # the first training step completes, is saved, and the run stops
    record = ckpt_store.newest_good(tmp_path / "ckpt", CHECKPOINT_PATTERN)
    assert record is not None and record.global_step == 1


def _fit_digits(tmp_path: Path, dirpath: str, drills: list[int], ckpt: str | None = None):
    pl.seed_everything(42)
    spot = SpotCheckpoint(dirpath=dirpath, drill_steps=drills)
    logger = RecordingLogger()
    trainer = pl.Trainer(default_root_dir=tmp_path, max_epochs=2, callbacks=[spot], plugins=[AtomicCheckpointIO()],
                         logger=logger, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, accelerator="cpu", devices=1, use_distributed_sampler=False,
                         num_sanity_val_steps=0, log_every_n_steps=1)
    model = ImageClassifier()
    trainer.fit(model, datamodule=DigitsDataModule(), ckpt_path=ckpt)
    return trainer, logger, model


def test_notice_at_an_epochs_last_batch_keeps_that_epochs_validation(tmp_path: Path) -> None:
    """23 batches an epoch: a notice at step 23 is saved at once, then the epoch's validation runs and its end is
    saved too; the resumed run neither loses nor repeats a validation and ends bitwise equal."""
    _, ref_logs, ref_model = _fit_digits(tmp_path, str(tmp_path / "ref"), [])
    assert [s for s, _ in ref_logs.values("val/acc")] == [22, 45]

    trainer, first_logs, _ = _fit_digits(tmp_path, str(tmp_path / "ck"), [23])
    assert trainer.global_step == 23
    assert first_logs.values("val/acc") == ref_logs.values("val/acc")[:1]  # epoch 0's validation ran
    assert sorted(p.name for p in (tmp_path / "ck").glob("*.ckpt")) == ["step=00000023-validated.ckpt",
                                                                       "step=00000023.ckpt"]
    record = ckpt_store.newest_good(tmp_path / "ck", CHECKPOINT_PATTERN)
    assert record.path.name == "step=00000023-validated.ckpt"

    _, rest_logs, model = _fit_digits(tmp_path, str(tmp_path / "ck"), [23], ckpt=str(record.path))
    assert rest_logs.values("val/acc") == ref_logs.values("val/acc")[1:]
    reference, resumed = ref_model.state_dict(), model.state_dict()
    assert reference.keys() == resumed.keys() and all(torch.equal(reference[k], resumed[k]) for k in reference)


def test_validate_on_notice_false_skips_the_validation_as_before(tmp_path: Path) -> None:
    spot = SpotCheckpoint(dirpath=str(tmp_path / "ck"), drill_steps=[23], validate_on_notice=False)
    logger = RecordingLogger()
    trainer = pl.Trainer(default_root_dir=tmp_path, max_epochs=2, callbacks=[spot], plugins=[AtomicCheckpointIO()],
                         logger=logger, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, accelerator="cpu", devices=1, use_distributed_sampler=False,
                         num_sanity_val_steps=0)
    trainer.fit(ImageClassifier(), datamodule=DigitsDataModule())
    assert trainer.global_step == 23 and logger.values("val/acc") == []
    assert sorted(p.name for p in (tmp_path / "ck").glob("*.ckpt")) == ["step=00000023.ckpt"]


class _Clock:
    """The monotonic clock SpotCheckpoint reads: it moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class _SlowSaveIO(AtomicCheckpointIO):
    """Each save takes exactly ``save_s`` on the clock; the paths are recorded."""

    def __init__(self, clock: _Clock, save_s: float) -> None:
        super().__init__()
        self.clock, self.save_s, self.saved = clock, save_s, []

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.clock.now += self.save_s
        self.saved.append(Path(path).name)
        super().save_checkpoint(checkpoint, path, storage_options)


class _Tick(pl.Callback):
    """Each training batch takes ``step_s`` on the clock."""

    def __init__(self, clock: _Clock, step_s: float) -> None:
        self.clock, self.step_s = clock, step_s

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.clock.now += self.step_s


class _TinyRegression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.lin(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_auto_interval_in_a_real_trainer_comes_from_the_measured_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """20 steps of 1000 s an epoch, saves of 300 s, one interruption a day: the epoch-end save at step 20 is measured
    (300 s), which sets Daly's interval t = sqrt(2 d M) (1 + sqrt(d/2M)/3 + d/(18 M)) - d = 7001.4 s; from then a save
    is due after 8 steps (8000 s >= 7001.4 s, 7000 s is not): steps 28 and 36, then the epoch's end at 40."""
    import math

    from callbacks import spot as spot_module

    clock = _Clock()
    monkeypatch.setattr(spot_module, "time", clock)  # the module's only use of time is time.monotonic()
    io = _SlowSaveIO(clock, save_s=300.0)
    spot = SpotCheckpoint(every_minutes="auto", interruption_rate=1 - math.exp(-1 / 24), dirpath=str(tmp_path / "ck"),
                          keep=10, signals=[])
    spot.schedule.clock = clock.monotonic  # the save schedule's clock is the same patched one
    logger = RecordingLogger()
    trainer = pl.Trainer(default_root_dir=tmp_path, max_epochs=2, callbacks=[_Tick(clock, 1000.0), spot],
                         plugins=[io], logger=logger, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, accelerator="cpu", devices=1, limit_val_batches=0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(40, 2)), batch_size=2)
    with caplog.at_level(logging.WARNING, logger="callbacks.utils.save_schedule"):
        trainer.fit(_TinyRegression(), train_dataloaders=data)

    d, m = 300.0, 24 * 3600.0
    daly = math.sqrt(2 * d * m) * (1 + math.sqrt(d / (2 * m)) / 3 + d / (2 * m) / 9) - d
    assert daly == pytest.approx(7001.39, abs=0.01)
    assert spot.interval_s == pytest.approx(daly, rel=1e-12)
    assert io.saved == ["step=00000020.ckpt", "step=00000028.ckpt", "step=00000036.ckpt", "step=00000040.ckpt"]
    (logged,) = [m for _, m in logger.calls if "spot/interval_s" in m]  # chosen once, from the first save
    assert logged["spot/save_cost_s"] == 300.0
    assert logged["spot/interval_s"] == logged["spot/optimal_interval_s"] == pytest.approx(daly, rel=1e-12)
    assert [r.getMessage() for r in caplog.records if r.name == "callbacks.utils.save_schedule"] == [
        "SpotCheckpoint(every_minutes='auto'): saving every 116.7 min (Daly's optimum for the first save's 300.00 s "
        "loop stall and a 24.0 h MTBF)."]


def test_pruning_runs_on_the_writer_after_the_new_save_is_published(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With asynchronous saves, pruning is no work for the training thread, and it never counts on a save that
    is still being written: after each prune exactly ``keep`` good checkpoints remain, the newest among them."""
    from callbacks.checkpoint_io import BoundedAsyncCheckpointIO

    written: list[str] = []
    pruned: list[tuple[str, str, list[str]]] = []  # (thread, newest written so far, good checkpoints left)

    class RecordingIO(AtomicCheckpointIO):
        def save_checkpoint(self, checkpoint: dict, path: object, storage_options: object = None) -> None:
            super().save_checkpoint(checkpoint, path, storage_options)
            written.append(Path(path).name)

    real_prune = ckpt_store.prune

    def prune(directory: Path, pattern: str, keep: int) -> list[Path]:
        removed = real_prune(directory, pattern, keep)
        good = [p.name for p in ckpt_store.candidates(Path(directory), pattern)]
        pruned.append((threading.current_thread().name, written[-1], good))
        return removed

    monkeypatch.setattr(ckpt_store, "prune", prune)
    spot = SpotCheckpoint(every_n_steps=5, keep=1, save_on_train_epoch_end=False, dirpath=str(tmp_path / "ck"),
                          signals=[])
    trainer = pl.Trainer(default_root_dir=tmp_path, max_epochs=1, callbacks=[spot],
                         plugins=[BoundedAsyncCheckpointIO(RecordingIO())], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1,
                         limit_val_batches=0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(40, 2)), batch_size=2)
    trainer.fit(_TinyRegression(), train_dataloaders=data)

    assert written == [f"step={s:08d}.ckpt" for s in (5, 10, 15, 20)]
    *during, (teardown_thread, _, _) = pruned
    assert len(during) == 4 and all(thread != "MainThread" for thread, _, _ in during)
    assert [(newest, good) for _, newest, good in during] == [(name, [name]) for name in written]
    assert teardown_thread == "MainThread"  # once more when training is over, after the writer has drained
