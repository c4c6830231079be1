r"""What a run costs in dollars while it runs, across interruptions and resumes, spot versus on-demand.

``CostTracker`` bills the whole job's wall clock on every instance: start-up, validation,
checkpoint saves and restarts included, because that is what a cloud bills. Its clock starts when
the callback is **constructed** (``bill_from="construction"``), or when the launch started
(``bill_from="spawn"``, the CLI's setting: when ``python -m recipes.fit`` started, imports included, not when a
shell that ``exec``\ d it did; :mod:`callbacks.utils.launch_clock`), and runs until the last log at train end.

Across an interruption the bill continues, never resets. The callback's state in each checkpoint
(``state_dict``) holds the job's billed seconds at that save and the wall-clock time of the save
(``time.time()``). A relaunch that resumes from it bills the saved seconds plus the *restart gap*:
the wall time from that save to the relaunch's clock start. The gap holds the interrupted attempt's
work after its last save (lost, redone now), the time the job was down and the relaunch's
start-up; ``restart_s`` replaces it with a fixed number (e.g. when a scheduler queue is not billed,
or the machines' clocks disagree). Instance-seconds add up per attempt, so a relaunch on a
different number of instances is billed right.

Lost work is the steps run more than once. ``steps_run`` (every optimizer step executed, redone
ones included) always equals ``global_step + lost_steps``, so a checkpoint's state needs only its
``lost_steps``. What the checkpoint cannot know is how far attempts got *after* it: for that, rank
zero keeps a tiny sidecar file, ``cost_steps_run.txt`` beside the checkpoints, holding the job's
``steps_run``, rewritten in place at every optimizer step (one fixed-width ``pwrite``, a few
microseconds; it survives a killed process, and also a lost machine once the OS has flushed it,
within seconds). At resume from step ``g`` with saved ``lost_steps`` ``L``::

    lost_steps = max(L, sidecar_steps_run - g)

which counts every attempt since the checkpoint, also attempts killed before they saved anything
(their work is in the sidecar, not in any checkpoint). This is exact to the step, needs no logger
and no MLflow query, unlike a metric history, which is only as fine as its logging cadence. The
work lost costs ``lost_steps x mean step time x instances x price``, the mean step time being the
time from one optimizer step's end to the next (data wait included; validation, checkpoint saves and
each launch's first step excluded) over the job's steps so far.

The projection is ``spent + remaining steps x recent seconds per step x instances x price``, with
the recent speed measured over the last logging window (wall time, so validation and saves count)
and the remaining steps from ``trainer.estimated_stepping_batches`` (``max_steps`` or
``max_epochs`` x batches per epoch / accumulation). Prices come from the catalog
(``callbacks/analysis/prices.yaml``, see :mod:`callbacks.analysis.prices`); the arithmetic from
:mod:`callbacks.analysis.cost_model`.

Logged metrics (rank 0; every ``log_every_n_steps`` optimizer steps, at train start after a resume
and at train end):

==========================  =====================================================================
key                         meaning
==========================  =====================================================================
``cost/usd``                cost so far on the chosen market
``cost/usd_on_demand``      the same billed time at the on-demand price
``cost/usd_spot``           the same billed time at the spot price (absent without a spot price)
``cost/savings_pct``        ``100 (1 - spot/on-demand)`` (absent when on-demand is free or no spot)
``cost/lost_work_usd``      work redone after interruptions, on the chosen market
``cost/projected_usd``      expected cost at the end, at the current progress and speed
``cost/billed_s``           job wall seconds billed so far (per instance)
``cost/instances``          instances billed now
``cost/lost_steps``         optimizer steps run more than once
``cost/restart_s``          seconds of restart gaps billed
``goodput/<category>_s``    the billed seconds of one category of the goodput ledger (below)
``goodput/<category>_usd``  the same on the chosen market
``goodput/share``           productive seconds / billed seconds
==========================  =====================================================================

The goodput ledger (:mod:`callbacks.analysis.goodput` has the categories: productive, startup, redone,
checkpoint, validation, data_wait, comm_exposed, tail, restart) files every second of the bill's clock under
what the loop was doing (:mod:`callbacks.utils.goodput_clock`), so the categories sum to ``cost/billed_s``.
Checkpoint stalls are timed around ``trainer.save_checkpoint``; the exposed communication is ``StepTiming``'s
measured share of the step when it is in the trainer (found by its ``totals``; no import of it). At train end
``goodput.png`` (stacked bars in seconds, and in dollars on both markets) goes beside the checkpoints' folder
and to the MLflow run.

Copy with it (paths under ``callbacks/``, each folder with an ``__init__.py``):
``analysis/{cost_model,prices,goodput,keys}.py``, ``analysis/prices.yaml`` and
``utils/{steps_file,goodput_clock,launch_clock,compat,goodput_plot,cost_rows}.py``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from .analysis import goodput, keys
from .analysis.cost_model import run_cost, savings_pct
from .analysis.prices import MARKETS, Instance, get_instance, load_catalog, price_for, with_overrides
from .utils.compat import time_every_save
from .utils.cost_rows import CostRows
from .utils.goodput_clock import GoodputClock
from .utils.launch_clock import launch_age_s
from .utils.steps_file import PROGRESS_FILE, StepsFile, read_first_launch, read_steps_run, write_first_launch

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

log = logging.getLogger(__name__)

def default_instances(instance: Instance, world_size: int, num_nodes: int) -> int:
    """Instances a job occupies: one per node, and enough GPU instances for its devices.

    Args:
        instance: The catalog row (a machine without GPUs counts as one machine per node).
        world_size: Processes (devices) in the job.
        num_nodes: Nodes in the job.

    Returns:
        ``num_nodes`` for a machine without GPUs, else ``max(num_nodes, ceil(world_size / gpus))``.
    """
    if instance.gpus == 0:
        return max(1, int(num_nodes))
    return max(1, int(num_nodes), math.ceil(world_size / instance.gpus))


class CostTracker(CostRows, Callback):
    """Log what the run costs so far, on both markets, what interruptions wasted, and what it will cost.

    Args:
        instance: Instance name in the price catalog (``cpu-local`` costs nothing).
        market: ``"on_demand"`` or ``"spot"``: the market ``cost/usd`` is billed at.
        catalog: A price catalog YAML; None for the repository's ``callbacks/analysis/prices.yaml``.
        price_on_demand: Override the on-demand USD per instance-hour.
        price_spot: Override the spot USD per instance-hour.
        instances: Instances billed; None derives it at setup from the world size, the number of nodes
            and the instance's GPUs (:func:`default_instances`).
        restart_s: Seconds billed per resume instead of the measured gap from the checkpoint's save to
            the relaunch's start (None: measured).
        log_every_n_steps: Log every this many optimizer steps; None: the trainer's ``log_every_n_steps``.
        bill_from: ``"construction"``: the bill's clock starts when this object is built (the CLI builds it
            after importing torch and Lightning); ``"spawn"``: at the launch's start (the mark
            ``python -m recipes.fit`` leaves before its imports, its launcher's for the ranks it starts; else the
            process's spawn on Linux; elsewhere at construction), so a launch's imports are billed and show as
            start-up in the goodput ledger.
            A relaunch's spawn-to-construction seconds are in its billed restart gap either way; the
            ledger files them under start-up.
        plot: write ``goodput.png`` (the ledger as stacked bars, dollars on both markets) to the run
            directory and the MLflow run at train end.

    Raises:
        ValueError: For an unknown instance or market, a negative price, a market without a price in
            the catalog, ``instances < 1``, a negative ``restart_s``, ``log_every_n_steps < 1`` or an
            unknown ``bill_from``; the message names the value.
        FileNotFoundError: If ``catalog`` does not exist.

    Example::

        trainer = Trainer(callbacks=[CostTracker(instance="a3-highgpu-1g", market="spot")])
        trainer.fit(model, datamodule=datamodule)  # logs cost/usd, cost/usd_on_demand, cost/usd_spot ...
    """

    def __init__(
        self,
        instance: str = "cpu-local",
        market: Literal["on_demand", "spot"] = "on_demand",
        catalog: str | None = None,
        price_on_demand: float | None = None,
        price_spot: float | None = None,
        instances: int | None = None,
        restart_s: float | None = None,
        log_every_n_steps: int | None = None,
        bill_from: Literal["construction", "spawn"] = "construction",
        plot: bool = True,
    ) -> None:
        # the clock starts now: right after process start in the CLI
        self._t0_mono = time.monotonic()
        self._t0_wall = time.time()
        if bill_from not in ("construction", "spawn"):
            raise ValueError(f"CostTracker(bill_from={bill_from!r}) must be 'construction' or 'spawn'.")
        self._spawn_s = launch_age_s() or 0.0  # the launch's start -> this clock start
        if bill_from == "spawn":
            self._t0_mono -= self._spawn_s
            self._t0_wall -= self._spawn_s
        if market not in MARKETS:
            raise ValueError(f"CostTracker(market={market!r}) must be one of {MARKETS}.")
        try:
            row = get_instance(load_catalog(catalog), instance)
        except KeyError as err:
            raise ValueError(f"CostTracker(instance={instance!r}): {err.args[0]}") from None
        try:
            row = with_overrides(row, price_on_demand, price_spot)
            self.price = price_for(row, market)
        except ValueError as err:
            raise ValueError(f"CostTracker: {err}") from None
        if instances is not None and (isinstance(instances, bool) or int(instances) != instances or instances < 1):
            raise ValueError(f"CostTracker(instances={instances!r}) must be an integer >= 1.")
        if restart_s is not None and not (restart_s >= 0 and math.isfinite(restart_s)):
            raise ValueError(f"CostTracker(restart_s={restart_s!r}) must be a finite number of seconds >= 0.")
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"CostTracker(log_every_n_steps={log_every_n_steps!r}) must be >= 1.")
        self.instance = row
        self.market = market
        self.instances = None if instances is None else int(instances)
        self.restart_s = restart_s
        self.log_every_n_steps = log_every_n_steps
        self.bill_from = bill_from
        self.plot = plot
        self.plot_path: Path | None = None

        # The job so far, before this attempt's clock started (restored from a checkpoint).
        self._base_wall_s = 0.0
        self._base_instance_s = 0.0
        #: Dollars of the job before this attempt, each launch at its own instance's prices (None: that market
        #: had no price on some earlier launch's instance); and those launches' segments (see :meth:`segments`).
        self._base_usd: dict[str, float | None] = {"chosen": 0.0, "on_demand": 0.0, "spot": 0.0}
        self._earlier: list[dict[str, Any]] = []
        self._final_instance_s: float | None = None
        self._gap_s = 0.0  # restart gap billed at this attempt's start
        self.restart_s_total = 0.0
        self.lost_steps = 0
        self._step_s_total = 0.0
        self._steps_timed = 0
        self._warm = False  # this launch's first step is done (it is kept out of the mean step)
        self._step_pending_s = 0.0
        self._saves: list[tuple[float, float]] = []  # this batch's checkpoint saves (monotonic start, end)
        # This attempt only.
        self._restored: dict[str, Any] | None = None
        self._resumed_step: int | None = None
        self._seen_step = 0
        self._batch_start: float | None = None
        self._prev_end: float | None = None
        self._window: tuple[float, int] | None = None
        self._recent_step_s: float | None = None
        self._total_steps: float | None = None
        self._steps_file: StepsFile | None = None
        self._final: dict[str, float] = {}
        self._clock = GoodputClock(self._t0_mono)  # the goodput ledger (callbacks/analysis/goodput.py)
        self._undo_save_timing: Callable[[], None] | None = None
        self._comm_source: Any = None

    # ---------------------------------------------------------------- arithmetic
    def elapsed_s(self, now: float | None = None) -> float:
        """Seconds billed to this attempt at ``now`` (default: now): its restart gap plus its clock since its start."""
        return self._gap_s + ((time.monotonic() if now is None else now) - self._t0_mono)

    def billed_s(self, elapsed_s: float | None = None) -> float:
        """The job's wall seconds so far (per instance), all attempts and restart gaps included.

        Args:
            elapsed_s: This attempt's :meth:`elapsed_s`, when the caller has read the clock already.
        """
        return self._base_wall_s + (self.elapsed_s() if elapsed_s is None else elapsed_s)

    def instance_s(self, elapsed_s: float | None = None) -> float:
        """The job's instance-seconds so far: each attempt's seconds times its instances.

        Args:
            elapsed_s: This attempt's :meth:`elapsed_s`, when the caller has read the clock already.
        """
        return self._base_instance_s + (self.elapsed_s() if elapsed_s is None else elapsed_s) * (self.instances or 1)

    def usd(self, market: str | None = None, instance_s: float | None = None) -> float:
        """The job's cost with ``instance_s`` billed so far (default: now) on ``market`` (default: the chosen one):
        earlier launches at their own instance's prices, this launch's seconds at this instance's.

        Raises:
            ValueError: ``market`` has no price on this instance, or had none on an earlier launch's.
        """
        key = "chosen" if market is None else market
        base = self._base_usd.get(key)
        if base is None:
            raise ValueError(f"an earlier launch's instance has no {market} price")
        price = self.price if market is None else price_for(self.instance, market)
        spent = (self.instance_s() if instance_s is None else instance_s) - self._base_instance_s
        return base + run_cost(spent / 3600.0, price)

    def _usd_or_none(self, market: str | None, instance_s: float) -> float | None:
        try:
            return self.usd(market, instance_s)
        except ValueError:  # no price for that market here, or on an earlier launch's instance
            return None

    def segments(self, instance_s: float | None = None) -> list[dict[str, Any]]:
        """The job's bill by launch: ``{"instance", "market", "instances", "billed_s", "usd"}`` for each run of
        launches on one instance, market and count (a relaunch elsewhere starts a new one), this launch's last.

        A launch's segment holds its seconds up to its last checkpoint; what followed (the work lost, the time
        down, the relaunch's start-up: the restart gap) is billed with the relaunch, at its instance's price.
        """
        spent = (self.instance_s() if instance_s is None else instance_s) - self._base_instance_s
        now = {"instance": self.instance.name, "market": self.market, "instances": int(self.instances or 1),
               "billed_s": spent / float(self.instances or 1), "usd": run_cost(spent / 3600.0, self.price)}
        out = [dict(s) for s in self._earlier]
        if out and all(out[-1][k] == now[k] for k in ("instance", "market", "instances")):
            out[-1]["billed_s"] += now["billed_s"]
            out[-1]["usd"] += now["usd"]
        else:
            out.append(now)
        return out

    def mean_step_s(self) -> float | None:
        """Mean seconds per optimizer step over the job's timed steps, or None before the first."""
        return self._step_s_total / self._steps_timed if self._steps_timed else None

    def metrics(self, trainer: Trainer) -> dict[str, float]:
        """The ``cost/*`` values now (see the module docstring), from one reading of the clock."""
        now = time.monotonic()  # one reading for the bill and its ledger: they add up exactly
        elapsed = self.elapsed_s(now)
        instance_s = self.instance_s(elapsed)
        usd = self.usd(instance_s=instance_s)
        self._final_instance_s = instance_s  # the end table's launch rows add up to this reading
        out = {keys.COST_KEY: usd, keys.COST_ON_DEMAND_KEY: self.usd("on_demand", instance_s)}
        spot_price = self.instance.spot_usd_per_h
        if spot_price is not None and self._base_usd.get("spot") is not None:
            out[keys.COST_SPOT_KEY] = self.usd("spot", instance_s)
            if self.instance.on_demand_usd_per_h > 0:
                out[keys.SAVINGS_KEY] = savings_pct(spot_price, self.instance.on_demand_usd_per_h)
        instances = self.instances or 1
        step_s = self.mean_step_s()
        out[keys.LOST_WORK_KEY] = run_cost(self.lost_steps * (step_s or 0.0) / 3600.0, self.price, instances)
        recent = self._recent_step_s if self._recent_step_s is not None else step_s
        if self._total_steps is not None and recent is not None:
            remaining = max(0.0, self._total_steps - trainer.global_step)
            out[keys.PROJECTED_COST_KEY] = usd + run_cost(remaining * recent / 3600.0, self.price, instances)
        out.update({keys.BILLED_KEY: self.billed_s(elapsed), keys.INSTANCES_KEY: float(instances),
                    keys.LOST_STEPS_KEY: float(self.lost_steps), keys.RESTART_KEY: self.restart_s_total})
        # the ledger's dollars at the job's mean price per instance-hour: they add up to cost/usd across launches
        # on other instances (the seconds are what each category is)
        mean_price = usd / (instance_s / 3600.0) if instance_s > 0 else self.price
        out.update(goodput.metrics(self.ledger(now), mean_price))
        return out

    # ------------------------------------------------------------------ ledger
    def ledger(self, now: float | None = None) -> goodput.Ledger:
        """The job's goodput ledger at ``now`` (default: now): categories of :mod:`callbacks.analysis.goodput`, summing
        to the bill."""
        return self._clock.ledger(time.monotonic() if now is None else now, float(self.instances or 1), self._gap_s,
                                  self.mean_step_s(), self._comm_share(), self.lost_steps)

    def _comm_share(self) -> float:
        """Exposed communication / step time over the run's timed steps (StepTiming's totals), or 0."""
        source = self._comm_source
        totals = getattr(source, "totals", None)
        parts = getattr(source, "PARTS", None) or ("data", "forward", "backward", "comm_exposed", "optimizer")
        if not isinstance(totals, dict):
            return 0.0
        step = sum(float(totals.get(p, 0.0)) for p in parts)
        comm = float(totals.get("comm_exposed", 0.0))
        data = float(totals.get("data", 0.0))
        # the ledger's productive seconds hold forward, backward, comm and optimizer (its data wait is apart)
        compute = step - data
        return min(1.0, max(0.0, comm / compute)) if compute > 0 else 0.0

    def _wrap_save(self, trainer: Trainer) -> None:
        """Time every ``trainer.save_checkpoint`` as a checkpoint stall in the ledger."""
        if self._undo_save_timing is not None:
            return

        def timed(save: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            start = time.monotonic()
            outer = self._clock.enter("checkpoint", start)
            try:
                return save(*args, **kwargs)
            finally:
                end = time.monotonic()
                self._clock.enter(outer, end)
                self._saves.append((start, end))

        self._undo_save_timing = time_every_save(trainer, timed)

    # ------------------------------------------------------------------- logging
    def _log(self, trainer: Trainer) -> None:
        now = time.monotonic()
        if self._window is not None and trainer.global_step > self._window[1]:
            self._recent_step_s = (now - self._window[0]) / (trainer.global_step - self._window[1])
        self._window = (now, trainer.global_step)
        if not trainer.is_global_zero:
            return
        self._final = self.metrics(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(self._final, step=trainer.global_step)

    # ----------------------------------------------------------- sidecar file
    @staticmethod
    def _progress_dir(trainer: Trainer) -> Path:
        callback = trainer.checkpoint_callback
        if callback is not None and getattr(callback, "dirpath", None):
            return Path(callback.dirpath)
        return Path(trainer.default_root_dir) / "checkpoints"

    def _sidecar_steps_run(self, trainer: Trainer) -> int | None:
        places = [self._progress_dir(trainer) / PROGRESS_FILE]
        if trainer.ckpt_path:
            places.append(Path(trainer.ckpt_path).parent / PROGRESS_FILE)
        found = [n for n in (read_steps_run(p) for p in places) if n is not None]
        return max(found) if found else None

    def _write_progress(self, trainer: Trainer) -> None:
        if self._steps_file is not None:
            self._steps_file.write(trainer.global_step + self.lost_steps)

    def _close_progress(self) -> None:
        if self._steps_file is not None:
            self._steps_file.close()
            self._steps_file = None

    # ------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.instances is None:
            self.instances = default_instances(self.instance, trainer.world_size, trainer.num_nodes)
        self._wrap_save(trainer)
        # StepTiming (duck-typed: no import of it) measures the exposed communication the ledger carves out
        self._comm_source = next((cb for cb in trainer.callbacks
                                  if isinstance(getattr(cb, "totals", None), dict) and hasattr(cb, "mean_parts")),
                                 None)

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        self._resumed_step = int(checkpoint.get("global_step", 0))

    @override
    def on_train_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        clock = self._clock
        clock.file(time.monotonic())
        if clock.context != "startup":  # a later fit of this object: its start-up begins now
            clock.context, clock.first_pending = "startup", True
        self._seen_step = step
        self._window = (time.monotonic(), step)
        self._prev_end = None
        self._warm, self._step_pending_s, self._saves = False, 0.0, []
        try:
            total = float(trainer.estimated_stepping_batches)
        except Exception:  # e.g. accumulation that changes per epoch: no projection
            total = math.inf
        self._total_steps = total if math.isfinite(total) and total > 0 else None
        if self._resumed_step is not None and trainer.is_global_zero:
            if self._restored is None:
                log.warning("CostTracker: the checkpoint holds no cost state; billing starts over at step %d.",
                            step)
            saved_lost = int((self._restored or {}).get("lost_steps", 0))
            sidecar = self._sidecar_steps_run(trainer)
            self.lost_steps = max(saved_lost, (sidecar or 0) - step)
            redo = self.lost_steps - saved_lost
            self._clock.redo_until = step + redo
            spawn = self._spawn_s if self.bill_from == "construction" and self._gap_s > 0 else 0.0
            if self.restart_s is not None:
                spawn = 0.0  # a fixed restart bill says nothing of what the gap held
            self._clock.gap = goodput.split_gap(self._gap_s, spawn, float(self.instances or 1))
        elif trainer.is_global_zero:
            self._bill_earlier_launches(trainer)
        if trainer.is_global_zero:
            self._steps_file = StepsFile(self._progress_dir(trainer))
            self._write_progress(trainer)
            if self._resumed_step is not None:
                self._log(trainer)

    def _bill_earlier_launches(self, trainer: Trainer) -> None:
        """A start without a checkpoint: bill the launches of this run that died before writing one.

        Their time is nowhere in a checkpoint; the first one's start is recorded beside the steps file. The time
        from it to this launch's start is billed as a restart gap (what those launches ran, then the time down)
        and their steps as redone work, as a resume from a checkpoint of step 0 saved at that start would be. A
        record of another MLflow run (a failed first launch whose corrected relaunch opened a new run) is not
        carried over.
        """
        directory = self._progress_dir(trainer)
        run_id = next((str(rid) for lg in trainer.loggers if (rid := getattr(lg, "run_id", None))), "")
        first = read_first_launch(directory)
        if first is None or first[1] != run_id or first[0] >= self._t0_wall:
            write_first_launch(directory, self._t0_wall, run_id)
            return
        ran = read_steps_run(directory / PROGRESS_FILE) or 0
        self._gap_s = self.restart_s if self.restart_s is not None else self._t0_wall - first[0]
        self.restart_s_total = self._gap_s
        self.lost_steps = ran
        self._clock.redo_until = trainer.global_step + ran
        self._clock.gap = goodput.split_gap(self._gap_s, 0.0, float(self.instances or 1))
        log.warning("CostTracker: earlier launches of this run ended before any checkpoint (%d steps lost); "
                    "billing the %.1f s since the first one's start as a restart.", ran, self._gap_s)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self._prev_end = None

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._batch_start = time.monotonic()
        self._clock.step_start(self._batch_start, trainer.global_step + 1)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        now = time.monotonic()
        start = self._prev_end if self._prev_end is not None else self._batch_start
        if start is not None:  # the batch's time less the checkpoint saves in it (a stall, not the step)
            saves = sum(max(0.0, min(b, now) - max(a, start)) for a, b in self._saves)
            self._step_pending_s += max(0.0, now - start - saves)
        self._saves = []
        self._prev_end = now
        stepped = trainer.global_step - self._seen_step
        self._clock.step_end(now, stepped > 0, float(self.instances or 1))
        if stepped <= 0:  # gradient accumulation: this batch's time belongs to the coming step
            return
        self._seen_step = trainer.global_step
        if self._warm:  # a launch's first step (lazy initialization, compilation) is not a typical step
            self._step_s_total += self._step_pending_s
            self._steps_timed += stepped
        self._warm, self._step_pending_s = True, 0.0
        self._write_progress(trainer)
        every = self.log_every_n_steps or trainer.log_every_n_steps or 1
        if trainer.global_step % every == 0:
            self._log(trainer)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self._prev_end = None  # validation is not step time (it is billed all the same)
        if self._clock.context not in ("startup", "validation"):  # the sanity check is start-up
            self._clock.enter("validation", time.monotonic())

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        if self._clock.context == "validation":
            self._clock.enter("between", time.monotonic())

    @override
    def on_train_end(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        self._clock.train_end(time.monotonic())
        self._log(trainer)
        if trainer.is_global_zero:
            self._tag_segments(trainer)
        if self.plot and trainer.is_global_zero and self._final:
            self.plot_at_train_end(trainer)

    @override
    def on_exception(self, trainer: Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if trainer.is_global_zero and self._window is not None:
            try:
                self._log(trainer)
            except Exception:  # never mask the run's own error
                log.warning("CostTracker: could not log the cost after the failure.", exc_info=True)

    @override
    def teardown(self, trainer: Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close_progress()
        if self._undo_save_timing is not None:
            self._undo_save_timing()
            self._undo_save_timing = None
        self._restored = self._resumed_step = None  # a later fit of this object resumes only if it loads

    # ------------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        now = time.monotonic()
        elapsed = self._gap_s + (now - self._t0_mono)
        instance_s = self.instance_s(elapsed)
        return {
            **self._clock.state(now, float(self.instances or 1), self._gap_s),
            "billed_s": self.billed_s(elapsed),
            "instance_s": instance_s,
            "usd": {key: self._usd_or_none(None if key == "chosen" else key, instance_s)
                    for key in ("chosen", "on_demand", "spot")},
            "segments": self.segments(instance_s),
            "saved_at": time.time(),
            "lost_steps": self.lost_steps,
            "restart_s_total": self.restart_s_total,
            "step_s_total": self._step_s_total,
            "steps_timed": self._steps_timed,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)
        saved_at = float(state_dict["saved_at"])
        if saved_at > self._t0_wall:
            # This object's clock already ran when that checkpoint was saved (a second fit in one
            # process): the saved seconds cover it up to the save, so count this attempt from there.
            self._t0_mono += saved_at - self._t0_wall
            self._t0_wall = saved_at
            self._gap_s = 0.0
            self._clock.reset(self._t0_mono)
        else:
            self._gap_s = self.restart_s if self.restart_s is not None else self._t0_wall - saved_at
        self._base_wall_s = float(state_dict["billed_s"])
        self._base_instance_s = float(state_dict["instance_s"])
        saved_usd = state_dict.get("usd")
        if isinstance(saved_usd, dict):  # each earlier launch at its own instance's prices
            self._base_usd = {k: None if saved_usd.get(k) is None else float(saved_usd[k])
                              for k in ("chosen", "on_demand", "spot")}
        else:  # a checkpoint that kept seconds only: they are priced as this instance's
            prices = {"chosen": self.price, "on_demand": self.instance.on_demand_usd_per_h,
                      "spot": self.instance.spot_usd_per_h}
            self._base_usd = {k: None if p is None else run_cost(self._base_instance_s / 3600.0, p)
                              for k, p in prices.items()}
        self._earlier = [dict(s) for s in state_dict.get("segments") or []]
        self.restart_s_total = float(state_dict.get("restart_s_total", 0.0)) + self._gap_s
        self.lost_steps = int(state_dict.get("lost_steps", 0))
        self._step_s_total = float(state_dict.get("step_s_total", 0.0))
        self._steps_timed = int(state_dict.get("steps_timed", 0))
        self._clock.load(state_dict, self._base_wall_s, self._base_instance_s)
