"""Streamed data someone else wrote, on the real CLI: a chunk never runs code, damage never trains, a resume reads
the data its run began with.

Each test prepares the small digits set (``recipes.prepare``, 300 training items in chunks of 32) into a folder or
moto's S3 bucket, then does to it what a hostile or unlucky writer would: an index that asks for litdata's
``pickle`` format with a payload in the chunk (``atscale.json`` rewritten to match, as whoever can write the bucket
can), flipped bytes in one chunk, a chunk cut short, an index with another ``chunk_size``, a read-only cache, the
dataset prepared again between two launches of one run.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from datamodules.streaming import ChunkOrder, StreamingImageDataModule
from recipes import prepare
from tests.conftest import CONFIGS, FAST, cli_env, run_fit, runs_of
from tests.e2e.test_run_integrity import small_mount
from tests.sample_trace import sample_key
from tests.servers import S3Server, moto_s3  # noqa: F401 - fixture

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600, func_only=True)]

__all__ = ["small_mount"]  # the fixture, shared with test_run_integrity.py

#: a checkpoint every 3 steps, 2 loader workers, a read timeout far longer than the tests: damage must not wait it
ARGS = ("--config", str(CONFIGS / "digits-stream.yaml"), *FAST, "--log_model", "false", "--trainer.max_epochs", "1",
        "--data.num_workers", "2", "--data.read_timeout_s", "300", "--spot.every_n_steps", "3")


class Payload:
    """An item that runs code when unpickled: it writes ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _payload_item(marker: str, index: int) -> dict[str, Any]:
    return {"x": np.zeros((1, 8, 8), dtype=np.float32), "y": Payload(marker)}


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits set as ``recipes.prepare`` writes it, in a folder (copied by each test that changes it)."""
    out = tmp_path_factory.mktemp("genuine") / "digits"
    assert prepare.main(["digits", "--output", str(out), "--chunk_items", "32", "--max_items", "300"]) == 0
    return out


def copy_of(genuine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(genuine, tmp_path / "digits"))


def rewrite_listed_hashes(dataset: Path) -> None:
    """Make ``atscale.json`` list the files as they are now (what a writer of the bucket can do)."""
    meta = json.loads((dataset / "atscale.json").read_text())
    meta["files"] = {path.relative_to(dataset).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
                     for path in sorted(dataset.rglob("*")) if path.is_file() and path.name != "atscale.json"}
    (dataset / "atscale.json").write_text(json.dumps(meta))


def hostile(genuine: Path, tmp_path: Path, marker: Path) -> Path:
    """The genuine set with its training split replaced by items litdata writes in its ``pickle`` format."""
    from functools import partial

    from litdata import optimize

    dataset = copy_of(genuine, tmp_path)
    shutil.rmtree(dataset / "train")
    optimize(fn=partial(_payload_item, str(marker)), inputs=list(range(64)), output_dir=str(dataset / "train"),
             chunk_size=32, num_workers=1, mode="overwrite", start_method="fork")
    assert "pickle" in json.loads((dataset / "train" / "index.json").read_text())["config"]["data_format"]
    rewrite_listed_hashes(dataset)
    return dataset


def error_lines(stderr: str, prefix: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(prefix)]


def upload(s3: S3Server, folder: Path, bucket: str) -> str:
    s3.make_bucket(bucket)
    client = s3.client()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"digits/{path.relative_to(folder).as_posix()}")
    return f"s3://{bucket}/digits"


def test_a_pickle_payload_in_a_folder_never_runs(genuine: Path, tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    dataset = hostile(genuine, tmp_path, marker)
    result = run_fit(tmp_path, *ARGS, "--data.url", str(dataset))
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = error_lines(result.stderr, "error:")
    assert line == (f"error: {dataset}/train/index.json: items in the pickle data format, which could run code when "
                    "read; only numpy, int, no_header_numpy (what recipes.prepare writes) are read."), line
    assert not marker.exists()
    assert "Traceback" not in result.stderr
    assert runs_of(tmp_path, "digits-stream") == []  # refused before any MLflow run exists


def test_a_pickle_payload_in_a_bucket_never_runs(genuine: Path, tmp_path: Path, moto_s3: S3Server) -> None:
    marker = tmp_path / "payload-ran"
    url = upload(moto_s3, hostile(genuine, tmp_path, marker), "atscale-hostile")
    result = run_fit(tmp_path, *ARGS, "--data.url", url, env=cli_env(tmp_path, **moto_s3.env))
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = error_lines(result.stderr, "error:")
    assert line.startswith(f"error: {url}/train/index.json: items in the pickle data format"), line
    assert not marker.exists()


def _chunk_keys(dataset: Path, chunk: int) -> set[str]:
    """The sample names of chunk ``chunk``'s items (from the genuine data)."""
    dm = StreamingImageDataModule(str(dataset), cache_dir=str(dataset.parent / "peek-cache"))
    dm.setup("fit")
    starts = ChunkOrder(dm.train_set.chunk_sizes()).starts
    sizes = dm.train_set.chunk_sizes()
    return {sample_key(dm.train_set[i][0]) for i in range(starts[chunk], starts[chunk] + sizes[chunk])}


