"""callbacks.utils.notices: each cloud's metadata answer read as a notice or not, the poller's backoff, signals as
notices, and SLURM's requeue; no network (the requests are answered here) and no subprocess.

The URL-credential helpers are tested beside the other callbacks, in ``tests/unit/callbacks/test_notices.py``.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from callbacks.utils import notices
from callbacks.utils.notices import (
    Notice,
    NoticePoller,
    SignalNotices,
    check_aws,
    check_azure,
    check_gcp,
    detect_provider,
    requeue_slurm_job,
)

BASE = "http://169.254.169.254"


class MetadataService:
    """Answers ``notices._request`` from a table ``{(method, url): (status, body)}``, recording each request."""

    def __init__(self, answers: dict[tuple[str, str], tuple[int, bytes]]) -> None:
        self.answers, self.requests = answers, []

    def __call__(self, url: str, method: str = "GET", headers: dict[str, str] | None = None,
                 timeout: float = 1.0) -> tuple[int, bytes]:
        self.requests.append((method, url, headers, timeout))
        if (method, url) not in self.answers:
            raise ConnectionRefusedError(111, "Connection refused")
        return self.answers[(method, url)]


@pytest.fixture
def service(monkeypatch) -> Iterator[MetadataService]:
    fake = MetadataService({})
    monkeypatch.setattr(notices, "_request", fake)
    yield fake


TOKEN = ("PUT", f"{BASE}/latest/api/token")
ACTION = ("GET", f"{BASE}/latest/meta-data/spot/instance-action")


# ------------------------------------------------------------------------------------------------------- AWS
def test_aws_without_a_scheduled_action_is_no_notice(service: MetadataService) -> None:
    service.answers.update({TOKEN: (200, b"tok-123"), ACTION: (404, b"")})
    assert check_aws(BASE, timeout=0.5) is None
    assert service.requests == [
        ("PUT", TOKEN[1], {"X-aws-ec2-metadata-token-ttl-seconds": "21600"}, 0.5),
        ("GET", ACTION[1], {"X-aws-ec2-metadata-token": "tok-123"}, 0.5)]


def test_aws_instance_action_is_a_notice_with_its_action_and_time(service: MetadataService) -> None:
    body = json.dumps({"action": "terminate", "time": "2026-12-06T18:32:00Z"}).encode()
    service.answers.update({TOKEN: (200, b"t"), ACTION: (200, body)})
    assert check_aws(BASE) == Notice("aws", "terminate at 2026-12-06T18:32:00Z")


@pytest.mark.parametrize(("token", "action", "message"), [
    ((401, b""), (200, b"{}"), f"IMDSv2 token request to {BASE} answered HTTP 401"),
    ((200, b"t"), (500, b""), f"spot/instance-action at {BASE} answered HTTP 500"),
])
def test_aws_errors_name_the_request_and_status(service: MetadataService, token, action, message: str) -> None:
    service.answers.update({TOKEN: token, ACTION: action})
    with pytest.raises(ConnectionError) as raised:
        check_aws(BASE)
    assert str(raised.value) == message


# ------------------------------------------------------------------------------------------------------- GCP
PREEMPTED = ("GET", f"{BASE}/computeMetadata/v1/instance/preempted")


@pytest.mark.parametrize(("body", "notice"), [
    (b"TRUE", Notice("gcp", "preempted")), (b"true\n", Notice("gcp", "preempted")), (b"FALSE", None), (b"", None),
])
def test_gcp_preempted_true_is_a_notice(service: MetadataService, body: bytes, notice: Notice | None) -> None:
    service.answers[PREEMPTED] = (200, body)
    assert check_gcp(BASE) == notice
    assert service.requests[0][2] == {"Metadata-Flavor": "Google"}


def test_gcp_error_names_the_status(service: MetadataService) -> None:
    service.answers[PREEMPTED] = (503, b"")
    with pytest.raises(ConnectionError, match=rf"^instance/preempted at {BASE} answered HTTP 503$"):
        check_gcp(BASE)


# ----------------------------------------------------------------------------------------------------- Azure
EVENTS = ("GET", f"{BASE}/metadata/scheduledevents?api-version=2020-07-01")


@pytest.mark.parametrize(("body", "notice"), [
    (b"", None),
    (json.dumps({"Events": []}).encode(), None),
    (json.dumps({"Events": [{"EventType": "Reboot", "EventId": "a"}]}).encode(), None),
    (json.dumps({"Events": [{"EventType": "Reboot"}, {"EventType": "Preempt", "EventId": "E1",
                                                      "NotBefore": "Sun, 06 Dec 2026 18:32:00 GMT"}]}).encode(),
     Notice("azure", "Preempt E1 not before Sun, 06 Dec 2026 18:32:00 GMT")),
])
def test_azure_a_preempt_event_is_a_notice(service: MetadataService, body: bytes, notice: Notice | None) -> None:
    service.answers[EVENTS] = (200, body)
    assert check_azure(BASE) == notice
    assert service.requests[0][2] == {"Metadata": "true"}


def test_azure_error_names_the_status(service: MetadataService) -> None:
    service.answers[EVENTS] = (404, b"")
    with pytest.raises(ConnectionError, match=r"^scheduledevents at .* answered HTTP 404$"):
        check_azure(BASE)


# -------------------------------------------------------------------------------------------------- detection
def test_the_first_provider_that_answers_is_detected(service: MetadataService) -> None:
    service.answers[PREEMPTED] = (200, b"FALSE")  # AWS refuses the connection, GCP answers
    assert detect_provider(BASE) == "gcp"
    assert [r[1] for r in service.requests] == [TOKEN[1], PREEMPTED[1]]


def test_off_the_clouds_no_provider_is_detected(service: MetadataService) -> None:
    assert detect_provider(BASE) is None
    assert len(service.requests) == 3  # one look at each


# ----------------------------------------------------------------------------------------------------- poller
def test_a_poller_for_an_unknown_provider_is_refused() -> None:
    with pytest.raises(ValueError) as refused:
        NoticePoller("oracle", print)
    assert str(refused.value) == "NoticePoller(provider='oracle') must be one of ['aws', 'azure', 'gcp']."


def test_the_poller_backs_off_while_failing_reports_once_without_credentials_and_stops_at_a_notice(
        monkeypatch, caplog) -> None:
    answers: list[object] = [OSError("timed out"), ValueError("bad JSON from http://u:pw@h/"), None,
                             Notice("aws", "terminate at T")]

    def check(base_url: str, timeout: float) -> Notice | None:
        assert (base_url, timeout) == ("http://u:pw@127.0.0.1:9", 0.25)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]

    monkeypatch.setitem(notices.CHECKS, "aws", check)
    seen: list[Notice] = []
    poller = NoticePoller("aws", seen.append, base_url="http://u:pw@127.0.0.1:9/", interval_s=1.0, timeout_s=0.25,
                          max_backoff_s=3.0)
    waits: list[float] = []
    monkeypatch.setattr(poller._stop, "wait", waits.append)
    with caplog.at_level(logging.WARNING, logger=notices.__name__):
        poller._run()  # in this thread: the loop's decisions, without its clock
    assert seen == [Notice("aws", "terminate at T")]
    assert waits == [2.0, 3.0, 1.0]  # doubled, capped at max_backoff_s, back to the interval once it answers
    assert (poller.polls, poller.failures) == (4, 2)
    assert caplog.messages == ["aws interruption notices unavailable at http://***@127.0.0.1:9 (timed out); "
                               "retrying with backoff."]


def test_a_started_poller_stops_when_asked(monkeypatch) -> None:
    monkeypatch.setitem(notices.CHECKS, "gcp", lambda base_url, timeout: None)
    poller = NoticePoller("gcp", print, base_url=BASE, interval_s=60.0)
    poller.start()
    deadline = time.monotonic() + 10
    while poller.polls == 0:  # its first look taken, it waits out its 60 s interval
        assert time.monotonic() < deadline, "the poller never polled"
        time.sleep(0.001)
    poller.stop()
    assert poller._thread is not None and not poller._thread.is_alive() and poller.polls == 1


# ---------------------------------------------------------------------------------------------------- signals
@pytest.fixture
def usr1() -> Iterator[list[tuple[int, object]]]:
    """SIGUSR1 handled by a recorder for the test, the process's own handler back afterwards."""
    calls: list[tuple[int, object]] = []
    saved = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append((signum, frame)))
    yield calls
    signal.signal(signal.SIGUSR1, saved)


