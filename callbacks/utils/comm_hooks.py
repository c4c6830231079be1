"""One DDP communication hook, many observers: compose comm hook wrappers around a base hook.

DDP allows a single communication hook per module, yet several callbacks want one: StepTiming times
(and may compress) each bucket's all-reduce, GradientNoiseScale reads the gradient norms before and
after it. :func:`add_comm_hook_wrapper` registers one hook that runs a list of wrappers around a base
hook that does the communication; each caller appends its wrapper, and at most one chooses the base
(compression). What was composed on a module (:class:`ComposedHook`, :func:`composed_hook`) is kept
beside it, in a registry that forgets the module with it, not in attributes set on torch's object.

Composing also pins the module's gradient bucket layout (:func:`pin_bucket_layout`): the buckets are what
every hook sees, and a resumed run is bitwise exact at 3 or more ranks only if it reduces each step in the
layout the uninterrupted run used for that step.
torch is imported when used; no Lightning.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

__all__ = ["CommHookWrapper", "ComposedHook", "NoiseScaleCommHook", "WireMeter", "add_comm_hook_wrapper",
           "composed_hook", "pin_bucket_layout", "wire_bytes"]

#: ``meter(bucket) -> bytes_sent()``: called before a bucket's communication is issued; the returned
#: function, called after it was issued, gives the bytes the base hook put on the wire for that bucket
#: (compression sends fewer than the bucket holds). Observers (StepTiming) read it; without a meter the
#: bucket's own bytes are sent.
WireMeter = Callable[["dist.GradBucket"], Callable[[], int]]

#: ``wrapper(bucket, inner) -> Future``: observe or transform a bucket around ``inner(bucket)``.
CommHookWrapper = Callable[["dist.GradBucket", Callable[["dist.GradBucket"], "torch.futures.Future"]],
                           "torch.futures.Future"]


@dataclass
class ComposedHook:
    """What :func:`add_comm_hook_wrapper` composed on one DDP module.

    Attributes:
        base: the ``(hook, state)`` that communicates under the wrappers.
        chain: the wrappers, in the order added (the last runs outermost).
        base_chosen: whether a caller chose ``base`` (else it is the mean all-reduce).
        meter: the chosen base's :data:`WireMeter`, if it has one.
        compression: the name of the compression the base does (``"fp16"``, ``"powersgd"``, ...), set by
            whoever chose it, for reports; ``None`` for a plain all-reduce.
        timed: whether a StepTiming already times this module's communication.
    """

    base: tuple[Callable[..., Any], Any]
    chain: list[CommHookWrapper] = field(default_factory=list)
    base_chosen: bool = False
    meter: WireMeter | None = None
    compression: str | None = None
    timed: bool = False


_COMPOSED: weakref.WeakKeyDictionary[Any, ComposedHook] = weakref.WeakKeyDictionary()


def composed_hook(ddp_module: torch.nn.parallel.DistributedDataParallel) -> ComposedHook | None:
    """What was composed on ``ddp_module`` through :func:`add_comm_hook_wrapper`; ``None`` if nothing."""
    return _COMPOSED.get(ddp_module)


def _chained_hook(composed: ComposedHook) -> Callable[..., torch.futures.Future]:
    """The one hook registered on the DDP module: the wrappers, the last added outermost, around the
    base hook (the mean all-reduce unless a caller chose another). A plain function without
    annotations: DDP inspects the hook's signature and name."""

    def bind(wrapper: CommHookWrapper, inner: Callable[[dist.GradBucket], torch.futures.Future]) -> Callable:
        return lambda b: wrapper(b, inner)

    def atscale_chained_comm_hook(state, bucket):
        base, base_state = composed.base
        call = partial(base, base_state)
        for wrapper in composed.chain:
            call = bind(wrapper, call)
        return call(bucket)

    return atscale_chained_comm_hook


def wire_bytes(ddp_module: torch.nn.parallel.DistributedDataParallel, bucket: dist.GradBucket) -> Callable[[], int]:
    """Call before a bucket's communication is issued; the result, called after, gives its bytes on the wire."""
    composed = composed_hook(ddp_module)
    if composed is not None and composed.meter is not None:
        return composed.meter(bucket)
    buffer = bucket.buffer()
    raw = buffer.numel() * buffer.element_size()
    return lambda: raw


