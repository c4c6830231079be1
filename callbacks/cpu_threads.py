"""CPU threads for a run: held fixed for its whole life (exact), or following the machine's load (opt-in).

CPU results depend on torch's intra-op thread count, which decides how each reduction is split, and on
nothing else about the machine: the same digits run with its count changed mid-run (2 -> 1) ends with
every tensor different, while with one count held it gives the same weights on a quiet machine and
beside busy work. Two callbacks, for the two things a user may want:

- :class:`FixedCpuThreads` (``--cpu_threads auto``, the default): the count the run starts with (torch's
  own: every core for one process, a launcher's division for several, or ``OMP_NUM_THREADS``) is saved
  in every checkpoint and set again on resume, so that a relaunch on a busy or a different machine
  continues bitwise;
- :class:`AdaptiveCpuThreads` (``--cpu_threads adaptive``): times the steps and moves to whichever
  count is fastest now (fewer threads beside busy work, where OpenMP's spinning team collapses). Its
  probes and switches change the numerics, so a run using it is neither bitwise resumable nor
  reproducible: an explicit opt-in for throughput on a shared machine.

Example::

    trainer = Trainer(accelerator="cpu", callbacks=[FixedCpuThreads()])

Copy with it: nothing; this file works alone.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

log = logging.getLogger(__name__)

#: Metric logged (with the step) whenever the count the run keeps changes.
THREADS_METRIC = "cpu/threads"


def candidate_counts(cores: int) -> list[int]:
    """Thread counts worth trying on ``cores`` threads: all, all but one (one core busy elsewhere), half, one."""
    if cores < 1:
        raise ValueError(f"candidate_counts(cores={cores!r}): expected a positive count.")
    return sorted({cores, max(1, cores - 1), max(1, cores // 2), 1}, reverse=True)


class ThreadChooser:
    """Decides, from the step times it is fed, which thread count to run next (no torch, no clock: testable).

    Args:
        candidates: thread counts to choose among; the largest is used first.
        probe_every: steps at the kept count between two probes at first (the very first probe comes as
            soon as ``window`` steps are timed); doubled after each probe that finds nothing better, up to
            ``max_probe_every``, and reset when one does.
        probe_steps: timed steps per probed count (their median is compared).
        settle_steps: steps not timed after each change of count (the first runs wake or start threads).
        window: recent steps at the kept count whose median stands for it.
        gain: a probed count replaces the kept one only if its median is this fraction faster: counts
            within noise of each other (1 and 2 threads for the digits model on a quiet machine) then do not
            swap back and forth.
        slowdown: the kept count's median rising this many times above its value when it was chosen
            (another process started) starts a probe at once.
        give_up: a probe step (settling ones included) this many times slower than the kept count's median
            ends that count's probe: beside a busy process, a spinning team's steps can take 20x longer.
    """

    def __init__(self, candidates: Sequence[int], probe_every: int = 64, max_probe_every: int = 1024,
                 probe_steps: int = 8, settle_steps: int = 2, window: int = 9, gain: float = 0.10,
                 slowdown: float = 1.5, give_up: float = 3.0) -> None:
        if not candidates or min(candidates) < 1:
            raise ValueError(f"ThreadChooser(candidates={list(candidates)!r}): expected positive counts.")
        for name, value in (("probe_every", probe_every), ("max_probe_every", max_probe_every),
                            ("probe_steps", probe_steps), ("window", window)):
            if value < 1:
                raise ValueError(f"ThreadChooser({name}={value!r}): expected a positive count.")
        if settle_steps < 0 or not 0 <= gain < 1 or slowdown <= 1 or give_up <= 1:
            raise ValueError(f"ThreadChooser(settle_steps={settle_steps!r}, gain={gain!r}, slowdown={slowdown!r}, "
                             f"give_up={give_up!r}): expected settle_steps >= 0, 0 <= gain < 1, slowdown > 1 "
                             "and give_up > 1.")
        self.candidates = sorted(set(candidates), reverse=True)
        self.kept = self.candidates[0]
        self.current = self.kept
        self.base_probe_every, self.max_probe_every = probe_every, max(probe_every, max_probe_every)
        self.probe_every = probe_every
        self.probe_steps, self.settle_steps, self.window = probe_steps, settle_steps, window
        self.gain, self.slowdown, self.give_up = gain, slowdown, give_up
        self._recent: deque[float] = deque(maxlen=window)
        self._reference: float | None = None  # the kept count's median when it was (re)established
        self._since_probe = 0
        self._settle = 0
        self._queue: list[int] = []  # counts still to probe
        self._probe: list[float] = []  # the current probed count's step times
        self._baseline = 0.0  # the kept count's median when the probe began
        #: Median seconds per step of each count at the last completed probe (the kept count: just before it).
        self.last_probe: dict[int, float] = {}
        self._measured: dict[int, float] = {}  # the probe under way
        #: Probes run so far.
        self.probes = 0

    def record(self, seconds: float) -> int | None:
        """Take one step's time at ``current``; return the count to switch to, or ``None`` to stay."""
        if len(self.candidates) == 1:
            return None
        if self._settle:
            self._settle -= 1
            if self._queue and seconds > self.give_up * self._baseline:  # hopeless already: spare the rest
                self._settle = 0
                self._probe = [seconds]
                return self._next_probe()
            return None
        if self._queue:
            return self._record_probe(seconds)
        self._recent.append(seconds)
        self._since_probe += 1
        if len(self._recent) < self.window:
            return None
        median = statistics.median(self._recent)
        if self._reference is None:
            self._reference = median
        # the first probe as soon as the window is full: at the start the other counts are unknown
        if not self.probes or self._since_probe >= self.probe_every or median > self.slowdown * self._reference:
            return self._start_probe(median)
        return None

    def _switch(self, count: int) -> int:
        self.current = count
        self._settle = self.settle_steps
        return count

    def _start_probe(self, median: float) -> int:
        self.probes += 1
        self._baseline = median
        self._queue = [c for c in self.candidates if c != self.kept]
        self._probe = []
        self._measured = {self.kept: median}
        return self._switch(self._queue[0])

    def _record_probe(self, seconds: float) -> int | None:
        self._probe.append(seconds)
        if len(self._probe) < self.probe_steps and seconds <= self.give_up * self._baseline:
            return None
        return self._next_probe()

    def _next_probe(self) -> int | None:
        """The probed count is measured: probe the next one, or decide."""
        self._measured[self._queue.pop(0)] = statistics.median(self._probe)
        self._probe = []
        if self._queue:
            return self._switch(self._queue[0])
        return self._finish_probe()

    def _finish_probe(self) -> int | None:
        self.last_probe = dict(self._measured)
        best = min(self.last_probe, key=lambda c: self.last_probe[c])
        if best != self.kept and self.last_probe[best] < (1 - self.gain) * self._baseline:
            self.kept = best
            self.probe_every = self.base_probe_every
        else:
            self.probe_every = min(2 * self.probe_every, self.max_probe_every)
        self._recent.clear()
        self._reference = None
        self._since_probe = 0
        if self.current == self.kept:
            return None
        return self._switch(self.kept)


