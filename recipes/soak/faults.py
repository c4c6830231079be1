"""The soak's faults: the kinds, the plan drawn from the seed, the invariants, and the records of what happened.

Fault kinds (``--kinds``; the first ones of the schedule cover every kind, the rest are drawn at
random; every random choice comes from ``--seed`` and is made before the first launch). A *moment*
is seconds from a launch's start, drawn uniformly from one of three phases, chosen at random (one
for each state of the run's durable record): start-up (imports and the MLflow store, before the
launch's MLflow run is open: 0 to the time the reference launch wrote its ``config.yaml``, which the
CLI does as training sets up), early (from this launch's own write of it to its first periodic save)
or training (from its first step to its expected last save, from the reference run's step time
and the steps it has left):

- ``new_store_kill``: the first launch on the new MLflow store gets SIGKILL or SIGTERM 0-2 s after
  ``mlflow.db`` appears (creation and migration of the store); only ever the first fault. The relaunch
  must be able to use the store (if it cannot, the store is replaced by a sound one so that the other
  kinds can still be tested) and is itself SIGKILLed in its early phase: the run's first checkpoint
  does not exist yet, its MLflow run does.
- ``sigterm`` / ``sigkill``: the launch's process group is signalled at the moment.
- ``disk_full``: the run directory root is a small tmpfs mounted for the soak; at the moment it is
  filled to the last byte; the launch is waited for (SIGTERM if it is still running when it should
  have ended), then the disk is freed. Skipped, and said so, where ``mount`` is not permitted.
- ``corrupt``: between launches the newest good ``step=*.ckpt`` is truncated or has bytes flipped
  (if fewer than two good checkpoints exist, a setup launch runs until they do and is stopped by
  SIGTERM). One time in three the next launch first names it with ``--ckpt_path`` (it must be
  refused with exit 2 and a one-line error); then a plain launch must skip it and is stopped by a
  SIGTERM at a training-phase moment.
- ``double_launch``: the same command twice at once; the second must be refused with exit 2; the
  survivor is stopped by SIGTERM at a training-phase moment.

- ``bucket_outage`` (``--store s3`` only): every launch's run root is ``s3://atscale-chaos/...`` on moto's S3
  server on 127.0.0.1, reached through a proxy in the soak; at the moment the proxy fails every request, new and
  in flight, for 2-10 s (``reset``: connections cut; ``503``: ServiceUnavailable), one time in three with a
  SIGTERM half-way (the notice save uploads into the outage); then the bucket comes back and the launch is
  waited for (exit 0, 75, or 2 with one ``error:`` line when the bucket was down at its start; no traceback).

- ``skewed_rank`` (``--ddp`` only): the launch saves every 0.12 s of rank 0's clock (``--spot.every_minutes
  0.002``) while rank 1 is stopped for 20 ms of every 50 (SIGSTOP/SIGCONT from the soak): its clock lags and
  jumps as a busy machine's does; at the moment the group gets a SIGTERM. Ranks that decided timed saves from
  their own clocks hung here (``clean_exit``: no launch hangs).
- ``group_signal`` (``--workers`` > 0): at the moment the launch's whole process group (main process, loader
  workers, ranks) gets SIGTERM or SIGINT, as a VM's shutdown, SLURM or a terminal's Ctrl-C sends it: exit 75 after
  a notice save (or 130 / the signal's own code before training took the signals), never a traceback or a dead
  loader worker (``clean_exit``).
- ``default_name``: the run's command without ``--run_name`` (every run is named by its own command: the runs'
  commands differ by a ``--spot.drill_seed`` that trains nothing), SIGTERMed at the moment, as a scheduler that
  relaunches a job's command line: it must resume this run and open no other (``one_mlflow_run``).
- ``frozen_rank`` (``--ddp`` only): at the moment rank 1 is frozen (SIGSTOP) and, 2 s later, the launching
  process alone gets a SIGTERM (``--spot.notice_grace_s 5``): the watchdog must end the whole process group
  within the grace plus 15 s, with exit 75 and one ``atscale: hang:`` line naming rank 1 (``clean_exit``).

With ``chunk_damaged`` or ``dataset_replaced`` among the kinds, every launch (and the reference) streams the digits
set (``configs/digits-stream.yaml``, ``recipes.prepare digits --chunk_items 64``) from a folder of the chain's own,
so that the other kinds strike streamed runs too (:mod:`recipes.soak.dataset`):

- ``chunk_damaged``: 64 bytes are flipped in the training chunk that holds the run's last trained item (so every
  launch with training left reads it, after training on the chunks before it), before the launch (one time in
  three) or in its start-up (it has read no training chunk yet). The launch must stop with exit 65 and one
  ``atscale: ... is damaged: <chunk>: SHA-256 ...`` line, never 75; then the soak puts the prepared bytes back
  (what a user does after "prepare the data again") and the next launch, the same command, resumes.
- ``dataset_replaced``: the launch gets a notice after a step drawn from the steps it has left (a fire drill,
  ``--spot.drill_steps``: a real SIGTERM at a step, not at a moment, which the 16 ms steps often outran); it must
  exit 75 after the notice save, whose checkpoint holds the data's index digest. Then the folder at the run's URL
  is replaced by the same set split with another seed (``--split_seed 1``); the same command must be refused
  (exit 2, one ``atscale:`` line naming both index digests) without training a step, the MLflow run left KILLED;
  then the original folder goes back for the next launch. (Not applied when the stopped launch did not exit 75.)

With ``--store s3`` every other kind runs on the object-storage run too (the staging directory is local), the
expected resume point is what the CLI picks between the bucket and the staging directory, and two more checks
apply: ``pointer_complete`` after every launch, and ``bitwise_equal`` on what the bucket's pointer names.

Invariants (each fault's problems name the one they break; the exit status is 1 if any breaks):

- ``finished``: after its last fault, a run's next launch exits 0;
- ``bitwise_equal``: ``torch.equal`` on every tensor of the state_dict of the newest good
  ``step=*.ckpt`` (or of a ``best-*`` checkpoint of a later step, when the soak corrupted the last
  ``step=*.ckpt`` of a run that had ended: what a relaunch resumes from), against the reference
  run's newest ``step=*.ckpt``, and the same global step;
- ``metric_history``: every metric key of the finished run, point for point (step and value), is the reference
  run's: nothing a kill or a notice cut out, nothing logged twice or extra. The keys that measure the clock or
  the interruptions themselves (``recipes.reproduce``'s ``DEFAULT_IGNORE``: time, cost, system, ``spot/*``)
  are left out; a run whose store the soak replaced after a store kill is exempt;
- ``one_mlflow_run``: exactly one MLflow run with the run's name, status FINISHED (and no launch
  creates a second one on the way);
- ``no_run_left_running``: no run of the experiment is RUNNING at the end;
- ``resumed_from_newest``: every launch that decides what to resume from (its "Resuming from ...
  (step N" line, or training from step 0 without one) takes the newest checkpoint that verifies
  when it starts (the soak checks records and hashes as the CLI does); a corrupt one is skipped;
- ``no_checkpoint_lost``: a checkpoint whose record verified when a fault struck and that is newer
  than what the struck launch resumed from is still there and verifies after that launch ended and
  after the next launch ended, unless the run's own pruning policy allows its removal at that point
  (a ``step=*`` checkpoint: ``SpotCheckpoint.keep`` newer good ``step=*`` checkpoints exist; a
  ``best-*`` one: a newer good ``best-*`` exists, as ``save_top_k=1``). Checkpoints the soak
  corrupts itself are exempt;
- ``clean_exit``: no launch hangs; exit codes are those of the kind (SIGTERM: 75 after a notice
  save or -15 before the handlers are installed; SIGKILL: -9; 0 when the run ended first); no
  Python traceback where a one-line error is due (full disk, corrupt checkpoint);
- ``double_launch_refused``: one of two simultaneous launches exits 2 before training, the other runs;
- ``store_usable``: the MLflow store has the reference store's schema version and tables, and
  no launch after a store kill fails on it.
- ``pointer_complete`` (``--store s3``): after every launch, the bucket's ``latest.json`` names a checkpoint
  whose record and every object are there with the recorded size and SHA-256 (read straight from moto).
- ``ledger``: the run's goodput ledger sums to its bill within 0.1 % and its redone steps and start-up agree
  with the faults and launches the soak saw (``recipes/soak/ledger.py`` states the tolerances).
- ``prepared_data_only`` (streamed runs): no launch trains on bytes other than the prepared ones: a launch that
  meets the damaged chunk stops (it never exits 0 over it), and one that meets the replaced dataset trains no step
  (with ``bitwise_equal``: the final weights are the reference's, which read only the prepared data);
- ``no_requeue_loop`` (streamed runs): damaged or replaced data is never answered with exit 75, which a scheduler
  requeues into the same data forever (65 and 2 are not requeued), and once the soak put the prepared data back no
  launch meets the damage or the other digest again.

How each kind is struck and checked is :class:`~recipes.soak.soak.Soak`'s; this module holds only what a fault
is, so that the report and the tests read it without the machinery.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("new_store_kill", "sigterm", "sigkill", "disk_full", "corrupt", "double_launch", "bucket_outage",
         "skewed_rank", "frozen_rank", "group_signal", "default_name", "chunk_damaged", "dataset_replaced")
#: Kinds that need loader workers (``--workers`` > 0).
WORKER_KINDS = ("group_signal",)
#: Kinds that need an object-storage run root (``--store s3``).
STORE_KINDS = ("bucket_outage",)
#: Kinds that need several ranks (``--ddp``).
RANK_KINDS = ("skewed_rank", "frozen_rank")
#: Kinds that strike the streamed data: with one of them every launch streams (:mod:`recipes.soak.dataset`).
DATA_KINDS = ("chunk_damaged", "dataset_replaced")
INVARIANTS = ("finished", "bitwise_equal", "metric_history", "one_mlflow_run", "no_run_left_running",
              "resumed_from_newest", "no_checkpoint_lost", "clean_exit", "double_launch_refused", "store_usable",
              "pointer_complete", "ledger", "prepared_data_only", "no_requeue_loop")
CORRUPTED = {"truncate": "truncated", "flip": "byte-flipped"}


@dataclass
class PlannedFault:
    """One fault as drawn from the seed before anything runs."""

    kind: str
    phase: str  # "startup", "early" or "training": where in a launch its moment falls
    u: float  # position inside the phase, in [0, 1) (dataset_replaced: of the steps the launch has left)
    signal: str  # new_store_kill: SIGKILL or SIGTERM
    corrupt_mode: str  # corrupt: "truncate" or "flip"
    explicit: bool  # corrupt: first name the corrupt file with --ckpt_path; chunk_damaged: damage before the launch
    cut: float  # corrupt: truncate to this fraction of the size / seed of the flipped offsets (chunk_damaged too)


def plan_faults(n: int, kinds: Sequence[str], seed: int) -> list[PlannedFault]:
    """``n`` faults: ``new_store_kill`` first if asked for, then every other kind once (shuffled), then random.

    Every fault draws the same random values whatever its kind, so a seed names one plan.
    """
    rng = random.Random(seed)
    rest = [k for k in kinds if k != "new_store_kill"]
    order = ["new_store_kill"] if "new_store_kill" in kinds else []
    cover = list(rest)
    rng.shuffle(cover)
    order += cover
    while rest and len(order) < n:
        order.append(rng.choice(rest))
    plan = []
    for kind in order[:n]:
        phase = rng.choice(("startup", "early", "training"))
        u, sig, mode, explicit, cut = (rng.random(), rng.choice(("SIGKILL", "SIGTERM")),
                                       rng.choice(("truncate", "flip")), rng.random() < 1 / 3, rng.random())
        if kind in ("corrupt", "double_launch", "dataset_replaced", *RANK_KINDS):
            phase = "training"  # the launch must get as far as deciding (skip, refuse) before it is stopped
        elif kind == "chunk_damaged":
            phase = "startup"  # the launch has read no training chunk yet: it verifies the damaged one when it reads it
        plan.append(PlannedFault(kind, phase, u, sig, mode, explicit, cut))
    return plan


def corrupt(path: Path, mode: str, cut: float) -> dict[str, Any]:
    """Truncate ``path`` to a fraction of its size, or flip 64 of its bytes at seeded offsets."""
    size = path.stat().st_size
    if mode == "truncate":
        new_size = int(size * cut * 0.9)
        os.truncate(path, new_size)
        return {"mode": "truncate", "size": size, "new_size": new_size}
    rng = random.Random(cut)
    offsets = sorted(rng.sample(range(size), min(64, size)))
    with open(path, "r+b") as handle:
        for offset in offsets:
            handle.seek(offset)
            byte = handle.read(1)
            handle.seek(offset)
            handle.write(bytes([byte[0] ^ 0xFF]))
    return {"mode": "flip", "size": size, "flipped": len(offsets)}


@dataclass
class Fault:
    """A fault as it happened."""

    index: int
    kind: str
    run_name: str
    phase: str | None
    moment_s: float | None = None  # seconds from the struck launch's start
    struck: bool = True  # False: the launch had ended before the moment
    exit_codes: list[int | None] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)
    launches: list[dict[str, Any]] = field(default_factory=list)
    furthest_step: int | None = None  # steps the struck launch(es) had logged
    resumable_after: int | None = None  # newest good step right after the fault (soak's view)
    next_resumed_from: int | None = None
    lost_steps: int | None = None  # from the loss history: a lower bound when a launch was SIGKILLed
    unlogged_max: int | None = 0  # the most steps the struck launch(es) ran past their history; None: unknown
    time_to_resume_s: float | None = None
    next_launch_wall_s: float | None = None
    problems: list[dict[str, str]] = field(default_factory=list)
    corrupted_after: bool = field(default=False, repr=False)

    @property
    def held(self) -> bool:
        return not self.problems

    def fail(self, invariant: str, detail: str) -> None:
        assert invariant in INVARIANTS, invariant
        self.problems.append({"invariant": invariant, "detail": detail})


@dataclass
class Watch:
    """Checkpoints that verified when fault ``fault`` struck and are newer than what its launch resumed from."""

    fault: Fault
    items: dict[str, int]
    observations_left: int = 2  # after the struck launch ended, and after the next launch ended


@dataclass
class RunState:
    name: str
    faults: list[int] = field(default_factory=list)
    finished: bool = False  # a launch exited 0
    mlflow_runs: int = 0
    finish_launches: list[dict[str, Any]] = field(default_factory=list)
    checks: dict[str, Any] = field(default_factory=dict)
    problems: list[dict[str, str]] = field(default_factory=list)

    def fail(self, invariant: str, detail: str) -> None:
        assert invariant in INVARIANTS, invariant
        self.problems.append({"invariant": invariant, "detail": detail})
