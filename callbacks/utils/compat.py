"""The callbacks' couplings to private internals of Lightning and torch, each in one place.

Each function here reaches into something its library does not promise to keep, because no public
route does the job. The versions they were checked against are named below, and
``tests/unit/callbacks/test_compat.py`` has a test per coupling that fails, naming it, when an upgrade
breaks it. Code elsewhere in ``callbacks/`` calls these functions, never the private names.

Checked against lightning 2.6 and torch 2.14:

- :func:`validation_due`: Lightning decides inside its epoch loop whether validation follows a batch,
  and does not expose the decision.
- :func:`lightning_should_log`, :func:`lightning_log_metrics`: a callback that logs as Lightning's own
  ``ThroughputMonitor`` does, on the trainer's logging cadence and through its logger connector.
- :func:`async_executor`, :func:`async_error`, :func:`set_async_error`: ``AsyncCheckpointIO`` keeps its
  writer thread and a failed save's error to itself; a bounded subclass queues work on the same thread.
- :func:`torch_allowed_globals`: torch's weights-only allow-list, for a restricted unpickler of the
  metadata torch.distributed.checkpoint writes.
- :func:`ddp_comm_hook_names`: the communication hooks a DDP module has registered (DDP allows one and
  does not say whether it has one).
- :func:`rebuild_ddp_buckets_in_reverse_order`: DDP fixes its gradient buckets itself (after the first step, in
  gradient-ready order) and has no public way to choose them; a bitwise resume at 3+ ranks needs one layout
  for the module's whole life (``utils/comm_hooks.py``'s ``pin_bucket_layout`` says why).
- :func:`time_every_save`: Lightning has no hook after a checkpoint is written; every save goes through
  ``trainer.save_checkpoint``, which is wrapped on the trainer instance.

Three overrides of a Lightning class's private methods, each behind a public hook of its own (a method can only be
overridden in a class, so these are base classes; a subclass overrides the public hook):

- :class:`ModelCheckpointAfterSave`: ``ModelCheckpoint._save_checkpoint``, the one method every save of the
  callback's goes through (top-k, last, every-n, on exception); Lightning tells loggers after a save, not callbacks.
- :class:`LabelledRichProgressBar`: ``RichProgressBar._get_train_description``, where Lightning builds the training
  bar's label before it adds or resets the bar's task (both of which draw it at once: a label fixed afterwards
  shows for a frame); and ``_init_progress``, after which its rich display's polling refresh thread (Lightning's
  private ``_RefreshThread``) is replaced by one that sleeps until a draw is asked for.
- :class:`KeyedThroughputMonitor`: ``ThroughputMonitor._compute``, where Lightning names and logs its metrics, and
  its ``_throughputs``, which it builds in ``setup`` with the peak FLOP/s of its own table.

Copy with it: nothing; this file works alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, ThroughputMonitor
from typing_extensions import override

if TYPE_CHECKING:
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins.io import AsyncCheckpointIO


def validation_due(trainer: Trainer) -> bool:
    """Whether the batch just trained is its epoch's last and the epoch's validation follows it.

    Lightning's epoch loop asks its ``_should_check_val_fx`` with the fit loop's ``_data_fetcher``; on a
    Lightning without them (AttributeError), False: the caller then skips validation, as before.
    """
    loop = trainer.fit_loop.epoch_loop
    try:
        return bool(loop.batch_progress.is_last_batch and loop._should_check_val_fx(trainer.fit_loop._data_fetcher))
    except AttributeError:
        return False


def lightning_should_log(trainer: Trainer) -> bool:
    """Whether this step is one Lightning logs at (``log_every_n_steps``), as its logger connector decides."""
    return bool(trainer._logger_connector.should_update_logs)


def lightning_log_metrics(trainer: Trainer, metrics: dict[str, Any], step: int | None) -> None:
    """Log ``metrics`` through Lightning's logger connector (every logger, its step bookkeeping)."""
    trainer._logger_connector.log_metrics(metrics, step=step)  # type: ignore[arg-type]