class AdaptiveCpuThreads(Callback):
    """Keeps torch's intra-op thread count at whichever candidate makes training steps fastest now.

    Torch's OpenMP threads spin while they wait for each other: the fastest on a dedicated machine, the
    slowest beside another busy process, where a thread whose core is taken holds up the whole team.
    This callback times the training steps at the current count, every so often tries the other
    candidate counts for a few steps, and keeps whichever is fastest now; probes back off (doubling their
    interval) while they find nothing better, and start at once when steps slow down by half. It acts
    only on a single-process CPU run and leaves the count as it found it when the fit ends.

    Every probe and switch changes how reductions are split, so the weights depend on the machine's
    load: a resumed or reproduced run is not bitwise identical. Use :class:`FixedCpuThreads` for that.

    Args:
        candidates: thread counts to try; default: all of torch's threads at the start, all but one,
            half, and one (see :func:`candidate_counts`).
        clock: seconds, for the step times (tests pass a fake one).
        **chooser: :class:`ThreadChooser`'s settings (``probe_every``, ``probe_steps``, ...).
    """

    def __init__(self, candidates: Sequence[int] | None = None,
                 clock: Callable[[], float] = time.perf_counter, **chooser: Any) -> None:
        self._candidates = list(candidates) if candidates is not None else None
        self._chooser_settings = chooser
        ThreadChooser(self._candidates or [1], **chooser)  # bad settings fail here, not at the first step
        self._clock = clock
        self.chooser: ThreadChooser | None = None
        self._initial_threads: int | None = None
        self._started: float | None = None
        #: ``(global_step, threads)`` each time the kept count changed.
        self.changes: list[tuple[int, int]] = []
        #: Median seconds per step of each count at the last completed probe of the last fit.
        self.probed: dict[int, float] = {}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or trainer.world_size != 1 or not isinstance(trainer.accelerator, CPUAccelerator):
            return
        self._initial_threads = torch.get_num_threads()
        candidates = self._candidates or candidate_counts(self._initial_threads)
        self.chooser = ThreadChooser(candidates, **self._chooser_settings)
        torch.set_num_threads(self.chooser.current)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.chooser is not None:
            for logger in trainer.loggers:
                logger.log_metrics({THREADS_METRIC: float(self.chooser.kept)}, step=trainer.global_step)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.chooser is not None:
            self._started = self._clock()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        chooser = self.chooser
        if chooser is None or self._started is None:
            return
        kept = chooser.kept
        count = chooser.record(self._clock() - self._started)
        self._started = None
        if count is not None:
            torch.set_num_threads(count)
        if chooser.kept != kept:
            step = trainer.global_step
            self.changes.append((step, chooser.kept))
            times = ", ".join(f"{c} thread{'s' if c > 1 else ''} {s * 1e3:.1f} ms"
                              for c, s in sorted(chooser.last_probe.items(), reverse=True))
            log.info("CPU threads %d -> %d at step %d (median step: %s): %s", kept, chooser.kept, step, times,
                     "other work is holding cores" if chooser.kept < kept else "the cores are free again")
            for logger in trainer.loggers:
                logger.log_metrics({THREADS_METRIC: float(chooser.kept)}, step=step)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.chooser is not None:
            self.probed = dict(self.chooser.last_probe)
        if self._initial_threads is not None:
            torch.set_num_threads(self._initial_threads)  # the process as it was found
            self._initial_threads = None
        self.chooser = None


