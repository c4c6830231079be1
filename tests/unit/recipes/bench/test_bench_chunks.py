"""``python -m recipes.bench chunks``: its arguments, and one real (tiny) sweep through the shaped local store."""

from __future__ import annotations

import argparse
import io

import pytest
from rich.console import Console

from recipes.bench import chunks
from recipes.run.common import UsageError


def _args(**over: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    chunks.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in over.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize(("over", "message"), [
    ({"rounds": 0}, "--rounds 0 must be >= 1"),
    ({"split_mb": 0.0}, "--split-mb 0.0 must be > 0"),
    ({"latency_ms": -1.0}, "--latency-ms -1 / --bandwidth-mb-s 100 must be >= 0"),
    ({"sizes": "1MB,lots"}, "--sizes: 'lots' is not a size such as 1MB or 256KB"),
    ({"sizes": ","}, "--sizes: no size given (expected e.g. 1MB,16MB)"),
    ({"sizes": "128MB"}, "--sizes: a chunk of 128,000,000 bytes is larger than the split (--split-mb 64)"),
])
def test_bad_arguments_are_named(over: dict, message: str) -> None:
    with pytest.raises(UsageError) as raised:
        chunks.run(_args(**over))
    assert str(raised.value) == message


def test_a_tiny_sweep_reads_every_byte_and_tables_each_size() -> None:
    args = _args(rounds=2, split_mb=0.3, sizes="100KB,300KB", latency_ms=20.0, bandwidth_mb_s=0.0, json=True)
    figures = chunks.bench_chunks(args, Console(file=io.StringIO()))
    rows = {row["chunk_bytes"]: row for row in figures["rows"]}
    assert sorted(rows) == [100_000, 300_000]
    assert (rows[100_000]["chunks"], rows[300_000]["chunks"]) == (3, 1)
    for row in rows.values():
        assert len(row["seconds"]) == 2
        # every request waits 20 ms for its first byte: 3 chunks in parallel threads, or the one chunk, at least that
        assert min(row["seconds"]) >= 0.020
        assert row["min_mb_per_s"] <= row["mb_per_s"] <= row["max_mb_per_s"]
        assert row["mb_per_s"] == pytest.approx(sorted(0.3 / t for t in row["seconds"])[0] / 2
                                                + sorted(0.3 / t for t in row["seconds"])[1] / 2)
    assert rows[300_000]["held_mb"] == pytest.approx(0.3 * 4 * 3)
    out = io.StringIO()
    chunks.print_chunks(figures, Console(file=out, width=200))
    table = out.getvalue()
    assert "20 ms a request, unlimited" in table and "0.1 MB" in table and "3.6 MB" in table
