"""A further rank's stop line reaches global rank 0 through the job's rendezvous store (recipes/run/stop_line.py),
over a real ``TCPStore`` served in this process as a launcher serves one."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from recipes.run import stop_line

LINE = ("atscale: the streamed data at s3://gone/digits cannot be read (NoSuchBucket) for 5 s; the run stopped "
        "(exit 75). Relaunch the same command once it is back: it resumes from the newest checkpoint.")
GLOO_LOST = "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:6001"


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[dist.TCPStore]:
    """The job's store at MASTER_ADDR:MASTER_PORT, as Lightning's launcher (rank 0's process) serves it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    yield server


def test_a_line_left_by_rank_1_is_read_by_rank_0(store: dist.TCPStore) -> None:
    assert stop_line.leave(LINE, rank=1)
    assert stop_line.left_by_peers(world_size=2, wait_s=0) == (75, LINE)


def test_the_exit_code_a_rank_stopped_with_reaches_rank_0(store: dist.TCPStore) -> None:
    """Damaged data met by rank 1 first stops with 65: rank 0 must not turn it into a requeue (75)."""
    assert stop_line.leave(LINE, rank=1, code=65)
    assert stop_line.left_by_peers(world_size=2, wait_s=0) == (65, LINE)


def test_no_line_left_is_none_after_the_wait(store: dist.TCPStore) -> None:
    started = time.monotonic()
    assert stop_line.left_by_peers(world_size=4, wait_s=0.3) is None
    assert 0.3 <= time.monotonic() - started < 5


def test_only_further_ranks_of_this_world_are_read(store: dist.TCPStore) -> None:
    stop_line.leave("rank 0's own", rank=0)  # rank 0 prints its own line; never read back
    stop_line.leave("a rank of a larger world", rank=3)
    assert stop_line.left_by_peers(world_size=3, wait_s=0) is None
    stop_line.leave(LINE, rank=2)
    assert stop_line.left_by_peers(world_size=3, wait_s=0) == (75, LINE)


def test_a_torchrun_restart_does_not_read_the_previous_attempts_line(store: dist.TCPStore,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's store outlives the workers it restarts: a line of attempt 0 is not attempt 1's reason."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    stop_line.leave(LINE, rank=1)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert stop_line.left_by_peers(world_size=2, wait_s=0) is None


def test_no_store_is_no_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert stop_line.leave(LINE, rank=1) is False
    assert stop_line.left_by_peers(world_size=2, wait_s=0) is None


def test_a_store_gone_with_its_node_is_no_line_and_no_warning(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A lost node may have hosted the store: the lost-peer line stays as it was, with no word of the store (the
    hang watchdog's warning about it is the watchdog's)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(closed))
    started = time.monotonic()
    assert stop_line.left_by_peers(world_size=2, wait_s=0, timeout_s=0.5) is None
    assert time.monotonic() - started < 5
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


class _Fits:
    """An AtscaleCLI stand-in whose fit ends as a rank's does in a DDP job whose streamed data went away."""

    summary = None
    ends_with: BaseException = SystemExit(0)

    def __init__(self, **kwargs: object) -> None:
        self.trainer = SimpleNamespace(world_size=2)

    def fit(self) -> int:
        raise self.ends_with

    def _release_lock(self) -> None:
        pass


def _cli(monkeypatch: pytest.MonkeyPatch, rank: int, ends_with: BaseException) -> object:
    from recipes.run import cli
    from recipes.run.context import ENV_RUN_NAME

    monkeypatch.setattr(_Fits, "ends_with", ends_with)
    monkeypatch.setattr(cli, "AtscaleCLI", _Fits)
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv(ENV_RUN_NAME, "r")  # what the launching process hands the ranks it starts
    if rank == 0:
        monkeypatch.delenv(ENV_RUN_NAME)
    monkeypatch.setattr(cli, "install_stop_signals", lambda: None)  # this process's handlers stay pytest's
    monkeypatch.setattr(cli, "ignore_stop_signals", lambda: None)
    return cli


def test_rank_0_that_lost_a_peer_prints_the_line_the_peer_left(store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1 met the outage first and left (exit 0: Lightning's launcher started it); rank 0, in an all-reduce,
    saw a lost peer. Its line said only that ("a peer process was lost"), not that the bucket was gone."""
    from datamodules.streaming import StreamStopped

    cli = _cli(monkeypatch, rank=1, ends_with=StreamStopped(LINE))
    assert cli.run_cli([]) == 0  # a started rank's orderly stop
    assert capsys.readouterr().err == ""  # rank 1 says nothing itself
    cli = _cli(monkeypatch, rank=0, ends_with=RuntimeError(GLOO_LOST))
    assert cli.run_cli([]) == 75
    assert capsys.readouterr().err.splitlines() == [LINE]


def test_a_peer_that_left_no_line_is_a_lost_peer(store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    cli = _cli(monkeypatch, rank=0, ends_with=RuntimeError(GLOO_LOST))
    monkeypatch.setattr(stop_line, "left_by_peers", lambda world, wait_s=0.0: None)  # no 1 s wait in a unit test
    assert cli.run_cli([]) == 75
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: a peer process was lost (Connection closed by peer at 127.0.0.1:6001)")


def test_the_line_is_kept_by_the_loaders_stop() -> None:
    """The loader's stop carries its line whether or not this rank prints it (only global rank 0 does)."""
    from datamodules.streaming import StopOnFault, StreamStopped, StreamUnavailable

    def gone() -> Iterator[int]:
        raise StreamUnavailable(LINE)
        yield 0

    with pytest.raises(StreamStopped) as stopped:
        next(StopOnFault(gone(), loud=False))
    assert stopped.value.code == 75 and stopped.value.line == LINE