def test_a_signal_is_a_notice_while_installed_and_goes_back_to_its_handler_after(usr1) -> None:
    seen: list[Notice] = []
    handlers = SignalNotices(["SIGUSR1"], seen.append)
    assert handlers.signums == [signal.SIGUSR1]
    recorder = signal.getsignal(signal.SIGUSR1)
    handlers.install()
    signal.raise_signal(signal.SIGUSR1)
    assert seen == [Notice("signal", "SIGUSR1")] and usr1 == []
    handlers.restore()
    assert signal.getsignal(signal.SIGUSR1) is recorder
    handlers._on_signal(signal.SIGUSR1, None)  # re-installed by someone else after restore: passed on
    assert seen == [Notice("signal", "SIGUSR1")] and usr1 == [(signal.SIGUSR1, None)]


def test_installing_twice_keeps_the_handler_found_first(usr1) -> None:
    handlers = SignalNotices(["SIGUSR1"], print)
    recorder = signal.getsignal(signal.SIGUSR1)
    handlers.install()
    handlers.install()
    assert handlers.original == {signal.SIGUSR1: recorder}
    handlers.restore()
    assert signal.getsignal(signal.SIGUSR1) is recorder


class Stopped(Exception):
    """What the process's own SIGINT handler raises in the test below."""