def async_executor(io: AsyncCheckpointIO) -> ThreadPoolExecutor:
    """The writer thread of ``io`` (one worker), started on first use as ``AsyncCheckpointIO`` starts it."""
    io._ensure_setup()
    executor = io._executor
    assert isinstance(executor, ThreadPoolExecutor)
    return executor


def async_error(io: AsyncCheckpointIO) -> BaseException | None:
    """The error of a save that failed in the writer thread of ``io``, re-raised by its next save."""
    return io._error


def set_async_error(io: AsyncCheckpointIO, error: BaseException) -> None:
    """Record ``error`` as a failed save of ``io``: ``AsyncCheckpointIO`` raises it at the next save and teardown."""
    io._error = error


def torch_allowed_globals() -> dict[str, Any]:
    """torch's weights-only allow-list, with what the user added through ``torch.serialization.add_safe_globals``."""
    from torch import _weights_only_unpickler as weights_only

    return {**weights_only._get_allowed_globals(), **weights_only._get_user_allowed_globals()}


def ddp_comm_hook_names(ddp_module: Any) -> list[str]:
    """The names of the communication hooks registered on a DDP module (empty: none)."""
    return [getattr(hook, "__qualname__", repr(hook)) for hook, _ in getattr(ddp_module, "_comm_hooks", [])]


def rebuild_ddp_buckets_in_reverse_order(ddp_module: Any) -> bool:
    """Give a DDP module, before its first training step, buckets over its parameters in reverse definition order
    (DDP's own size caps), built now and never rebuilt; a hook already registered is registered again. Every
    rank must call it. False, and nothing changed, where DDP would not take it: after a training step, under
    ``static_graph``, native mixed precision, the Python reducer or the delayed all-reduce of every parameter."""
    if (getattr(ddp_module, "_has_rebuilt_buckets", True)
            or getattr(ddp_module, "static_graph", True)
            or getattr(ddp_module, "mixed_precision", None) is not None
            or getattr(ddp_module, "_use_python_reducer", True)
            or getattr(ddp_module, "_delay_all_reduce_all_params", True)):
        return False
    import torch.distributed as dist

    hooks = list(getattr(ddp_module, "_comm_hooks", []))
    parameters, expect_sparse_gradient = ddp_module._build_params_for_reducer()
    parameters, expect_sparse_gradient = parameters[::-1], expect_sparse_gradient[::-1]
    # a new reducer whose parameter indices run in reverse; the old one's autograd hooks go with it
    ddp_module._ddp_init_helper(parameters, expect_sparse_gradient,
                                ddp_module._build_debug_param_to_name_mapping(parameters), False)
    for hook, state in hooks:
        dist._register_comm_hook(ddp_module.reducer, state, hook)
    # the one rebuild DDP allows, now, in index order (a broadcast of rank 0's buckets: every rank is here)
    ddp_module.reducer._push_all_rebuilt_params()
    ddp_module.reducer._rebuild_buckets()
    ddp_module._has_rebuilt_buckets = True
    return True


def time_every_save(trainer: Trainer, timed: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
                    ) -> Callable[[], None]:
    """Route every ``trainer.save_checkpoint(...)`` through ``timed(original, args, kwargs)``; returns the undo.

    ModelCheckpoint, SpotCheckpoint and a user's code all save through this method, and the save's whole
    cost (gathering the state, the callbacks' ``on_save_checkpoint``, the write, the barrier) is inside it.
    """
    original = trainer.save_checkpoint

    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        return timed(original, args, kwargs)

    trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]

    def undo() -> None:
        if vars(trainer).get("save_checkpoint") is save_checkpoint:
            del trainer.save_checkpoint  # back to the class's method
    return undo


