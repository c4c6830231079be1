"""The ``--store s3`` bucket: moto's S3 server (a thread) on loopback behind a TCP proxy the soak can take down.

The launches reach the bucket only through the proxy, so that a ``bucket_outage`` fault fails their requests
(connections reset, or ``503``) while moto keeps its objects; the soak reads the bucket straight from moto to
check what the launches left there (the pointer, the records, the objects' sizes and SHA-256).

The proxy can also play a distant object store (``python -m recipes.bench stream``): each response waits
``latency_s`` after its request arrived (S3's first-byte latency; moto on loopback answers in well under a
millisecond), and each connection's responses flow at ``bytes_per_s`` at most (S3's per-request bandwidth: a
client that wants more opens more connections).
"""

from __future__ import annotations

import json
import select
import socket
import struct
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from callbacks.storage import ckpt_store

if TYPE_CHECKING:
    from moto.server import ThreadedMotoServer


class Bucket:
    """A local object store for ``--store s3``: moto's S3 server on loopback, reached through a proxy that can fail.

    moto keeps its objects in memory, so stopping it would lose the bucket; instead every launch talks to
    a small TCP proxy in this process (``endpoint``), and an *outage* makes the proxy fail every request,
    new and in flight: ``reset`` cuts connections (the network is gone: botocore's EndpointConnectionError),
    ``503`` answers ``503 ServiceUnavailable`` (the service errs). The soak itself reads the bucket straight
    from moto (``direct``), so it can check the pointer while the launches see an outage. Up, when one side
    closes (moto closes each connection once its response is sent) the other is closed in order, after what was
    sent to it: only an outage resets a connection.

    Shaping (:meth:`shape`; both off by default, and then the proxy only copies bytes): a *request* is the client
    bytes that arrive on a connection after the previous response began (or the first on it); the first bytes
    of its response are held until ``latency_s`` after it arrived. Every connection's upstream-to-client bytes
    then go out as over a link of ``bytes_per_s``: a block of ``n`` bytes leaves ``n / bytes_per_s`` after the
    link was last free (never before its bytes arrived), so a response of ``N`` bytes takes at least
    ``latency_s + N / bytes_per_s`` from its request, and an idle link saves no credit for a burst. Each
    connection has its own thread and its own link: one slow stream never delays another.

    Args:
        log: where moto's request lines go.
        latency_s: seconds each response waits after its request arrived (0: none).
        bytes_per_s: each connection's bandwidth toward the client in bytes per second (``None``: unlimited).

    Raises:
        ValueError: for a negative latency or a bandwidth that is not positive (named).
    """

    NAME = "atscale-chaos"
    MODES = ("reset", "503")
    _ERROR = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>ServiceUnavailable</Code>"
              b"<Message>chaos soak: bucket outage</Message></Error>")

    def __init__(self, log: Path, latency_s: float = 0.0, bytes_per_s: float | None = None) -> None:
        self.log = log
        self.latency_s = 0.0
        self.bytes_per_s: float | None = None
        self.shape(latency_s, bytes_per_s)
        self.server: ThreadedMotoServer | None = None
        self.direct = ""
        self.endpoint = ""
        self.mode = "up"
        self.outages: list[list[Any]] = []  # [mode, seconds] of every outage so far
        self._listener: socket.socket | None = None
        self._fs: Any = None
        self._request_log: Any = None

    def env(self) -> dict[str, str]:
        """What a launch needs to reach the bucket (through the proxy) with the standard AWS variables only."""
        return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": self.endpoint}

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.NAME}", *parts])

    def start(self) -> None:
        """Start moto on a free port (a thread of this process), create the bucket, open the proxy."""
        import logging

        from moto.server import ThreadedMotoServer

        self.log.parent.mkdir(parents=True, exist_ok=True)
        requests = logging.getLogger("werkzeug")  # moto's request lines: to the log, not the soak's console
        self._request_log = logging.FileHandler(self.log)
        requests.addHandler(self._request_log)
        requests.setLevel(logging.INFO)
        requests.propagate = False
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.direct = "http://{}:{}".format(*self.server.get_host_and_port())
        self.fs().call_s3("create_bucket", Bucket=self.NAME)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name="bucket-proxy", daemon=True).start()

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self._request_log is not None:
            import logging

            logging.getLogger("werkzeug").removeHandler(self._request_log)
            self._request_log.close()
            self._request_log = None

    def fs(self) -> Any:
        """An s3fs filesystem straight on moto (not through the proxy): the soak's own view of the bucket."""
        if self._fs is None:
            import s3fs

            self._fs = s3fs.S3FileSystem(key="testing", secret="testing", skip_instance_cache=True,
                                         client_kwargs={"endpoint_url": self.direct, "region_name": "us-east-1"})
        return self._fs

    def shape(self, latency_s: float = 0.0, bytes_per_s: float | None = None) -> None:
        """Play a store ``latency_s`` away at ``bytes_per_s`` per connection (``0.0, None``: the proxy only copies).

        A connection keeps the shaping it was opened with (a client's pooled one too): change it between runs.
        """
        if not latency_s >= 0:
            raise ValueError(f"Bucket(latency_s={latency_s!r}) must be >= 0 seconds.")
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"Bucket(bytes_per_s={bytes_per_s!r}) must be > 0 (None: unlimited).")
        self.latency_s = float(latency_s)
        self.bytes_per_s = None if bytes_per_s is None else float(bytes_per_s)

    def down(self, mode: str) -> None:
        assert mode in self.MODES, mode
        self.mode = mode
        self.outages.append([mode, None])
        self._down_at = time.monotonic()

    def up(self) -> None:
        if self.mode != "up":
            self.outages[-1][1] = round(time.monotonic() - self._down_at, 3)
        self.mode = "up"

    # ------------------------------------------------------------ the proxy
    def _accept(self) -> None:
        listener = self._listener
        while listener is not None:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            target = self._pump if self.mode == "up" else self._refuse
            threading.Thread(target=target, args=(conn,), daemon=True).start()

    @staticmethod
    def _reset(sock: socket.socket) -> None:
        """Close with a TCP reset (SO_LINGER 0), as a vanished network path or a dead server does."""
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        except OSError:
            pass

    def _refuse(self, conn: socket.socket) -> None:
        if self.mode == "503":
            conn.settimeout(5)
            head = b""
            try:
                while b"\r\n\r\n" not in head and len(head) < 1 << 16:
                    chunk = conn.recv(1 << 16)
                    if not chunk:
                        break
                    head += chunk
                conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(self._ERROR) + self._ERROR)
            except OSError:
                pass
        self._reset(conn)

    def _pump(self, conn: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", int(self.direct.rsplit(":", 1)[1])), timeout=10)
        except OSError:
            self._reset(conn)
            return
        link = _Link(self.latency_s, self.bytes_per_s) if self.latency_s or self.bytes_per_s else None
        ended = False  # one side closed: the other gets what was sent, then a FIN (a reset would drop the rest)
        try:
            while self.mode == "up":  # an outage cuts connections in flight too (an upload half-sent)
                ready, _, _ = select.select([conn, upstream], [], [], 0.1)
                for sock in ready:
                    data = sock.recv(1 << 16)
                    if not data:
                        ended = True
                        return
                    if link is not None:
                        if sock is conn:
                            link.request()
                        elif not self._wait(link.release(len(data))):
                            return
                    (upstream if sock is conn else conn).sendall(data)
        except OSError:
            pass
        finally:
            for sock in (conn, upstream):
                if ended and self.mode == "up":
                    sock.close()
                else:
                    self._reset(sock)

    def _wait(self, until: float) -> bool:
        """Sleep until ``until`` (``time.monotonic``), in short naps so an outage cuts in; False on an outage."""
        while (left := until - time.monotonic()) > 0:
            if self.mode != "up":
                return False
            time.sleep(min(left, 0.05))
        return self.mode == "up"

    # ------------------------------------------------------------ what the bucket holds
    def verified(self, url: str, name: str) -> tuple[dict[str, Any] | None, str | None]:
        """``(record, None)`` if checkpoint ``name`` under ``url`` is complete and every object matches its
        record's size and SHA-256; else ``(record or None, why not)``."""
        import hashlib

        fs, root = self.fs(), url[len("s3://"):]
        try:
            record = json.loads(fs.cat_file(f"{root}/{name}{ckpt_store.META_SUFFIX}"))
        except FileNotFoundError:
            return None, f"{name} has no record"
        for rel, want in record["files"].items():
            key = "/".join(p for p in (root, name, rel) if p)
            try:
                data = fs.cat_file(key)
            except FileNotFoundError:
                return record, f"{rel or name} is missing"
            if len(data) != want["size"] or hashlib.sha256(data).hexdigest() != want["sha256"]:
                return record, f"{rel or name} has {len(data)} bytes / a SHA-256 unlike its record's"
        return record, None

    def pointer(self, url: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.fs().cat_file(f"{url[len('s3://'):]}/latest.json"))
        except FileNotFoundError:
            return None

    def records(self, url: str) -> list[dict[str, Any]]:
        """Every checkpoint record under ``url``, newest (step, then save time) first; unverified."""
        fs, root = self.fs(), url[len("s3://"):]
        fs.invalidate_cache()
        try:
            metas = [p for p in fs.ls(root, detail=False, refresh=True) if p.endswith(ckpt_store.META_SUFFIX)]
        except FileNotFoundError:
            return []
        return sorted((json.loads(fs.cat_file(p)) for p in metas),
                      key=lambda r: (int(r["global_step"]), float(r["saved_at"])), reverse=True)

    def newest(self, url: str) -> tuple[str, int] | None:
        """What a launch resumes from in the bucket: the pointer's checkpoint if it verifies, else the newest
        record (by step, then save time) that does (as ``RemoteCheckpoints.fetch_newest_good``)."""
        self.fs().invalidate_cache()
        pointer = self.pointer(url)
        if pointer is not None and self.verified(url, pointer["name"])[1] is None:
            return pointer["name"], int(pointer["global_step"])
        for record in self.records(url):
            if self.verified(url, record["name"])[1] is None:
                return record["name"], int(record["global_step"])
        return None


class _Link:
    """One proxied connection's latency and bandwidth toward the client (:class:`Bucket`'s shaping).

    ``request()`` notes client bytes; the first after a response began opens a new request, whose first response
    bytes :meth:`release` holds until ``latency_s`` after it. ``release(n)`` books ``n`` bytes on the link and
    returns when they may leave: when the link has carried them at ``bytes_per_s`` (from when it was last free,
    or from now if it sat idle), their last byte's time.
    """

    def __init__(self, latency_s: float, bytes_per_s: float | None) -> None:
        self.latency_s = latency_s
        self.bytes_per_s = bytes_per_s
        self.asked: float | None = None  # when the request now awaiting its response arrived
        self.responding = True  # a response began since the last request (so the next client bytes are a new one)
        self.free_at = 0.0  # when the link has sent everything booked on it

    def request(self) -> None:
        if self.responding:
            self.asked = time.monotonic()
            self.responding = False

    def release(self, size: int) -> float:
        start = time.monotonic()
        if self.asked is not None:
            start = max(start, self.asked + self.latency_s)
            self.asked = None
        self.responding = True
        if self.bytes_per_s is None:
            return start
        self.free_at = max(self.free_at, start) + size / self.bytes_per_s
        return self.free_at