def test_a_second_sigint_stops_now_through_the_handler_found_at_install_time() -> None:
    def own(signum: int, frame: object) -> None:
        raise Stopped(signum)

    saved = signal.signal(signal.SIGINT, own)
    seen: list[Notice] = []
    handlers = SignalNotices(["SIGTERM", "SIGINT"], seen.append)
    try:
        handlers.install()
        handlers._on_signal(signal.SIGINT, None)  # the first Ctrl-C: a notice, saved at the next step
        handlers._on_signal(signal.SIGTERM, None)  # a SIGTERM meanwhile changes nothing
        assert seen == [Notice("signal", "SIGINT"), Notice("signal", "SIGTERM")]
        with pytest.raises(Stopped):  # the second: stop now, as the process stops on a Ctrl-C
            handlers._on_signal(signal.SIGINT, None)
        handlers.original[signal.SIGINT] = signal.SIG_DFL  # no handler of Python's to call: Ctrl-C's exception
        with pytest.raises(KeyboardInterrupt):
            handlers._on_signal(signal.SIGINT, None)
    finally:
        handlers.restore()
        signal.signal(signal.SIGINT, saved)


def test_an_unknown_signal_name_is_refused() -> None:
    with pytest.raises(KeyError):
        SignalNotices(["SIGKILL"], print)


# ------------------------------------------------------------------------------------------------------ SLURM
@pytest.fixture
def slurm(monkeypatch) -> list[list[str]]:
    """SLURM's variables cleared, ``scontrol`` found at /usr/bin, and the commands it would run recorded."""
    for key in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(key, raising=False)
    ran: list[list[str]] = []

    def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        ran.append(command)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(notices, "shutil", SimpleNamespace(which=lambda name: f"/usr/bin/{name}"))
    monkeypatch.setattr(notices, "subprocess", SimpleNamespace(run=run))
    return ran


def test_outside_slurm_nothing_is_requeued(slurm: list[list[str]]) -> None:
    requeue_slurm_job()
    assert slurm == []


def test_a_job_is_requeued_by_its_id_an_array_task_by_both(slurm, monkeypatch, caplog) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with caplog.at_level(logging.WARNING, logger=notices.__name__):
        requeue_slurm_job()
        monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4200")
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
        requeue_slurm_job()
    assert slurm == [["/usr/bin/scontrol", "requeue", "4242"], ["/usr/bin/scontrol", "requeue", "4200_7"]]
    assert caplog.messages == ["Requeued SLURM job 4242.", "Requeued SLURM job 4200_7."]


def test_a_failed_or_impossible_requeue_is_logged_not_raised(slurm, monkeypatch, caplog) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setattr(notices, "subprocess", SimpleNamespace(
        run=lambda command, **kw: subprocess.CompletedProcess(command, 1, "", "Invalid job id specified\n")))
    with caplog.at_level(logging.WARNING, logger=notices.__name__):
        requeue_slurm_job()
        monkeypatch.setattr(notices, "shutil", SimpleNamespace(which=lambda name: None))
        requeue_slurm_job()
    assert caplog.messages == ["scontrol requeue 9 failed (1): Invalid job id specified",
                               "SLURM job 9: scontrol not found, cannot requeue."]


def test_each_providers_warning_and_address() -> None:
    assert notices.WARNING_SECONDS == {"aws": 120.0, "gcp": 30.0, "azure": 30.0}
    assert notices.DEFAULT_BASE_URLS == {"aws": "http://169.254.169.254", "gcp": "http://metadata.google.internal",
                                         "azure": "http://169.254.169.254"}