class ModelCheckpointAfterSave(ModelCheckpoint):
    """``ModelCheckpoint`` that calls :meth:`after_save` on every rank once each checkpoint it saves is written."""

    def after_save(self, trainer: Trainer, filepath: str) -> None:
        """Called on every rank after ``trainer.save_checkpoint(filepath)`` returned for a save of this callback."""

    @override
    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        self.after_save(trainer, filepath)


def _lightning_refresh_thread() -> type:
    from lightning.pytorch.callbacks.progress import rich_progress

    return rich_progress._RefreshThread


class _WakingRefreshThread(_lightning_refresh_thread()):  # type: ignore[misc]
    """Lightning's rich refresh thread, asleep until a draw is asked for, and gone the moment it is stopped.

    Lightning's polls: it wakes ``refresh_rate`` times a second to look for a draw (taking the GIL from the step
    each time), and its stop waits out the current sleep: 0.12 s of the digits recipe's ``trainer.fit`` went to
    joining it at teardown. This one waits on an event that a soft refresh (``refresh_cond = True``, as
    Lightning's ``CustomProgress.soft_refresh`` sets it) or the stop sets, and still draws at most
    ``refresh_per_second`` times a second.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._wake = threading.Event()
        super().__init__(*args, **kwargs)

    @property
    def refresh_cond(self) -> bool:
        return self._wake.is_set()

    @refresh_cond.setter
    def refresh_cond(self, due: bool) -> None:
        if due:
            self._wake.set()
        else:
            self._wake.clear()

    def stop(self) -> None:
        super().stop()
        self._wake.set()

    def run(self) -> None:
        period = 1 / self.refresh_per_second
        while True:
            self._wake.wait()
            if self.done.is_set():
                return
            self._wake.clear()
            with self.live._lock:
                self.live.refresh()
            if self.done.wait(period):  # at most refresh_per_second draws; the stop ends the wait
                return


class LabelledRichProgressBar(RichProgressBar):
    """``RichProgressBar`` whose training bar's label :meth:`train_label` may rewrite, and whose refresh thread
    sleeps until there is something to draw (:class:`_WakingRefreshThread`)."""

    @override
    def _init_progress(self, trainer: Trainer) -> None:
        starting = self.is_enabled and (self.progress is None or self._progress_stopped)
        super()._init_progress(trainer)
        live = getattr(self.progress, "live", None)
        polling = getattr(live, "_refresh_thread", None)
        if not starting or live is None or polling is None or isinstance(polling, _WakingRefreshThread):
            return
        polling.stop()  # it ends at its next wake-up; nothing waits for it
        live._refresh_thread = _WakingRefreshThread(live, live.refresh_per_second)
        live._refresh_thread.start()

    def train_label(self, label: str) -> str:
        """The training bar's label, given Lightning's (``Epoch 3/19``, padded to the validation bar's width)."""
        return label

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        return self.train_label(super()._get_train_description(current_epoch))


class KeyedThroughputMonitor(ThroughputMonitor):
    """``ThroughputMonitor`` whose metric names :meth:`metric_key` may rewrite and whose peak FLOP/s
    :meth:`set_available_flops` sets after ``setup``. Logs on the trainer's cadence as Lightning's does."""

    def metric_key(self, key: str) -> str:
        """The logged name of a metric, given Lightning's (``train/device/items_per_sec``)."""
        return key

    def set_available_flops(self, flops: float | None) -> None:
        """The peak FLOP/s that MFU divides by (``None``: no MFU), for every stage's measurement ``setup`` built."""
        self.available_flops = flops  # type: ignore[assignment]
        for throughput in self._throughputs.values():
            throughput.available_flops = flops

    @override
    def _compute(self, trainer: Trainer, iter_num: int | None = None) -> None:
        if not lightning_should_log(trainer):
            return
        stage = trainer.state.stage
        assert stage is not None
        throughput = self._throughputs[stage]
        metrics = {self.metric_key(f"{stage.value}{throughput.separator}{k}"): v
                   for k, v in throughput.compute().items()}
        lightning_log_metrics(trainer, metrics, iter_num)
