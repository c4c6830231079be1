"""Where interruption notices come from: the cloud's metadata service (polled), signals, and SLURM.

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
have short timeouts, failures back off exponentially, and only the first one is reported (credentials
in the URL, ``http://user:password@host``, are sent as HTTP basic auth and never printed).
:class:`SignalNotices` turns SIGTERM/SIGUSR1/SIGINT into the same kind of notice, and
:func:`requeue_slurm_job` puts a SLURM job back in the queue after its notice save.
No Lightning import; the standard library is all it needs.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

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


def split_credentials(url: str) -> tuple[str, dict[str, str]]:
    """``http://user:password@host/...`` -> ``("http://host/...", {"Authorization": "Basic ..."})``.

    urllib cannot open a URL with credentials in it (it reads ``user:password@host`` as the host); they
    travel as HTTP basic auth instead. A URL without credentials comes back as it is, with no header.
    """
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url, {}
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, _, password = userinfo.partition(":")
    token = base64.b64encode(f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}".encode()).decode()
    return urllib.parse.urlunsplit(parts._replace(netloc=host)), {"Authorization": f"Basic {token}"}


def without_credentials(text: str) -> str:
    """``text`` with the credentials of every URL in it (``scheme://user:password@``, ``scheme://TOKEN@``) masked."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}***@", text)


# the userinfo runs to the authority's LAST '@', as urllib3 and requests split it: a password may hold an '@'
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s]*@")


def _request(url: str, method: str = "GET", headers: dict[str, str] | None = None,
             timeout: float = 1.0) -> tuple[int, bytes]:
    url, auth = split_credentials(url)
    req = urllib.request.Request(url, method=method, headers={**(headers or {}), **auth})
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
                if self.failures == 0:  # the URL may carry credentials: never printed
                    log.warning("%s interruption notices unavailable at %s (%s); retrying with backoff.",
                                self.provider, without_credentials(self.base_url), without_credentials(str(err)))
                self.failures += 1
                wait = min(max(wait, self.interval_s) * 2, self.max_backoff_s)
            else:
                wait = self.interval_s
                if notice is not None:
                    self.on_notice(notice)
                    return
            self._stop.wait(wait)


#: Signals that may count as an interruption notice, by name.
SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGUSR1": signal.SIGUSR1, "SIGINT": signal.SIGINT}
#: SIGINTs this process took as notices (Ctrl-C presses that asked for a checkpoint): a press after training ended,
#: while the run wraps up, is then a second one, and stops at once (``recipes.run.process``).
_interrupt_notices = [0]


def interrupt_notices() -> int:
    """How many SIGINTs this process took as notices since :func:`forget_interrupt_notices`."""
    return _interrupt_notices[0]


def forget_interrupt_notices() -> None:
    """Start counting anew (a next fit in the same process)."""
    _interrupt_notices[0] = 0


class SignalNotices:
    """Signal handlers that only record a notice (a flag; the training loop acts on it between steps).

    A second SIGINT while the first one's notice is pending stops now, as the SIGINT handler found at install time
    does (``KeyboardInterrupt`` by default): a person who presses Ctrl-C again wants the process to stop at once.
    Once :meth:`restore` ran, a signal that still reaches the handler (Lightning may re-install it
    when it restores its own) goes to the handler found at install time, as if never replaced.
    """

    def __init__(self, names: list[str], notify: Callable[[Notice], None]) -> None:
        self.signums = [SIGNALS[name] for name in names]
        self.notify = notify
        self.active = False
        self.original: dict[int, Any] = {}
        self.interrupts = 0  # SIGINTs taken while active

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.active:
            if signum == signal.SIGINT:
                self.interrupts += 1
                _interrupt_notices[0] += 1
                if self.interrupts > 1:  # stop now, as the handler found at install time stops (Ctrl-C's default)
                    previous = self.original.get(signum)
                    if callable(previous) and previous is not self._on_signal:
                        previous(signum, frame)
                    raise KeyboardInterrupt
            self.notify(Notice("signal", signal.Signals(signum).name))
            return
        previous = self.original.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        else:
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
            os.kill(os.getpid(), signum)

    def install(self) -> None:
        """Take the signals (main thread only; signal handlers cannot be set elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self.active = True
        for signum in self.signums:
            previous = signal.signal(signum, self._on_signal)
            if previous != self._on_signal:
                self.original.setdefault(signum, previous)

    def restore(self) -> None:
        """Give the signals back to the handlers found at install time."""
        self.active = False
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self.original.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def requeue_slurm_job() -> None:
    """Under SLURM, ``scontrol requeue`` this job (an array task: ``<array job>_<task>``); logged, never raises."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{array_job}_{task}" if array_job and task else job
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        log.warning("SLURM job %s: scontrol not found, cannot requeue.", job_id)
        return
    result = subprocess.run([scontrol, "requeue", job_id], check=False, capture_output=True, text=True)
    if result.returncode == 0:
        log.warning("Requeued SLURM job %s.", job_id)
    else:
        log.warning("scontrol requeue %s failed (%d): %s", job_id, result.returncode, result.stderr.strip())