def add_comm_hook_wrapper(ddp_module: torch.nn.parallel.DistributedDataParallel, wrapper: CommHookWrapper,
                          base: tuple[Callable[..., torch.futures.Future], Any] | None = None,
                          meter: WireMeter | None = None) -> ComposedHook:
    """Compose ``wrapper`` into the DDP module's single communication hook; returns what is composed on it.

    The first caller registers a hook that runs every wrapper around a base hook that does the
    communication (torch's ``allreduce_hook``, a mean, unless ``base`` says otherwise); later callers
    only append theirs. Call it before the first backward (``on_train_start`` works).

    Args:
        ddp_module: the DDP-wrapped module (``trainer.strategy.model``).
        wrapper: ``wrapper(bucket, inner) -> Future``; it must call ``inner(bucket)`` once and return a
            future of the reduced bucket tensor (``inner(bucket).then(...)`` to see the result).
        base: ``(hook, state)`` doing the communication, e.g. ``(fp16_compress_hook, process_group)``
            or ``(powerSGD_hook, PowerSGDState(...))``; ``None`` keeps the current one.
        meter: with ``base``: how many bytes the base sends per bucket (see :data:`WireMeter`).

    Raises:
        RuntimeError: if a hook that does not follow this convention is already registered, or if
            ``base`` differs from a base another caller already chose.

    Example::

        def timed(bucket, inner):
            start = time.perf_counter()
            return inner(bucket).then(lambda fut: (print(time.perf_counter() - start), fut.value())[1])

        add_comm_hook_wrapper(trainer.strategy.model, timed, base=(fp16_compress_hook, None))
    """
    composed = composed_hook(ddp_module)
    if composed is None:
        pin_bucket_layout(ddp_module)  # before the first backward, which is when callers compose
        from .compat import ddp_comm_hook_names

        existing = ddp_comm_hook_names(ddp_module)
        if existing:
            raise RuntimeError(f"the DDP module already has the comm hook {', '.join(existing)}, registered "
                               "without callbacks.utils.comm_hooks.add_comm_hook_wrapper; DDP allows only one.")
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        composed = ComposedHook(base=(allreduce_hook, ddp_module.process_group))
        ddp_module.register_comm_hook(state=None, hook=_chained_hook(composed))
        _COMPOSED[ddp_module] = composed
    if base is not None:
        if composed.base_chosen and composed.base[0] is not base[0]:
            raise RuntimeError(f"the DDP comm hook already communicates with {composed.base[0].__name__}; "
                               f"{base[0].__name__} cannot be used as well.")
        composed.base, composed.base_chosen, composed.meter = base, True, meter
    composed.chain.append(wrapper)
    return composed


_PINNED: weakref.WeakSet[Any] = weakref.WeakSet()


def pin_bucket_layout(ddp_module: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Fix the DDP module's gradient buckets for its whole life, the same in every process that wraps the model.

    Why: DDP reduces a process's first step in buckets of the parameters in definition order, then rebuilds
    them once in the order the gradients became ready. From 3 ranks on, an all-reduce's sum of each element
    depends on where the element sits in the flat bucket (a ring reduces each chunk starting from another
    rank, and float addition is not associative; with 2 ranks ``a + b == b + a``). So a run resumed at step
    ``k`` reduced step ``k + 1`` in the first-step layout where the uninterrupted run had the rebuilt one,
    and every tensor drifted from there (same batches, same losses, different reduced gradients).

    Pinned: the parameters in reverse definition order (the last layers' gradients are ready first, as in
    DDP's own first guess, so communication still overlaps the backward), cut into buckets by DDP's own size
    caps, built now and never rebuilt. The module gets a new reducer over that order (a communication hook
    already registered is registered on it again); every rank must call this, before the first training
    backward (``on_train_start``; validation runs without gradients and does not count).

    Returns:
        Whether the layout is fixed: also true under ``find_unused_parameters``, whose buckets DDP never
        rebuilds; false (and nothing changed) after a training step, or for ``static_graph`` (its first step
        reduces every bucket at the backward's end, and torch then hands hooks bucket 0's index and
        parameters for every bucket: a hook that reads them, top-k, would fail), DDP's native mixed
        precision, its Python reducer (compiled autograd) or its delayed all-reduce of every parameter.
    """
    if ddp_module in _PINNED or ddp_module.find_unused_parameters:
        return True
    from .compat import rebuild_ddp_buckets_in_reverse_order

    if not rebuild_ddp_buckets_in_reverse_order(ddp_module):
        return False
    _PINNED.add(ddp_module)
    return True


class NoiseScaleCommHook:
    """Comm hook wrapper that sums each step's squared gradient norms before and after the all-reduce.

    Use it through :func:`add_comm_hook_wrapper`; :meth:`pop` returns and resets the sums (over all
    buckets since the last pop) as ``(local squared norm, reduced squared norm, buckets)``. The local
    norm is this rank's; average it over ranks for the small-batch estimate.
    """

    def __init__(self) -> None:
        self._local: list[Any] = []  # 0-d tensors on the gradients' device: no sync inside the hook
        self._reduced: list[Any] = []

    def __call__(self, bucket: dist.GradBucket,
                 inner: Callable[[dist.GradBucket], torch.futures.Future]) -> torch.futures.Future:
        self._local.append(bucket.buffer().detach().float().pow(2).sum())

        def after(fut: torch.futures.Future) -> Any:
            value = fut.value()
            tensor = value[0] if isinstance(value, (list, tuple)) else value
            self._reduced.append(tensor.detach().float().pow(2).sum())
            return value

        return inner(bucket).then(after)

    def pop(self) -> tuple[float, float, int]:
        import torch

        local = float(torch.stack(self._local).sum()) if self._local else 0.0
        reduced = float(torch.stack(self._reduced).sum()) if self._reduced else 0.0
        buckets = len(self._local)
        self._local, self._reduced = [], []
        return local, reduced, buckets
