"""The streamed dataset of the ``chunk_damaged`` and ``dataset_replaced`` faults: prepared once, damaged, put back.

With either kind in the soak, every launch (and the reference) streams the digits set with
``configs/digits-stream.yaml`` from a folder, as ``python -m recipes.prepare digits --chunk_items 64`` writes it.
:class:`Dataset` prepares it once per soak (and, for ``dataset_replaced``, the same set split with another seed),
gives each chain a copy of its own (the faults change it), flips bytes in one chunk and puts the prepared bytes
back, swaps the copy for the other split and back.

Which chunk is damaged: the one holding the last item the run trains (:func:`last_read_chunk`, from the order
``datamodules.streaming.ChunkOrder`` walks), so that every launch with training left reads it after training on
the chunks before it, and verifies it then (a launch verifies a chunk when it first reads it). The judges
(:func:`judge_damaged`, :func:`judge_replaced`) say which invariant a launch broke from what it printed: the one
line and exit code of ``datamodules.verified_chunks`` (damage: 65) and ``datamodules.streaming`` (other data: 2).
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from callbacks.spot import REQUEUE_EXIT_CODE
from recipes.run.common import USAGE_EXIT_CODE
from recipes.soak.faults import corrupt
from recipes.soak.launch import last_error

__all__ = ["DAMAGED_EXIT_CODE", "Dataset", "data_stop_line", "first_step_with", "judge_damaged", "judge_replaced",
           "last_read_chunk", "samples_per_pass"]

#: ``datamodules.verified_chunks.DAMAGED_EXIT_CODE`` (restated: the soak's judges need no torch import).
DAMAGED_EXIT_CODE = 65
#: What starts the line of a run stopped on damaged data, and of one refused on other data (after the URL).
DAMAGED_LINE = "atscale: the streamed data at "
REPLACED_LINE = "atscale: the data at "


def samples_per_pass(items: int, batch_size: int, world: int, batches: int = 0) -> int:
    """Positions of the order one pass trains over all ranks (``limit_train_batches`` = ``batches``; 0: all).

    As ``datamodules.loaders.stateful_train_loader`` counts them: each rank takes ``ceil(items / world)`` samples a
    whole pass, in batches of ``batch_size``; a limit keeps that many batches of every rank.
    """
    per_rank_batches = math.ceil(math.ceil(items / world) / batch_size)
    if batches:
        per_rank_batches = min(per_rank_batches, batches)
    return min(items, per_rank_batches * batch_size * world)


def last_read_chunk(chunk_sizes: Sequence[int], window: int, seed: int, passes: int, per_pass: int) -> int:
    """The chunk holding the last item the run trains: position ``per_pass - 1`` of the last pass's order.

    Pass ``p`` walks ``ChunkOrder(chunk_sizes, window)(seed + p)``; a launch that has any step left reads that item,
    so it reads (and verifies) its chunk.
    """
    from datamodules.streaming import ChunkOrder

    order = ChunkOrder(chunk_sizes, window)(seed + passes - 1)
    starts = list(itertools.accumulate(chunk_sizes, initial=0))
    return bisect.bisect_right(starts, order[per_pass - 1]) - 1


def first_step_with(chunk: int, chunk_sizes: Sequence[int], window: int, seed: int, passes: int, per_pass: int,
                    global_batch: int, from_step: int) -> int | None:
    """The first optimizer step at or after ``from_step`` whose batch holds an item of ``chunk`` (None: none left).

    Step ``k`` of a pass trains positions ``[k * global_batch, (k + 1) * global_batch)`` of its order (every rank a
    batch, side by side); a pass has ``ceil(per_pass / global_batch)`` steps.
    """
    from datamodules.streaming import ChunkOrder

    steps = math.ceil(per_pass / global_batch)
    starts = list(itertools.accumulate(chunk_sizes, initial=0))
    items = range(starts[chunk], starts[chunk + 1])
    orders = ChunkOrder(chunk_sizes, window)
    for number in range(from_step // steps, passes):
        for position, item in enumerate(orders(seed + number)[:per_pass]):
            step = number * steps + position // global_batch
            if step >= from_step and item in items:
                return step
    return None


def data_stop_line(stderr: str) -> str | None:
    """The line of a launch stopped on damaged data or refused on other data, or None."""
    def stopped(line: str) -> bool:
        return ((line.startswith(DAMAGED_LINE) and " is damaged: " in line)
                or (line.startswith(REPLACED_LINE) and " this run began with" in line))

    return next((line for line in stderr.splitlines() if stopped(line)), None)


def judge_damaged(exit_code: int | None, stderr: str, url: str, name: str, trained_to: int | None = None,
                  first_damaged: int | None = None) -> list[tuple[str, str]]:
    """``(invariant, why)`` for each one a launch broke that met chunk ``name`` of ``url``'s training split damaged.

    Expected: exit 65 and exactly one ``atscale:`` line, the one naming the chunk, having completed no step past
    ``first_damaged`` (the first step whose batch holds an item of the chunk; ``trained_to``: the steps its logged
    losses say it completed). 75 is a requeue into the same bytes (``no_requeue_loop``); 0 means it trained past
    the chunk it must read (``prepared_data_only``).
    """
    lines = [line for line in stderr.splitlines() if line.startswith("atscale:")]
    if trained_to is not None and first_damaged is not None and trained_to > first_damaged:
        return [("prepared_data_only", f"it completed step {trained_to}, past step {first_damaged} whose batch holds "
                                       f"items of the damaged {name}")]
    if exit_code == REQUEUE_EXIT_CODE:
        return [("no_requeue_loop", f"exited {REQUEUE_EXIT_CODE} on the damaged {name}: a scheduler requeues that "
                                    f"code and every relaunch meets the same bytes ({last_error(stderr)})")]
    if exit_code == 0:
        return [("prepared_data_only", f"exited 0: it trained to the end, over the damaged {name} it must read, "
                                       "without stopping")]
    if exit_code != DAMAGED_EXIT_CODE:
        return [("clean_exit", f"exited {exit_code} on the damaged {name}, not {DAMAGED_EXIT_CODE} with one line "
                               f"naming it: {last_error(stderr)}")]
    prefix = f"{DAMAGED_LINE}{url}/train is damaged: {name}: SHA-256 "
    problems = []
    if len(lines) != 1 or not lines[0].startswith(prefix):
        problems.append(("clean_exit", f"exit {DAMAGED_EXIT_CODE} without the one line naming {name} "
                                       f"({prefix!r}...): {lines[:3]}"))
    if "Traceback (most recent call last)" in stderr:
        problems.append(("clean_exit", f"exit {DAMAGED_EXIT_CODE} with a Python traceback: {last_error(stderr)}"))
    return problems


def judge_replaced(exit_code: int | None, stderr: str, url: str, now: str, began: str, trained: int | None,
                   statuses: Sequence[str]) -> list[tuple[str, str]]:
    """``(invariant, why)`` for each one broken by a relaunch that found other data (index digest ``now``) at
    ``url`` than its run began with (``began``).

    Expected: exit 2, exactly one ``atscale:`` line naming both digests, no training step logged (``trained``: the
    steps it logged, None if none), and the run's one MLflow run left KILLED (``statuses``).
    """
    problems = []
    if trained:
        problems.append(("prepared_data_only", f"it trained {trained} step(s) on the replacement (index digest "
                                               f"{now[:12]}, not {began[:12]})"))
    if exit_code == REQUEUE_EXIT_CODE:
        problems.append(("no_requeue_loop", f"exited {REQUEUE_EXIT_CODE} on the replaced data: a scheduler requeues "
                                            f"that code into the same data ({last_error(stderr)})"))
    elif exit_code == 0 and not trained:
        problems.append(("prepared_data_only", "exited 0 on the replaced data, not refused"))
    elif exit_code not in (0, USAGE_EXIT_CODE):
        problems.append(("clean_exit", f"exited {exit_code} on the replaced data, not {USAGE_EXIT_CODE} with one "
                                       f"line naming both digests: {last_error(stderr)}"))
    else:
        lines = [line for line in stderr.splitlines() if line.startswith("atscale:")]
        prefix = f"{REPLACED_LINE}{url} has index digest {now[:12]}, not the {began[:12]} this run began with: "
        if exit_code == USAGE_EXIT_CODE and (len(lines) != 1 or not lines[0].startswith(prefix)):
            problems.append(("clean_exit", f"exit {USAGE_EXIT_CODE} without the one line naming both digests "
                                           f"({prefix!r}...): {lines[:3]}"))
    if list(statuses) != ["KILLED"]:
        problems.append(("clean_exit", f"the run's MLflow run(s) after the refusal: {list(statuses)} (expected one, "
                                       "KILLED: stopped, resumable once the data is back)"))
    return problems


class Dataset:
    """The digits set the soak's streamed launches read: prepared once, a copy per chain, damaged and put back.

    Args:
        repo: the checkout whose ``recipes.prepare`` and ``configs/digits-stream.yaml`` are used.
        sources: where the prepared sets are kept (shared by the chains; never changed once prepared).
        folder: this chain's copy, the ``--data.url`` of its launches.
    """

    CONFIG = "configs/digits-stream.yaml"
    CHUNK_ITEMS = 64
    #: ``--split_seed`` of the replacement: the same images, split otherwise (other chunks, another index digest).
    OTHER_SPLIT_SEED = 1

    def __init__(self, repo: Path, sources: Path, folder: Path) -> None:
        self.repo = repo
        self.prepared = sources / "prepared" / "digits"
        self.other = sources / "other" / "digits"
        self.folder = folder
        self.aside = folder.with_name(f"{folder.name}.original")
        self._digests: dict[Path, str] = {}

    @staticmethod
    def unavailable() -> str | None:
        """Why the streamed kinds cannot run here (litdata missing), or None."""
        import importlib.util

        return None if importlib.util.find_spec("litdata") else "litdata is not installed (pip install litdata)"

    def launch_args(self, reference: bool) -> list[str]:
        """What a launch adds to stream: the reference reads the prepared set, a chain's launches its copy."""
        return ["--data.url", str(self.prepared if reference else self.folder)]

    def prepare(self, env: Mapping[str, str], log: Path, other: bool) -> None:
        """Prepare the set (and with ``other`` the replacement), both at once, unless already there."""
        jobs = [(self.prepared, 0)] + ([(self.other, self.OTHER_SPLIT_SEED)] if other else [])
        procs = []
        for out, seed in jobs:
            if (out / "atscale.json").exists():
                continue
            command = [sys.executable, "-m", "recipes.prepare", "digits", "--output", str(out), "--chunk_items",
                       str(self.CHUNK_ITEMS), "--split_seed", str(seed), "--staging", str(out.parent / "staging")]
            with open(log.with_name(f"{log.name}-{out.parent.name}.log"), "wb") as sink:
                procs.append((command, sink.name, subprocess.Popen(command, cwd=self.repo, env=dict(env),
                                                                    stdout=sink, stderr=subprocess.STDOUT)))
        for command, sink_name, proc in procs:
            if proc.wait() != 0:
                raise RuntimeError(f"{' '.join(command[1:])} exited {proc.returncode}; see {sink_name}:\n"
                                   + Path(sink_name).read_text(errors="replace")[-2000:])

    def install(self) -> None:
        """This chain's copy of the prepared set (made once)."""
        if not self.folder.exists():
            self.folder.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(self.prepared, self.folder)

    def settings(self) -> dict[str, int]:
        """``batch_size``, ``shuffle_window`` and ``shuffle_seed`` of the streamed config (the datamodule's defaults
        where it sets none)."""
        import inspect

        import yaml

        from datamodules.streaming import StreamingImageDataModule

        given = (yaml.safe_load((self.repo / self.CONFIG).read_text()).get("data") or {}).get("init_args") or {}
        defaults = inspect.signature(StreamingImageDataModule).parameters
        return {key: int(given.get(key, defaults[key].default)) for key in ("batch_size", "shuffle_window",
                                                                              "shuffle_seed")}

    def chunks(self) -> list[tuple[str, int]]:
        """``(file name, items)`` of each training chunk, in the index's order."""
        import json

        index = json.loads((self.prepared / "train" / "index.json").read_text())
        return [(str(c["filename"]), int(c["chunk_size"])) for c in index["chunks"]]

    def target(self, epochs: int, batches: int, world: int) -> str:
        """The training chunk the run reads last (see :func:`last_read_chunk`): the one ``chunk_damaged`` damages."""
        chunks, settings = self.chunks(), self.settings()
        sizes = [size for _, size in chunks]
        per_pass = samples_per_pass(sum(sizes), settings["batch_size"], world, batches)
        return chunks[last_read_chunk(sizes, settings["shuffle_window"], settings["shuffle_seed"], epochs,
                                      per_pass)][0]

    def first_step(self, name: str, from_step: int, epochs: int, batches: int, world: int) -> int | None:
        """The first step at or after ``from_step`` that trains an item of training chunk ``name`` (None: none)."""
        chunks, settings = self.chunks(), self.settings()
        sizes = [size for _, size in chunks]
        chunk = [n for n, _ in chunks].index(name)
        global_batch = settings["batch_size"] * world
        return first_step_with(chunk, sizes, settings["shuffle_window"], settings["shuffle_seed"], epochs,
                               samples_per_pass(sum(sizes), settings["batch_size"], world, batches), global_batch,
                               from_step)

    def damage(self, name: str, seed: float) -> dict[str, Any]:
        """Flip 64 bytes of training chunk ``name`` of this chain's copy at offsets seeded by ``seed``."""
        return corrupt(self.folder / "train" / name, "flip", seed)

    def repair(self, name: str) -> None:
        """Put the prepared bytes of training chunk ``name`` back (written beside, renamed into place)."""
        target = self.folder / "train" / name
        spare = target.with_name(f".{name}.repair")
        shutil.copyfile(self.prepared / "train" / name, spare)
        os.replace(spare, target)

    def digest(self, folder: Path) -> str:
        """The index digest of the set in ``folder`` (what a run records and a resume compares)."""
        if folder not in self._digests:
            from datamodules.streaming import index_digest

            self._digests[folder] = index_digest(str(folder))
        return self._digests[folder]

    def replace(self) -> tuple[str, str]:
        """Set this chain's copy aside and put the other split at its URL; ``(its digest, the original's)``."""
        os.replace(self.folder, self.aside)
        shutil.copytree(self.other, self.folder)
        return self.digest(self.other), self.digest(self.prepared)

    def restore(self) -> None:
        """Put the copy set aside by :meth:`replace` back at the URL."""
        if self.aside.exists():
            shutil.rmtree(self.folder, ignore_errors=True)
            os.replace(self.aside, self.folder)
