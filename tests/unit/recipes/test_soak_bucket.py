"""recipes.soak.bucket: the proxy's latency and bandwidth on a real moto server (a GET timed through it), the proxy
unshaped by default, a response kept whole when moto closes its connection, and outages that still cut shaped
connections."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from recipes.soak import bucket as bucket_module
from recipes.soak.bucket import Bucket

KEY = "blob.bin"
SIZE = 400_000  # bytes of the object each GET reads
BIG = "big.bin"  # 2 MB: more than the sockets' buffers hold


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bucket]:
    """moto behind the proxy, one object of SIZE random bytes in it (written straight to moto)."""
    store = Bucket(tmp_path_factory.mktemp("bucket") / "moto.log")
    store.start()
    try:
        store.fs().pipe_file(f"{Bucket.NAME}/{KEY}", os.urandom(SIZE))
        store.fs().pipe_file(f"{Bucket.NAME}/{BIG}", os.urandom(2_000_000))
        yield store
    finally:
        store.stop()


@pytest.fixture
def unshaped(bucket: Bucket) -> Iterator[Bucket]:
    yield bucket
    bucket.shape()
    bucket.up()


def _client(endpoint: str) -> Any:
    """A fresh boto3 client (its own connection) that tries once: a 503 is an error, not a retry."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                        region_name="us-east-1", config=Config(retries={"max_attempts": 1, "mode": "standard"}))


def _timed_get(endpoint: str, together: threading.Barrier | None = None,
               spans: list[tuple[float, float]] | None = None) -> tuple[bytes, float]:
    """The object's bytes through ``endpoint`` and the seconds from the request to its last byte (the span also
    appended to ``spans``; with ``together``, every thread's GET starts at once)."""
    client = _client(endpoint)
    client.head_bucket(Bucket=Bucket.NAME)  # the connection is open and the client warm before the clock
    if together is not None:
        together.wait()
    started = time.monotonic()
    body = client.get_object(Bucket=Bucket.NAME, Key=KEY)["Body"].read()
    ended = time.monotonic()
    if spans is not None:
        spans.append((started, ended))
    return body, ended - started


@pytest.mark.serial
def test_a_get_takes_the_latency_plus_its_bytes_over_the_bandwidth(unshaped: Bucket) -> None:
    direct, _ = _timed_get(unshaped.direct)
    unshaped.shape(latency_s=0.3, bytes_per_s=1_000_000)
    body, seconds = _timed_get(unshaped.endpoint)
    assert body == direct and len(body) == SIZE
    floor = 0.3 + SIZE / 1_000_000  # 0.7 s: the body alone, headers not counted
    assert floor <= seconds < floor + 1.5, seconds
    # two connections at once: each has its own link and thread, so neither waits for the other (one link
    # shared by both would end the later GET 0.3 + 0.8 = 1.1 s after the two began; one after the other, 1.4 s)
    spans: list[tuple[float, float]] = []
    together = threading.Barrier(2)
    threads = [threading.Thread(target=_timed_get, args=(unshaped.endpoint, together, spans)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(spans) == 2 and min(end - start for start, end in spans) >= floor
    assert max(end for _, end in spans) - min(start for start, _ in spans) < 1.1, spans


def test_latency_alone_and_bandwidth_alone(unshaped: Bucket) -> None:
    unshaped.shape(latency_s=0.25)
    assert (unshaped.latency_s, unshaped.bytes_per_s) == (0.25, None)
    assert _timed_get(unshaped.endpoint)[1] >= 0.25
    unshaped.shape(bytes_per_s=2_000_000)
    assert (unshaped.latency_s, unshaped.bytes_per_s) == (0.0, 2_000_000.0)
    assert _timed_get(unshaped.endpoint)[1] >= SIZE / 2_000_000  # 0.2 s


def test_unshaped_the_proxy_only_copies_bytes(unshaped: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = Bucket(Path("unused.log"))
    assert (fresh.latency_s, fresh.bytes_per_s) == (0.0, None)  # the default: the soak's proxy as it was

    def no_link(*args: Any) -> None:
        raise AssertionError("an unshaped proxy made a shaping link")

    monkeypatch.setattr(bucket_module, "_Link", no_link)
    direct, _ = _timed_get(unshaped.direct)
    body, seconds = _timed_get(unshaped.endpoint)
    assert body == direct
    assert seconds < 0.3 + SIZE / 1_000_000  # far from the shaped GET's floor


def test_outages_still_fail_shaped_connections(unshaped: Bucket) -> None:
    from botocore.exceptions import ClientError

    unshaped.shape(bytes_per_s=100_000)  # the GET would take 4 s
    failed: list[BaseException] = []

    def slow_get() -> None:
        try:
            _timed_get(unshaped.endpoint)
        except Exception as err:  # botocore's, whichever the reset meets: the headers or the body cut short
            failed.append(err)

    reader = threading.Thread(target=slow_get)
    started = time.monotonic()
    reader.start()
    time.sleep(0.5)
    unshaped.down("reset")  # cuts the connection in flight, mid-body
    reader.join(timeout=10)
    assert failed and time.monotonic() - started < 3.0, failed
    unshaped.up()
    unshaped.down("503")
    with pytest.raises(ClientError, match="ServiceUnavailable"):
        _client(unshaped.endpoint).get_object(Bucket=Bucket.NAME, Key=KEY)
    unshaped.up()
    assert _timed_get(unshaped.endpoint)[0][:1]  # back up, still shaped: it reads again


def test_a_reader_that_pauses_still_gets_the_whole_body(unshaped: Bucket) -> None:
    """moto closes its connection once a response is sent; the proxy used to reset the client's then (SO_LINGER 0),
    which dropped what the client had not read yet: a 2 MB GET read after a pause failed every time."""
    for _ in range(3):
        body = _client(unshaped.endpoint).get_object(Bucket=Bucket.NAME, Key=BIG)["Body"]
        time.sleep(0.3)  # the reader busy elsewhere while moto sends everything and closes
        assert len(body.read()) == 2_000_000


@pytest.mark.parametrize(("settings", "message"), [
    ({"latency_s": -0.1}, "latency_s=-0.1"),
    ({"bytes_per_s": 0}, "bytes_per_s=0"),
    ({"bytes_per_s": -5.0}, "bytes_per_s=-5.0"),
])
def test_bad_shaping_is_named(settings: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        Bucket(Path("unused.log"), **settings)