def test_bit_rot_in_one_chunk_stops_before_any_of_its_items_trains(genuine: Path, tmp_path: Path) -> None:
    """Flipped bytes in the pixels of the chunk the second window of the order reads: exit 65 (no requeue), one
    line naming the file, and no sample of that chunk in the trace of what trained."""
    dataset = copy_of(genuine, tmp_path)
    index = json.loads((dataset / "train" / "index.json").read_text())
    second_window = ChunkOrder([c["chunk_size"] for c in index["chunks"]])(0)  # pass 0's order, seed 0
    starts = ChunkOrder([c["chunk_size"] for c in index["chunks"]]).starts
    chunk = next(c for c, s in enumerate(starts) if s <= second_window[4 * 32] < s + index["chunks"][c]["chunk_size"])
    keys = _chunk_keys(dataset, chunk)
    name = index["chunks"][chunk]["filename"]
    damaged = bytearray((dataset / "train" / name).read_bytes())
    for offset in range(len(damaged) - 200, len(damaged) - 100, 7):  # pixels of the chunk's last items
        damaged[offset] ^= 0x40
    (dataset / "train" / name).write_bytes(bytes(damaged))

    trace = tmp_path / "trace"
    result = run_fit(tmp_path, *ARGS, "--data.url", str(dataset), "--trainer.callbacks+=tests.sample_trace.SampleTrace",
                     f"--trainer.callbacks.path={trace}")
    assert result.returncode == 65, result.stderr[-3000:]
    (line,) = error_lines(result.stderr, "atscale:")
    assert line.startswith(f"atscale: the streamed data at {dataset}/train is damaged: {name}: SHA-256 "), line
    assert line.endswith("the run stopped (exit 65, no requeue): prepare the data again (python -m recipes.prepare "
                         "...), then relaunch."), line
    trained = {row.split()[2] for f in trace.glob("rank*.txt") for row in f.read_text().splitlines()}
    assert trained and not trained & keys  # it trained the first window, and nothing of the damaged chunk
    assert [r.info.status for r in runs_of(tmp_path, "digits-stream")] == ["FAILED"]


def test_a_truncated_chunk_and_an_altered_index_in_a_bucket_stop_at_once(genuine: Path, tmp_path: Path,
                                                                         moto_s3: S3Server) -> None:
    """A chunk cut short (an upload that stopped) and an index whose ``chunk_size`` is not the prepared one: each
    stops with 65 well before ``read_timeout_s`` (300 s); before, both waited it out and exited 75 (requeued)."""
    dataset = copy_of(genuine, tmp_path)
    chunk = dataset / "train" / json.loads((dataset / "train" / "index.json").read_text())["chunks"][0]["filename"]
    chunk.write_bytes(chunk.read_bytes()[:1000])
    url = upload(moto_s3, dataset, "atscale-truncated")
    env = cli_env(tmp_path, **moto_s3.env)
    result = run_fit(tmp_path, *ARGS, "--data.url", url, env=env, timeout=200)
    assert result.returncode == 65, result.stderr[-3000:]
    (line,) = error_lines(result.stderr, "atscale:")
    assert line.startswith(f"atscale: the streamed data at {url}/train is damaged: {chunk.name}: SHA-256 "), line
    assert "(1000 bytes)" in line

    altered = copy_of(genuine, tmp_path / "altered")
    index = json.loads((altered / "val" / "index.json").read_text())
    index["chunks"][0]["chunk_size"] = 64
    (altered / "val" / "index.json").write_text(json.dumps(index))
    url = upload(moto_s3, altered, "atscale-altered")
    result = run_fit(tmp_path, *ARGS, "--data.url", url, "--run_name", "altered", env=env, timeout=200)
    assert result.returncode == 65, result.stderr[-3000:]
    (line,) = error_lines(result.stderr, "atscale:")
    assert line.startswith(f"atscale: the streamed data at {url}/val is damaged: index.json: SHA-256 "), line


@pytest.mark.parametrize(("options", "why"), [("ro,size=1m", "Read-only file system"),
                                              ("size=16k", "No space left on device")])