#: What :class:`FixedCpuThreads` keeps in a checkpoint (its ``state_dict``).
_THREADS_KEY, _WORLD_KEY = "threads", "world_size"


class FixedCpuThreads(Callback):
    """Holds torch's intra-op thread count for a run's whole life, and sets it again on resume.

    The count is the one the first launch of the run starts with; it is saved in every checkpoint, and a
    resume with the same world size sets it again (with one line when the new process would have used
    another), whatever the machine's load or core count. A resume at another world size keeps the
    launcher's division: its reductions differ anyway. The count is logged as ``cpu/threads`` at the
    run's start (and where a resume changes it), so ``recipes.reproduce`` can rerun with it. On a GPU
    run it does nothing.

    Args:
        threads: the count to hold on a fresh run; ``None``: torch's count when the fit starts.

    Raises:
        ValueError: for ``threads < 1``.

    Example::

        trainer = Trainer(accelerator="cpu", callbacks=[FixedCpuThreads()])
        trainer.fit(model, datamodule, ckpt_path=...)  # resumes with the count saved in the checkpoint
    """

    def __init__(self, threads: int | None = None) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"FixedCpuThreads(threads={threads!r}): expected a positive count.")
        self._requested = threads
        #: The count this run holds (``None`` until a CPU fit starts).
        self.threads: int | None = None
        self._saved: dict[str, int] | None = None
        self._world_size = 1
        self._initial_threads: int | None = None
        self._changed = True

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or not isinstance(trainer.accelerator, CPUAccelerator):
            self.threads = None
            return
        self._initial_threads = torch.get_num_threads()
        self._world_size = trainer.world_size
        self.threads = self._requested or self._initial_threads

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a resume's saved state is loaded between setup and here (before any training step)
        saved, self._saved = self._saved, None
        if self._initial_threads is None or self.threads is None:
            return
        self._changed = saved is None  # a first launch: its count is news
        if saved is not None and saved.get(_WORLD_KEY) == self._world_size:
            self.threads = int(saved[_THREADS_KEY])
            if self.threads != self._initial_threads and trainer.is_global_zero:
                log.info("CPU threads: %d, as this run started with (this process would have used %d), so that "
                         "the resumed run continues bitwise.", self.threads, self._initial_threads)
        elif saved is not None:
            self.threads = self._initial_threads  # another world size: the launcher's division stands
            self._changed = self.threads != saved.get(_THREADS_KEY)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # logged where the count starts or changes: a resume that holds it adds no point to the history
        if self._initial_threads is not None and self.threads is not None and self._changed:
            for logger in trainer.loggers:
                logger.log_metrics({THREADS_METRIC: float(self.threads)}, step=trainer.global_step)

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.threads is None:  # not a CPU fit
            return {}
        return {_THREADS_KEY: int(self.threads), _WORLD_KEY: int(self._world_size)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if _THREADS_KEY in state_dict and _WORLD_KEY in state_dict:
            self._saved = {k: int(state_dict[k]) for k in (_THREADS_KEY, _WORLD_KEY)}

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._initial_threads is not None:
            torch.set_num_threads(self._initial_threads)  # the process as it was found
            self._initial_threads = None
