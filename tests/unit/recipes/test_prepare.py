"""``python -m recipes.prepare`` on a local folder: resumable after a kill, one dataset a URL, bad input in one line.

``litdata.optimize`` starts a worker process, so the tests that write chunks are marked ``e2e``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from datamodules.streaming import index_digest
from recipes import prepare

DIGITS = ["digits", "--chunk_items", "16", "--max_items", "40"]


@pytest.mark.e2e
def test_a_relaunch_after_a_kill_sends_only_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "ds"
    assert prepare.main([*DIGITS, "--output", str(out)]) == 0
    first = capsys.readouterr()
    digest = index_digest(str(out))
    # 40 training digits in chunks of 16 (3 chunks), 10 validation ones (1), the two indexes
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "atscale.json", "train/chunk-0-0.bin", "train/chunk-0-1.bin", "train/chunk-0-2.bin", "train/index.json",
        "val/chunk-0-0.bin", "val/index.json"]
    assert first.out == f"Prepared {out}: train 40, val 10 items, 6 files (6 sent); index digest {digest}\n"
    # a kill during the upload: one chunk and an index missing, atscale.json not complete yet
    (out / "train/chunk-0-1.bin").unlink()
    (out / "train/index.json").unlink()
    meta = json.loads((out / "atscale.json").read_text())
    (out / "atscale.json").write_text(json.dumps({**meta, "complete": False}))
    assert prepare.main([*DIGITS, "--output", str(out)]) == 0
    again = capsys.readouterr()
    assert "train: 40 items already in chunks at " in again.err
    assert again.out == f"Prepared {out}: train 40, val 10 items, 6 files (2 sent); index digest {digest}\n"
    assert json.loads((out / "atscale.json").read_text())["complete"] is True


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a dataset")
    cases = [
        ([*DIGITS, "--output", str(foreign)],
         f"error: --output {foreign} holds files that are not a prepared dataset (no atscale.json); choose another "
         "--output or empty it first\n"),
        (["digits", "--chunk_items", "0", "--output", str(tmp_path / "x")],
         "error: --chunk_items 0: must be an integer >= 1\n"),
        (["digits", "--chunk_items", "8", "--chunk_bytes", "1MB", "--output", str(tmp_path / "x")],
         "error: --chunk_items 8 and --chunk_bytes 1MB: give one of them\n"),
        (["digits", "--chunk_bytes", "lots", "--output", str(tmp_path / "x")],
         "error: --chunk_bytes lots: expected a size such as '16MB' or '512KB', or bytes >= 1\n"),
        (["digits", "--chunk_bytes", "0", "--output", str(tmp_path / "x")],
         "error: --chunk_bytes 0: expected a size such as '16MB' or '512KB', or bytes >= 1\n"),
        (["mnist", "--output", str(tmp_path / "x")], "error: mnist needs --root (the folder of the data)\n"),
        (["mnist", "--root", str(tmp_path), "--output", str(tmp_path / "x")], None),
    ]
    for argv, message in cases:
        assert prepare.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), err
        if message is not None:
            assert err == message
    assert not (tmp_path / "x").exists()


@pytest.mark.e2e
def test_the_same_data_prepared_twice_has_the_same_index_digest(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """litdata stamps each index.json with the time it was written: the digest a run records must not change with it."""
    monkeypatch.chdir(tmp_path)
    digests = []
    for name in ("first", "second"):
        assert prepare.main([*DIGITS, "--output", str(tmp_path / name), "--staging", str(tmp_path / f"s-{name}")]) == 0
        digests.append(index_digest(str(tmp_path / name)))
    assert digests[0] == digests[1]
    assert (tmp_path / "first/train/index.json").read_text() != (tmp_path / "second/train/index.json").read_text()


def test_chunks_are_cut_by_bytes_by_default_and_by_items_when_asked() -> None:
    args = prepare.build_parser().parse_args(["digits", "--output", "x"])
    assert prepare.DEFAULT_CHUNK_BYTES == "16MB"  # docs/benchmarks.md "Chunk size" says why
    assert prepare.chunking(args) == {"chunk_bytes": 16_000_000}
    args.chunk_bytes = "512KB"
    assert prepare.chunking(args) == {"chunk_bytes": 512_000}
    args.chunk_bytes, args.chunk_items = None, 64
    assert prepare.chunking(args) == {"chunk_items": 64}
