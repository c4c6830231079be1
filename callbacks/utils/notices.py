"""Cloud interruption notices, polled from the instance metadata service in a background thread.

========  =======  ==========================================================================
cloud     warning  endpoint (relative to the metadata base URL)
========  =======  ==========================================================================
AWS       2 min    IMDSv2: ``PUT /latest/api/token`` then ``GET /latest/meta-data/spot/instance-action``
                   (404: none; 200 JSON ``{"action", "time"}``: notice)
GCP       30 s     ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google`` -> ``TRUE``
Azure     >= 30 s  ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``
                   -> an event whose ``EventType`` is ``Preempt``
========  =======  ==========================================================================

The poller only calls ``on_notice``; what to do about a notice (agree across ranks, save, stop)
is the spot callback's business. An unreachable endpoint never raises into training: requests
have short timeouts, failures back off exponentially, and only the first one is reported.
No Lightning import; the standard library's ``urllib`` is all it needs.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)

Provider = Literal["aws", "gcp", "azure"]

#: Where each provider's metadata service answers on a real instance.
DEFAULT_BASE_URLS: dict[str, str] = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
#: How long before the kill each provider warns, in seconds.
WARNING_SECONDS: dict[str, float] = {"aws": 120.0, "gcp": 30.0, "azure": 30.0}


@dataclass(frozen=True)
class Notice:
    """An interruption notice: who sent it and what it said."""

    source: str
    detail: str


def _request(url: str, method: str = "GET", headers: dict[str, str] | None = None,
             timeout: float = 1.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, b""


def check_aws(base_url: str, timeout: float = 1.0) -> Notice | None:
    """One IMDSv2 look at ``spot/instance-action``; ``None`` when no interruption is scheduled."""
    status, token = _request(
        f"{base_url}/latest/api/token",
        method="PUT",
        headers={"X-aws-ec2-metadata-token-ttl-seconds": "21600"},
        timeout=timeout,
    )
    if status != 200:
        raise ConnectionError(f"IMDSv2 token request to {base_url} answered HTTP {status}")
    status, body = _request(
        f"{base_url}/latest/meta-data/spot/instance-action",
        headers={"X-aws-ec2-metadata-token": token.decode()},
        timeout=timeout,
    )
    if status == 404:
        return None
    if status != 200:
        raise ConnectionError(f"spot/instance-action at {base_url} answered HTTP {status}")
    action = json.loads(body)
    return Notice("aws", f"{action.get('action')} at {action.get('time')}")


def check_gcp(base_url: str, timeout: float = 1.0) -> Notice | None:
    """One look at ``instance/preempted``; ``None`` unless it says ``TRUE``."""
    status, body = _request(
        f"{base_url}/computeMetadata/v1/instance/preempted",
        headers={"Metadata-Flavor": "Google"},
        timeout=timeout,
    )
    if status != 200:
        raise ConnectionError(f"instance/preempted at {base_url} answered HTTP {status}")
    return Notice("gcp", "preempted") if body.strip().upper() == b"TRUE" else None


def check_azure(base_url: str, timeout: float = 1.0) -> Notice | None:
    """One look at Scheduled Events; a notice when an event of type ``Preempt`` is listed."""
    status, body = _request(
        f"{base_url}/metadata/scheduledevents?api-version=2020-07-01",
        headers={"Metadata": "true"},
        timeout=timeout,
    )
    if status != 200:
        raise ConnectionError(f"scheduledevents at {base_url} answered HTTP {status}")
    for event in json.loads(body or b"{}").get("Events", []):
        if event.get("EventType") == "Preempt":
            return Notice("azure", f"Preempt {event.get('EventId', '')} not before {event.get('NotBefore', '')}")
    return None


CHECKS: dict[str, Callable[[str, float], Notice | None]] = {
    "aws": check_aws,
    "gcp": check_gcp,
    "azure": check_azure,
}


def detect_provider(base_url: str | None = None, timeout: float = 0.5) -> str | None:
    """The first provider whose metadata service answers, or ``None`` off the clouds."""
    for provider, check in CHECKS.items():
        try:
            check(base_url or DEFAULT_BASE_URLS[provider], timeout)
        except (OSError, ValueError, ConnectionError):
            continue
        return provider
    return None


class NoticePoller:
    """Poll one provider's metadata service in a daemon thread; call ``on_notice`` once.

    Args:
        provider: ``"aws"``, ``"gcp"`` or ``"azure"``.
        on_notice: called (from the polling thread) with the first notice seen.
        base_url: the metadata service's base URL (tests point it at a local server).
        interval_s: seconds between polls while the endpoint answers.
        timeout_s: per-request timeout.
        max_backoff_s: the longest wait between polls of an endpoint that does not answer.
    """

    def __init__(
        self,
        provider: str,
        on_notice: Callable[[Notice], None],
        base_url: str | None = None,
        interval_s: float = 5.0,
        timeout_s: float = 1.0,
        max_backoff_s: float = 60.0,
    ) -> None:
        if provider not in CHECKS:
            raise ValueError(f"NoticePoller(provider={provider!r}) must be one of {sorted(CHECKS)}.")
        self.provider = provider
        self.base_url = (base_url or DEFAULT_BASE_URLS[provider]).rstrip("/")
        self.on_notice = on_notice
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_backoff_s = max_backoff_s
        self.polls = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"notice-poller-{self.provider}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=0.5)  # a daemon: a request still hanging dies with the process

    def _run(self) -> None:
        check = CHECKS[self.provider]
        wait = self.interval_s
        while not self._stop.is_set():
            self.polls += 1
            try:
                notice = check(self.base_url, self.timeout_s)
            except (OSError, ValueError, ConnectionError) as err:
                if self.failures == 0:
                    log.warning("%s interruption notices unavailable at %s (%s); retrying with backoff.",
                                self.provider, self.base_url, err)
                self.failures += 1
                wait = min(max(wait, self.interval_s) * 2, self.max_backoff_s)
            else:
                wait = self.interval_s
                if notice is not None:
                    self.on_notice(notice)
                    return
            self._stop.wait(wait)
