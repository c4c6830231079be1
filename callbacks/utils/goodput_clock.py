"""CostTracker's goodput ledger clock: every second of a launch filed under what the loop was doing.

The clock holds a *mark* (the monotonic time up to which everything is filed) and a *context*; each hook of
the training loop files the seconds since the mark under the context's category and moves the mark, so the
categories of a launch add up to its clock exactly. Contexts: ``startup`` (until the first batch starts; the
sanity check included), ``step`` (a batch's start to its end), ``between`` (a step's end to the next start:
data wait), ``validation``, ``checkpoint`` (inside
``trainer.save_checkpoint``), ``tail`` (after training ended). The seconds between the last step and the end
of training go to ``tail``: the seconds between two steps are filed when the next step starts, under its
category, or as ``tail`` when training ends first.

Steps a relaunch reruns (up to ``redo_until``) are filed as productive, the run that counts (their lost
first runs are ``redone``, charged from the gap by the callback); their measured seconds are also tallied in
``rerun_s`` and ``rerun_steps`` for the report. A launch's first step is kept apart (``first_steps``): its
time above the run's mean step is start-up (see :func:`callbacks.analysis.goodput.resolve_first_steps`).
No torch, no Lightning: the callback passes times in.
"""

from __future__ import annotations

from typing import Any

from ..analysis import goodput

__all__ = ["GoodputClock"]


class GoodputClock:
    """The ledger of the job before this launch, the gap before it, and this launch's filed seconds.

    Args:
        start: the monotonic time this launch's bill clock started at (the first mark).
    """

    def __init__(self, start: float) -> None:
        self.base = goodput.Ledger()  # the job before this launch (restored from the checkpoint)
        self.first_steps: list[tuple[str, float, float]] = []  # (category, s, instance-s), one per launch
        self.gap = goodput.Ledger()  # the billed gap before this launch, once split at train start
        self.rerun_s = 0.0  # measured seconds of the reruns of lost steps (the job's; their wait before included)
        self.rerun_steps = 0
        self.reset(start)

    def reset(self, start: float) -> None:
        """Start this launch's filing over at ``start`` (a new launch, or one that resumed its own save)."""
        self.attempt: dict[str, float] = {}
        self.context = "startup"
        self.mark = start
        self.step_s = 0.0  # the step in progress (the batches of an accumulated step)
        self.step_category = "productive"
        self.rerun = False  # the step in progress reruns a lost step
        self.first_pending = True
        self.redo_until = -1  # steps up to this global step are reruns
        self.between_s = 0.0  # since the last step ended (outside validation and saves): filed at the next start

    def category(self, context: str) -> str:
        """The ledger category of the seconds spent in ``context``."""
        if context == "between":
            return "data_wait"
        if context == "step":
            return self.step_category
        return context  # startup, validation, checkpoint, tail

    def file(self, now: float) -> None:
        """File the seconds since the mark under the current context, and move the mark to ``now``."""
        seconds = max(0.0, now - self.mark)
        self.mark = now
        if self.context == "step":
            self.step_s += seconds
        elif self.context == "between":
            self.between_s += seconds
        else:
            self._add(self.category(self.context), seconds)

    def _add(self, category: str, seconds: float) -> None:
        self.attempt[category] = self.attempt.get(category, 0.0) + seconds

    def enter(self, context: str, now: float) -> str:
        """File up to ``now``, then switch to ``context``; returns the context left."""
        self.file(now)
        left, self.context = self.context, context
        return left

    def step_start(self, now: float, next_step: int) -> None:
        """A batch of optimizer step ``next_step`` starts."""
        self.rerun = next_step <= self.redo_until
        self.enter("step", now)
        if self.rerun:
            self.rerun_s += self.between_s
        self._add(self.category("between"), self.between_s)
        self.between_s = 0.0

    def step_end(self, now: float, stepped: bool, instances: float) -> None:
        """A batch ended; ``stepped``: it completed an optimizer step, which goes into the ledger."""
        self.enter("between", now)
        if not stepped:
            return
        seconds, self.step_s = self.step_s, 0.0
        if self.rerun:
            self.rerun_s += seconds
            self.rerun_steps += 1
        if self.first_pending:
            self.first_pending = False
            self.first_steps.append((self.step_category, seconds, seconds * instances))
        else:
            self._add(self.step_category, seconds)

    def train_end(self, now: float) -> None:
        """Training is over: the time since the last step (saves and validation apart) is its end (``tail``)."""
        self.file(now)
        self._add("tail", self.between_s)
        self.between_s = 0.0
        self.context = "tail"

    def raw(self, now: float, instances: float, gap_s: float) -> goodput.Ledger:
        """The job's ledger at ``now``, the first steps apart (the seconds since the mark under the context).

        Args:
            now: monotonic time of the reading.
            instances: instances this launch is billed on.
            gap_s: the billed gap before this launch (filed as ``restart`` until train start splits it).
        """
        attempt = goodput.Ledger()
        for category, seconds in self.attempt.items():
            attempt.add(category, seconds, instances)
        pending = max(0.0, now - self.mark)
        if self.context == "step" or self.step_s:
            attempt.add(self.step_category, self.step_s + (pending if self.context == "step" else 0.0), instances)
        between = self.between_s + (pending if self.context == "between" else 0.0)
        if between:  # live: as data wait (or a rerun's), which it is unless training ends next
            attempt.add(self.category("between"), between, instances)
        if self.context not in ("step", "between"):
            attempt.add(self.category(self.context), pending, instances)
        gap = self.gap
        if gap_s - gap.total_s() > 0:  # before train start split it
            gap = gap.merged(goodput.split_gap(gap_s - gap.total_s(), 0.0, instances))
        return self.base.merged(gap, attempt)

    def ledger(self, now: float, instances: float, gap_s: float, mean_step_s: float | None,
               comm_share: float, lost_steps: int) -> goodput.Ledger:
        """The job's ledger at ``now``: first steps charged at ``mean_step_s``, exposed comm carved out, and the
        ``lost_steps``' first runs charged as ``redone`` out of the gaps."""
        out = goodput.resolve_first_steps(self.raw(now, instances, gap_s), self.first_steps, mean_step_s)
        return goodput.charge_redone(goodput.carve_comm(out, comm_share), lost_steps, mean_step_s)

    def state(self, now: float, instances: float, gap_s: float) -> dict[str, Any]:
        """What a checkpoint keeps (plain types)."""
        return {"goodput": self.raw(now, instances, gap_s).state(),
                "goodput_first_steps": [list(f) for f in self.first_steps],
                "goodput_reruns": [self.rerun_s, self.rerun_steps]}

    def load(self, state: dict[str, Any], billed_s: float, instance_s: float) -> None:
        """Restore the job's ledger from a checkpoint's state (``billed_s``: its bill, for one without a ledger)."""
        if "goodput" in state:
            self.base = goodput.Ledger.from_state(state["goodput"])
            self.first_steps = [(str(c), float(s), float(i)) for c, s, i in state.get("goodput_first_steps", [])]
            seconds, steps = state.get("goodput_reruns", [0.0, 0])
            self.rerun_s, self.rerun_steps = float(seconds), int(steps)
        else:  # a checkpoint from before the ledger: its seconds are billed, their causes unknown
            self.base = goodput.Ledger()
            self.base.add("unattributed", billed_s, instance_s / billed_s if billed_s > 0 else 1.0)
            self.first_steps = []
        self.gap = goodput.Ledger()
