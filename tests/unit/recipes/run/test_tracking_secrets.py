"""A token in the tracking URI (``http://TOKEN@host``) is a bearer token: never a user name, never printed."""

from __future__ import annotations

import http.server
import threading

import pytest

from recipes.run import tracking


def test_token_only_userinfo_becomes_a_bearer_token_not_a_user(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    seen: list[str | None] = []

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://TOKEN123@127.0.0.1:{port}")
        assert tracking.tracking_uri() == f"http://127.0.0.1:{port}"
        import os

        assert os.environ.get("MLFLOW_TRACKING_USERNAME") is None  # MLflow would send it as the run's user
        assert os.environ["MLFLOW_TRACKING_TOKEN"] == "TOKEN123"
        tracking.check_server(tracking.tracking_uri())
        assert seen == ["Bearer TOKEN123"]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("text, shown", [
    ("http://TOKEN123@host:5000/x", "http://***@host:5000/x"),
    ("MLflow at https://u:pw@h and s3://bucket/key", "MLflow at https://***@h and s3://bucket/key"),
    ("file://u:PASSWORD@localhost/runs", "file://***@localhost/runs"),
    ("http://host/path@v2", "http://host/path@v2"),
])
def test_mask_userinfo_masks_passwords_and_lone_tokens(text: str, shown: str) -> None:
    assert tracking.mask_userinfo(text) == shown


def test_a_token_in_the_tracking_uri_is_never_printed_by_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """The token leaves the URI before anything prints it: the URI the CLI shows and stores is the bare host."""
    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://TOKEN123@mlflow.example")
    assert "TOKEN123" not in tracking.tracking_uri()


#: URLs whose userinfo holds an '@' (or more): urllib3 and requests split userinfo from host at the LAST '@' of the
#: authority, so everything before it is the secret the client sends.
AT_IN_SECRETS = [
    ("http://bob:MetaB@PWtail88@127.0.0.1:9/", "http://bob:***@127.0.0.1:9/"),
    ("--spot.metadata_url=http://bob:a@b@c@h:1/x", "--spot.metadata_url=http://bob:***@h:1/x"),
    ("http://me@corp.com:pw@host/x", "http://me@corp.com:***@host/x"),
    ("s3://AKIA:secretpw@b/r", "s3://AKIA:***@b/r"),
    ("see http://u:p@q@h/x and https://v:w@k?y=a@b", "see http://u:***@h/x and https://v:***@k?y=a@b"),
    ("http://host/path@v2", "http://host/path@v2"),
    ("http://u:p@h#frag@x", "http://u:***@h#frag@x"),
]


@pytest.mark.parametrize(("text", "shown"), AT_IN_SECRETS)
def test_redact_splits_userinfo_at_the_last_at_of_the_authority(text: str, shown: str) -> None:
    assert tracking.redact(text) == shown


@pytest.mark.parametrize("url", ["http://bob:MetaB@PWtail88@127.0.0.1:9/", "http://bob:a@b@c@h:1/x", "s3://AKIA:s@cret@b/r",
                                 "http://me@corp.com:pw@host/x", "https://v:w@k?y=a@b", "http://u:p@h#frag@x",
                                 "http://u:p@h\\x@y/"])
def test_what_the_client_would_send_as_a_password_is_masked_whole(url: str) -> None:
    """urllib3's own parse of the redacted URL finds the user and ``***``: no part of the password is left."""
    from urllib3.util import parse_url

    user = parse_url(url).auth.split(":", 1)[0]
    assert parse_url(tracking.redact(url)).auth == f"{user}:***"
    assert parse_url(tracking.mask_userinfo(url)).auth == "***"


def test_mask_userinfo_masks_a_token_with_an_at_in_it() -> None:
    assert tracking.mask_userinfo("http://TOK@EN@host/x") == "http://***@host/x"
    assert tracking.has_credentials("s3://AKIA:secret@pw@bucket/runs")


@pytest.mark.parametrize(("text", "shown"), AT_IN_SECRETS)
def test_the_callbacks_own_copy_masks_as_the_tracking_one_does(text: str, shown: str) -> None:
    """callbacks/ is copied alone into other projects, so notice polling keeps its own copy of the pattern: one
    redaction still, the same text masked the same way wherever it is printed."""
    from callbacks.utils.notices import without_credentials

    assert without_credentials(text) == tracking.mask_userinfo(text)
