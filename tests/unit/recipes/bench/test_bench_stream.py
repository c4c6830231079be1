"""recipes.bench stream: the options and their checks, the summary by hand, the tables, and one epoch of each loader
on a small prepared folder (no moto, no training run)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from rich.console import Console

from recipes.bench import stream
from recipes.bench.stream_anchor import ITEM_BYTES, large_chunk_items, write_image_folder
from recipes.bench.subcommands import build_parser, main


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["stream", *argv])


def test_defaults_play_a_same_region_store() -> None:
    args = _args()
    assert (args.recipe, args.latency_ms, args.bandwidth_mb_s, args.anchor, args.large_mb) == (
        "digits", 30.0, 100.0, False, None)
    assert stream.shaping(args.latency_ms, args.bandwidth_mb_s) == (0.03, 100e6)  # MB = 10^6 bytes
    assert stream.shaping(0, 0) == (0.0, None)  # 0 is none / unlimited: moto's raw numbers
    assert stream.sources(30, 100) == ("memory", "folder", "stream", "stream-raw")
    assert stream.sources(0, 5) == ("memory", "folder", "stream", "stream-raw")
    assert stream.sources(0, 0) == ("memory", "folder", "stream")  # unshaped: stream is the raw one


@pytest.mark.parametrize(("argv", "message"), [
    (["--latency-ms", "-1"], "--latency-ms -1 must be >= 0 (0: none)"),
    (["--bandwidth-mb-s", "-5"], "--bandwidth-mb-s -5 must be >= 0 (0: unlimited)"),
    (["--latency-ms", "nan"], "'nan' is not a finite number"),
    (["--workers", "0,x"], "--workers: 'x' is not an integer >= 0"),
    (["--rounds", "0"], "--rounds 0 must be >= 1"),
    (["--steps", "4"], "--steps 4 must be >= 5: StepTiming times no run's first 3 steps"),
    (["--max-cache-size", "lots"], "--max-cache-size 'lots': expected a size such as 200KB"),
    (["--max-cache-size", "0MB"], "--max-cache-size '0MB'"),
    (["--recipe", "bert"], "invalid choice: 'bert'"),
    (["--recipe", "gpt", "--corpus-bytes", "500"], "--corpus-bytes 500: its validation tenth must hold a window"),
    (["--large-mb", "0"], "--large-mb 0 must be > 0"),
    (["--large-mb", "1", "--max-cache-size", "200KB"], "--large-mb 1 is less than 10x --max-cache-size 200KB (2 MB)"),
    (["--large-mb", "5", "--anchor"], "--large-mb runs instead of the rounds"),
])
def test_bad_input_is_one_line_naming_the_value(argv: list[str], message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stream", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_help_names_each_option_and_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["stream", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for line in ("--latency-ms LATENCY_MS the store's first-byte latency: each response waits this long after its "
                 "request (0: none) (default: 30.0)",
                 "--bandwidth-mb-s BANDWIDTH_MB_S the store's bandwidth per connection, in MB/s (10^6 bytes a "
                 "second; 0: unlimited) (default: 100.0)",
                 "--recipe {digits,gpt}", "(default: digits)", "--anchor", "--large-mb LARGE_MB instead:"):
        assert line in text
    assert "(default: None)" not in text


def test_the_loaders_alone_take_the_recipes_batch_sizes() -> None:
    assert [stream.config_batch_size(stream.RECIPES[r][side]) for r in ("digits", "gpt")
            for side in ("memory", "stream")] == [32, 32, 16, 16]  # the same on both sides of each comparison


def test_budgets_in_litdatas_decimal_units() -> None:
    assert [stream.budget_bytes(s) for s in ("200KB", "30MB", "1.5GB", "4096", "2000000B")] == [
        200_000, 30_000_000, 1_500_000_000, 4096, 2_000_000]
    # the large set's chunks: a hundredth of the set, at most an eighth of the budget, whole items
    assert large_chunk_items(300_000_000, 30_000_000) == 3_000_000 // ITEM_BYTES == 244
    assert large_chunk_items(300_000_000, 8_000_000) == 1_000_000 // ITEM_BYTES
    assert large_chunk_items(2_000_000, 200_000) == 1  # smaller than an item: one a chunk


def _row(round_index: int, source: str, workers: int, throughput: float, wait: float,
         cache: int | None = None) -> dict:
    return {"round": round_index, "source": source, "workers": workers, "throughput": throughput,
            "samples_per_s": throughput, "data_wait_share": wait, "cache_bytes": cache}


def test_medians_spreads_and_the_ratio_to_memory_pair_rounds() -> None:
    rows = [_row(0, "memory", 0, 1000, 0.01), _row(0, "stream", 0, 500, 0.5, 9000),
            _row(1, "memory", 0, 2000, 0.02), _row(1, "stream", 0, 1800, 0.1, 7000),
            _row(2, "memory", 0, 1200, 0.03), _row(2, "stream", 0, 600, 0.3, 8000)]
    memory, streamed = stream.summarize(rows, [0], ("memory", "stream"))
    assert memory["throughput"] == {"median": 1200, "min": 1000, "max": 2000}
    assert memory["vs_memory"] == {"median": 1.0, "min": 1.0, "max": 1.0} and memory["cache_bytes"] is None
    assert streamed["throughput"] == {"median": 600, "min": 500, "max": 1800}
    # round by round: 0.5, 0.9, 0.5 (not the 600 / 1200 of the medians)
    assert streamed["vs_memory"] == {"median": 0.5, "min": 0.5, "max": 0.9}
    assert streamed["data_wait_share"] == {"median": 0.3, "min": 0.1, "max": 0.5}
    assert streamed["cache_bytes"] == 9000  # the largest any round left
    epochs = [{"round": r, "workers": 2, "loader": loader, "samples_per_s": s}
              for r, loader, s in ((0, "ours", 300), (0, "litdata", 100), (1, "litdata", 400), (1, "ours", 200))]
    (anchor,) = stream.summarize_anchor(epochs, [2])
    assert anchor["ours"] == {"median": 250, "min": 200, "max": 300}
    assert anchor["ours_over_litdata"] == {"median": 1.75, "min": 0.5, "max": 3.0}


def test_the_tables_carry_the_store_settings_and_the_spread() -> None:
    spread = {"median": 1234.0, "min": 1000.0, "max": 1500.0}
    ratio = {"median": 0.8, "min": 0.7, "max": 0.9}
    figures = {"recipe": "gpt", "unit": "tokens/s", "epochs": None, "steps": 20, "rounds": 3, "latency_ms": 30.0,
               "bandwidth_mb_s": 100.0, "max_cache_size": "200KB", "sources": ["memory", "stream", "stream-raw"],
               "summary": [{"source": "stream", "workers": 2, "throughput": spread, "vs_memory": ratio,
                            "data_wait_share": {"median": 0.05, "min": 0.01, "max": 0.1}, "cache_bytes": 150_000}],
               "anchor": {"summary": [{"workers": 2, "ours": spread, "litdata": spread, "ours_over_litdata": ratio}]}}
    console = Console(record=True, width=300)
    stream.print_stream(figures, console)
    text = " ".join(console.export_text().split())  # a title wraps to its table's width
    assert ("gpt, 20 steps, median (min-max) of 3 round(s); store 30 ms, 100 MB/s a stream (stream-raw: moto "
            "unshaped)") in text
    assert "tokens/s" in text and "1,234 (1,000-1,500)" in text and "0.80 (0.70-0.90)" in text
    assert "5.0% (1.0%-10.0%)" in text and "150 kB (200KB)" in text
    assert "loaders alone, one epoch each, empty cache" in text
    assert stream.store_line({"latency_ms": 0.0, "bandwidth_mb_s": 0.0}) == "store no latency, unlimited"


def test_the_synthetic_set_is_an_image_folder_of_the_size_asked(tmp_path: Path) -> None:
    from PIL import Image

    count = write_image_folder(tmp_path, 30 * ITEM_BYTES)
    files = sorted(tmp_path.rglob("*.png"))
    assert count == len(files) == 30 and len({f.parent for f in files}) == 10
    with Image.open(files[0]) as image:
        assert (image.mode, image.size) == ("RGB", (32, 32))
    assert write_image_folder(tmp_path / "tiny", 1) == 20  # two a class at least


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from recipes import prepare

    root = tmp_path_factory.mktemp("digits")
    assert prepare.main(["digits", "--output", str(root / "data"), "--chunk_items", "16", "--max_items", "96",
                         "--staging", str(root / "staging")]) == 0
    return root / "data"


@pytest.mark.parametrize("loader", ["ours", "litdata"])
def test_one_loader_epoch_counts_every_sample(loader: str, prepared: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    import obstore.store

    from recipes.bench import stream_anchor

    monkeypatch.setattr(obstore.store, "S3Store", obstore.store.S3Store)  # the child wraps it: put it back after
    assert stream_anchor.main(["--loader", loader, "--url", str(prepared), "--batch-size", "32", "--cache-dir",
                               str(tmp_path / "cache"), "--sample", "0.05"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (figures["loader"], figures["samples"], figures["batches"]) == (loader, 96, 3)
    assert figures["samples_per_s"] == pytest.approx(96 / figures["seconds"])
    assert 0 < figures["rss_early_peak_bytes"] <= figures["rss_peak_bytes"] and figures["samples_taken"] >= 3
    assert figures["cache_peak_bytes"] >= 0