def test_an_unwritable_cache_is_a_local_fault_not_an_outage(genuine: Path, tmp_path: Path, moto_s3: S3Server,
                                                           small_mount: Callable[[str], Path], options: str,
                                                           why: str) -> None:
    """A read-only cache disk and a full one: exit 74 at once (not 75 after ``read_timeout_s``), naming the cache."""
    url = upload(moto_s3, genuine, "atscale-cache-" + options.split(",")[0].replace("=", ""))
    cache = small_mount(options)
    result = run_fit(tmp_path, *ARGS, "--data.url", url, "--data.cache_dir", str(cache),
                     env=cli_env(tmp_path, **moto_s3.env), timeout=200)
    assert result.returncode == 74, result.stderr[-3000:]
    (line,) = error_lines(result.stderr, "atscale:")
    assert line.startswith(f"atscale: the chunk cache {cache}/"), line
    assert f"cannot be written ({why}); the run stopped (exit 74, no requeue)" in line, line


def test_a_resume_on_data_prepared_again_is_refused_with_both_digests(genuine: Path, tmp_path: Path) -> None:
    """SIGTERM-like stop after step 5; the folder prepared again with another split seed; the same command is
    refused (exit 2, both digests, the MLflow run left KILLED), and the original data put back resumes it."""
    dataset = copy_of(genuine, tmp_path)
    args = (*ARGS, "--data.url", str(dataset), "--spot.drill_steps", "[5]")
    first = run_fit(tmp_path, *args)
    assert first.returncode == 75, first.stderr[-3000:]
    shutil.move(dataset, tmp_path / "original")
    assert prepare.main(["digits", "--output", str(dataset), "--chunk_items", "32", "--max_items", "300",
                         "--split_seed", "1"]) == 0
    began = json.loads((tmp_path / "original" / "atscale.json").read_text())
    assert began != json.loads((dataset / "atscale.json").read_text())

    second = run_fit(tmp_path, *args)
    assert second.returncode == 2, second.stderr[-3000:]
    (line,) = error_lines(second.stderr, "atscale:")
    from datamodules.streaming import index_digest

    now, then = index_digest(str(dataset)), index_digest(str(tmp_path / "original"))
    assert line == (f"atscale: the data at {dataset} has index digest {now[:12]}, not the {then[:12]} this run began "
                    "with: it was prepared again since. Resuming would train on other data; start a new run "
                    "(--fresh true or another --run_name), or put the original data back and relaunch."), line
    (run,) = runs_of(tmp_path, "digits-stream")
    assert run.info.status == "KILLED"

    shutil.rmtree(dataset)
    shutil.move(tmp_path / "original", dataset)
    third = run_fit(tmp_path, *args)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "Resuming from " in third.stderr


@pytest.fixture
def other_s3(tmp_path: Path) -> Iterator[S3Server]:
    """A second S3 endpoint, as a notebook that moves to another store between two runs would use."""
    from tests.servers import _moto_cmd, _s3_env, _start_with_port, clean_env, stop_process

    proc, endpoint = _start_with_port(_moto_cmd, "/moto-api/", clean_env(), tmp_path / "moto.log", timeout=30)
    try:
        yield S3Server(endpoint, _s3_env(endpoint, "testing", "testing"), log=tmp_path / "moto.log")
    finally:
        stop_process(proc)


def test_one_process_reads_each_launchs_own_store(genuine: Path, tmp_path: Path, moto_s3: S3Server,
                                                  other_s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two stores hold other data at the same URL; one process reads the first, then (its ``AWS_*`` changed, as
    between two ``train()`` calls in a notebook) the second: the digest it records and the items it reads are the
    second store's. Before, fsspec's cached filesystem kept reading the first store's index."""
    other = tmp_path / "other"
    assert prepare.main(["digits", "--output", str(other), "--chunk_items", "32", "--max_items", "300",
                         "--split_seed", "1"]) == 0
    url = upload(moto_s3, genuine, "atscale-same-name")
    assert upload(other_s3, other, "atscale-same-name") == url
    from datamodules.streaming import index_digest

    seen = []
    for store in (moto_s3, other_s3):
        for key, value in store.env.items():
            monkeypatch.setenv(key, value)
        dm = StreamingImageDataModule(url, cache_dir=str(tmp_path / "cache"))
        dm.setup("fit")
        seen.append((dm.fingerprint(), sample_key(dm.train_set[0][0])))
    first = StreamingImageDataModule(str(genuine), cache_dir=str(tmp_path / "c1"))
    second = StreamingImageDataModule(str(other), cache_dir=str(tmp_path / "c2"))
    for dm in (first, second):
        dm.setup("fit")
    assert seen == [(index_digest(str(genuine)), sample_key(first.train_set[0][0])),
                    (index_digest(str(other)), sample_key(second.train_set[0][0]))]
