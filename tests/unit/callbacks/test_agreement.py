"""callbacks.utils.agreement: four gloo ranks with different views of a step come out with one decision."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from callbacks.utils.agreement import Agreed, agree
from tests.conftest import free_port

WORLD = 4
#: Each rank's (notice, save_due, validation_follows): a notice on rank 2 alone, rank 3's clock says "save"
#: (ignored: rank 0's clock decides), rank 1 alone does not see validation coming.
VIEWS = [(False, False, True), (False, False, False), (True, False, True), (False, True, True)]


def _vote(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        notice, save_due, validation = VIEWS[rank]
        agreed = agree(notice=notice, save_due=save_due, validation_follows=validation, rank=rank,
                       device=torch.device("cpu"), distributed=True)
        Path(out, str(rank)).write_text(repr(agreed))
    finally:
        dist.destroy_process_group()


@pytest.mark.e2e  # four spawned interpreters: about 10 s on a quiet machine
@pytest.mark.slow(covered_by="tests/e2e/test_rank_agreement.py::test_a_notice_seen_by_one_rank_stops_all_at_one_step")
def test_four_ranks_decide_the_same_thing(tmp_path: Path) -> None:
    mp.start_processes(_vote, args=(free_port(), str(tmp_path)), nprocs=WORLD, start_method="spawn")
    outcomes = {Path(tmp_path, str(rank)).read_text() for rank in range(WORLD)}
    assert outcomes == {repr(Agreed(notice=True, save_due=False, validation_follows=False))}


@pytest.mark.parametrize("view", VIEWS)
def test_one_process_decides_alone(view: tuple[bool, bool, bool]) -> None:
    notice, save_due, validation = view
    assert agree(notice=notice, save_due=save_due, validation_follows=validation, rank=0,
                 device=torch.device("cpu"), distributed=False) == Agreed(notice, save_due, validation)
