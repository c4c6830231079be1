"""The per-sample trace counts what survived: steps a crashed launch trained past its checkpoint do not count."""

from __future__ import annotations

import collections
from pathlib import Path

from tests.sample_trace import epoch_counts


def test_steps_past_the_next_launchs_resume_point_are_dropped(tmp_path: Path) -> None:
    # launch 100 trained steps 1-3 on two ranks and crashed; launch 200 resumed from step 2 on one rank
    (tmp_path / "launches.txt").write_text("200 2\n100 0\n")  # order of the ids, not of the lines
    (tmp_path / "rank0.txt").write_text("0 1 a 100\n0 2 b 100\n0 3 c 100\n0 3 c 200\n0 4 e 200\n1 5 a 200\n")
    (tmp_path / "rank1.txt").write_text("0 1 f 100\n0 2 g 100\n0 3 h 100\n")
    assert epoch_counts(tmp_path) == {0: collections.Counter(a=1, b=1, c=1, e=1, f=1, g=1),
                                      1: collections.Counter(a=1)}
