"""One test per private coupling in ``callbacks/utils/compat.py``: each fails, naming it, when an upgrade breaks it."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.utils.data import DataLoader, TensorDataset

from callbacks.utils import compat


class Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", self.layer(batch[0]).pow(2).mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Steps(Logger):
    """Which metrics reached the logger at which step."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int | None, tuple[str, ...]]] = []

    @property
    def name(self) -> str:
        return "steps"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, tuple(sorted(metrics))))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class Record(Callback):
    def __init__(self) -> None:
        self.due: list[tuple[int, int, bool]] = []
        self.should_log: list[int] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.due.append((trainer.current_epoch, batch_idx, compat.validation_due(trainer)))
        if compat.lightning_should_log(trainer):
            self.should_log.append(trainer.global_step)


def _fit(tmp_path: Path, **trainer_kwargs: Any) -> tuple[Record, Steps, Trainer]:
    data = DataLoader(TensorDataset(torch.randn(12, 2)), batch_size=4)  # 3 batches an epoch
    record, logger = Record(), Steps()
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=logger, callbacks=[record],
                      default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, num_sanity_val_steps=0, **trainer_kwargs)
    trainer.fit(Tiny(), train_dataloaders=data, val_dataloaders=data)
    return record, logger, trainer


def test_validation_due_is_true_at_the_last_batch_of_an_epoch_that_validates(tmp_path: Path) -> None:
    record, _, _ = _fit(tmp_path, check_val_every_n_epoch=2)
    assert record.due == [(0, 0, False), (0, 1, False), (0, 2, False), (1, 0, False), (1, 1, False), (1, 2, True)], \
        "compat.validation_due: Lightning's _should_check_val_fx / _data_fetcher changed"


def test_lightning_should_log_and_log_metrics_follow_the_trainers_cadence(tmp_path: Path) -> None:
    record, logger, trainer = _fit(tmp_path, log_every_n_steps=2)
    trained = [step for step, keys in logger.logged if "train/loss" in keys]
    assert record.should_log == [step + 1 for step in trained] == [2, 4, 6], \
        "compat.lightning_should_log: Lightning's _logger_connector.should_update_logs changed"
    compat.lightning_log_metrics(trainer, {"x/y": 1.0}, 41)
    assert logger.logged[-1] == (41, ("x/y",)), "compat.lightning_log_metrics: _logger_connector.log_metrics changed"


def test_async_executor_and_error_are_those_async_checkpoint_io_uses(tmp_path: Path) -> None:
    io = AsyncCheckpointIO(TorchCheckpointIO())
    executor = compat.async_executor(io)
    assert isinstance(executor, ThreadPoolExecutor) and compat.async_executor(io) is executor
    io.save_checkpoint({"a": torch.ones(1)}, tmp_path / "one.ckpt")
    assert executor.submit(lambda: 7).result() == 7  # the same thread: after the save
    assert (tmp_path / "one.ckpt").exists() and compat.async_error(io) is None
    compat.set_async_error(io, OSError("disk full"))
    assert isinstance(compat.async_error(io), OSError)
    with pytest.raises(OSError, match="disk full"):  # AsyncCheckpointIO raises it at the next save
        io.save_checkpoint({"a": torch.ones(1)}, tmp_path / "two.ckpt")


class Allowed:
    pass


def test_torch_allowed_globals_holds_torchs_list_and_the_users(tmp_path: Path) -> None:
    allowed = compat.torch_allowed_globals()
    assert allowed["torch._utils._rebuild_tensor_v2"] is torch._utils._rebuild_tensor_v2
    with torch.serialization.safe_globals([Allowed]):
        added = compat.torch_allowed_globals()
    assert added[f"{Allowed.__module__}.{Allowed.__qualname__}"] is Allowed


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)


def test_ddp_comm_hook_names_lists_the_hook_a_ddp_module_registered(tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(_Linear())
        assert compat.ddp_comm_hook_names(ddp) == []
        ddp.register_comm_hook(state=None, hook=allreduce_hook)
        assert compat.ddp_comm_hook_names(ddp) == ["allreduce_hook"], \
            "compat.ddp_comm_hook_names: DDP's _comm_hooks changed"
    finally:
        dist.destroy_process_group()


class _ThreeLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(2, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def test_rebuild_ddp_buckets_in_reverse_order_reorders_the_reducer_once(tmp_path: Path) -> None:
    """One process: the reducer's parameters run last layer first and DDP takes it as its one rebuild."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = _ThreeLayers()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(state=None, hook=allreduce_hook)
        assert compat.rebuild_ddp_buckets_in_reverse_order(ddp), \
            "compat.rebuild_ddp_buckets_in_reverse_order: DDP's reducer internals changed"
        assert ddp._module_parameters == list(model.parameters())  # the module's own list is untouched
        assert compat.ddp_comm_hook_names(ddp) == ["allreduce_hook"]  # the hook is on the new reducer
        ddp(torch.ones(4, 2)).sum().backward()  # a step in the new layout: every gradient arrives
        assert all(p.grad is not None for p in model.parameters())
        assert not compat.rebuild_ddp_buckets_in_reverse_order(ddp)  # once only
    finally:
        dist.destroy_process_group()


def test_time_every_save_sees_each_checkpoint_callback_save_and_undoes(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    saved: list[str] = []

    def timed(save: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = save(*args, **kwargs)
        saved.append(Path(args[0]).name)  # after the save: the file is written
        assert Path(args[0]).exists()
        return result

    data = DataLoader(TensorDataset(torch.randn(12, 2)), batch_size=4)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, callbacks=[checkpoint],
                      default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0)
    undo = compat.time_every_save(trainer, timed)
    trainer.fit(Tiny(), train_dataloaders=data)
    assert saved == ["step=2.ckpt", "step=4.ckpt"], \
        "compat.time_every_save: ModelCheckpoint no longer saves through trainer.save_checkpoint"
    undo()
    assert "save_checkpoint" not in vars(trainer)
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    assert saved == ["step=2.ckpt", "step=4.ckpt"]  # undone: the class's method again


def test_the_private_methods_the_compat_classes_override_keep_their_signatures() -> None:
    import inspect

    from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, ThroughputMonitor

    for method, expected in ((ModelCheckpoint._save_checkpoint, ["self", "trainer", "filepath"]),
                             (RichProgressBar._get_train_description, ["self", "current_epoch"]),
                             (ThroughputMonitor._compute, ["self", "trainer", "iter_num"])):
        assert list(inspect.signature(method).parameters) == expected, \
            f"compat overrides {method.__qualname__}{expected[1:]}: its signature changed"


def test_model_checkpoint_after_save_sees_every_save_once_written(tmp_path: Path) -> None:
    seen: list[tuple[str, bool]] = []

    class Seen(compat.ModelCheckpointAfterSave):
        def after_save(self, trainer: Trainer, filepath: str) -> None:
            seen.append((Path(filepath).name, Path(filepath).exists()))

    data = DataLoader(TensorDataset(torch.randn(12, 2)), batch_size=4)
    checkpoint = Seen(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}", save_last=True)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, callbacks=[checkpoint],
                      default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0)
    trainer.fit(Tiny(), train_dataloaders=data)
    assert seen == [("step=2.ckpt", True), ("last.ckpt", True), ("step=4.ckpt", True), ("last.ckpt", True)], \
        "compat.ModelCheckpointAfterSave: ModelCheckpoint no longer saves through _save_checkpoint(trainer, filepath)"


def test_labelled_rich_progress_bar_labels_the_training_bar(tmp_path: Path) -> None:
    class Labelled(compat.LabelledRichProgressBar):
        def train_label(self, label: str) -> str:
            return f"{label.strip()} of mine"

    bar = Labelled()
    data = DataLoader(TensorDataset(torch.randn(12, 2)), batch_size=4)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, callbacks=[bar],
                      default_root_dir=tmp_path, enable_model_summary=False, enable_checkpointing=False,
                      limit_val_batches=0)
    trainer.fit(Tiny(), train_dataloaders=data)
    assert bar.progress is not None and bar.train_progress_bar_id is not None
    task = next(t for t in bar.progress.tasks if t.id == bar.train_progress_bar_id)
    assert task.description.endswith("Epoch 1/1 of mine"), \
        "compat.LabelledRichProgressBar: RichProgressBar no longer labels its bar with _get_train_description"


def test_the_progress_bars_refresh_thread_sleeps_until_asked_and_stops_at_once() -> None:
    """Lightning's polled 4 times a second and its stop waited out the sleep (0.12 s of the digits fit)."""

    class FakeLive:
        def __init__(self) -> None:
            self._lock = threading.RLock()
            self.drawn = threading.Event()

        def refresh(self) -> None:
            self.drawn.set()

    live = FakeLive()
    thread = compat._WakingRefreshThread(live, 0.001)  # after a draw, 1000 s before the next may come
    thread.start()
    thread.refresh_cond = True  # what Lightning's CustomProgress.soft_refresh sets
    assert live.drawn.wait(30)
    thread.stop()
    thread.join(timeout=30)
    assert not thread.is_alive()  # the stop ended the 1000 s wait


def test_the_labelled_bar_draws_through_the_waking_thread_and_lightning_still_asks_it(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks.progress import rich_progress

    seen: list[bool] = []

    class Look(Callback):
        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            live = bar.progress.live  # type: ignore[union-attr]
            thread = live._refresh_thread
            seen.append(isinstance(thread, compat._WakingRefreshThread) and thread.is_alive())
            bar.progress.soft_refresh()  # type: ignore[union-attr]
            seen.append(thread.refresh_cond)

    bar = compat.LabelledRichProgressBar()
    data = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, callbacks=[bar, Look()],
                      default_root_dir=tmp_path, enable_model_summary=False, enable_checkpointing=False,
                      limit_val_batches=0)
    trainer.fit(Tiny(), train_dataloaders=data)
    assert seen and all(seen), ("compat.LabelledRichProgressBar: Lightning's rich display no longer has a "
                                "_RefreshThread with refresh_cond that soft_refresh sets")
    assert issubclass(compat._WakingRefreshThread, rich_progress._RefreshThread)
    assert not any(isinstance(t, compat._WakingRefreshThread) for t in threading.enumerate())  # stopped at teardown


def test_keyed_throughput_monitor_names_its_metrics_and_takes_a_peak(tmp_path: Path) -> None:
    class Counted(Tiny):
        flops_per_batch = 1000

    class Keyed(compat.KeyedThroughputMonitor):
        def metric_key(self, key: str) -> str:
            return key.replace("items_per_sec", "tokens_per_sec")

        def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
            super().setup(trainer, pl_module, stage)
            self.set_available_flops(1e6)

    data = DataLoader(TensorDataset(torch.randn(24, 2)), batch_size=4)
    monitor = Keyed(batch_size_fn=lambda b: b[0].size(0), length_fn=lambda b: b[0].numel(), window_size=2)
    logger = Steps()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=6, logger=logger, callbacks=[monitor],
                      default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, limit_val_batches=0, log_every_n_steps=2)
    trainer.fit(Counted(), train_dataloaders=data)
    keys = {key for _, logged in logger.logged for key in logged}
    assert "train/device/tokens_per_sec" in keys and not any("items_per_sec" in k for k in keys), \
        "compat.KeyedThroughputMonitor: ThroughputMonitor._compute no longer names or logs its metrics"
    assert "train/device/mfu" in keys, "compat.KeyedThroughputMonitor: ThroughputMonitor._throughputs changed"
