"""datamodules/urls.py: what :func:`redact` masks, exactly, and the one line :func:`check_data_url` refuses with."""

from __future__ import annotations

import pytest

from datamodules.urls import check_data_url, excepthook, redact
from recipes import prepare

#: An AWS-style secret key: holds a ``/`` and a ``+``, as real ones do.
SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYzz9Q"
#: Every secret the tests put in a URL; none may be shown.
SECRETS = ("SECRETXYZ", "SIGSECRET", "wJalrXUtnFEMI", "K7MDENG", "bPxRfiCYzz9Q")


def leaked(text: str) -> list[str]:
    """The secrets (or parts of one) that ``text`` shows."""
    return [secret for secret in SECRETS if secret in text]


@pytest.mark.parametrize(("text", "shown"), [
    ("s3://AKIAKEY:SECRETXYZ@bkt/d", "s3://***@bkt/d"),
    (f"s3://AKIAKEY:{SECRET}@bkt/d", "s3://***@bkt/d"),  # a '/' in the password: no parser finds its end
    ("ftp://user:pw@host/x", "ftp://***@host/x"),
    ("https://TOKEN@host/x", "https://***@host/x"),  # user-only userinfo: a lone name may be a token
    ("http://me@corp.com:p@ss@host:8/x", "http://***@host:8/x"),  # the last '@' of the authority ends it
    ("two s3://a:1@x/p and gs://b:2@y", "two s3://***@x/p and gs://***@y"),
    ("https://v:w@k?y=a@b", "https://***@k?y=a@b"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA%2F20240101%2Fus-east-1"
     "&X-Amz-Expires=60&X-Amz-Security-Token=IQo&X-Amz-Signature=9f2c",
     "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***&X-Amz-Expires=60"
     "&X-Amz-Security-Token=***&X-Amz-Signature=***"),
    ("https://s.googleapis.com/b/o?x-goog-signature=ab&X-Goog-Credential=sa%40p",
     "https://s.googleapis.com/b/o?x-goog-signature=***&X-Goog-Credential=***"),
    ("https://a.blob.core.windows.net/c/b?sv=2022-11-02&se=2024&sig=Zm9v%3D",
     "https://a.blob.core.windows.net/c/b?sv=2022-11-02&se=2024&sig=***"),
    ("GET https://h/x?Signature=abc%3D&Expires=9: 403 Forbidden",
     "GET https://h/x?Signature=***&Expires=9: 403 Forbidden"),
    ("'https://h/x?token=a.b.c', done.", "'https://h/x?token=***', done."),
    ("https://h/x?monkey=1&keyring=2", "https://h/x?monkey=1&keyring=2"),  # only the named parameters
    ("s3://bkt/d and /data/x", "s3://bkt/d and /data/x"),
    ("", ""),
])
def test_redact_masks_userinfo_and_secret_parameters(text: str, shown: str) -> None:
    assert redact(text) == shown
    assert redact(shown) == shown  # twice is once


@pytest.mark.parametrize(("url", "kept"), [
    ("data/stream/digits", "data/stream/digits"),
    ("/abs/digits", "/abs/digits"),
    ("file:///abs/digits", "/abs/digits"),
    ("file://localhost/abs/digits", "/abs/digits"),
    ("s3://bkt/digits", "s3://bkt/digits"),
    ("s3://bkt", "s3://bkt"),
    ("S3://bkt/d", "s3://bkt/d"),
    ("gs://bkt/a/b/", "gs://bkt/a/b/"),
])
def test_check_data_url_keeps_what_fsspec_and_litdata_both_read(url: str, kept: str) -> None:
    assert check_data_url(url) == kept


CREDENTIALS = ("credentials in a data URL would be recorded with the run (its MLflow params, config.yaml, "
               "manifest.json) and printed; give them in the environment instead (AWS_ACCESS_KEY_ID and "
               "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)")
OTHER_SCHEME = "is not a store a dataset can be read from; give a folder, or an s3:// or gs:// URL"
AZURE = ("az:// is not a store a dataset can be read from; litdata 0.2.76 streams Azure only from azure:// URLs, "
         "which fsspec does not open; copy the dataset to an s3:// or gs:// bucket or a folder")


@pytest.mark.parametrize(("url", "line"), [
    ("s3://AKIAKEY:SECRETXYZ@bkt/d", f"--output s3://***@bkt/d: {CREDENTIALS}"),
    (f"s3://AKIAKEY:{SECRET}@bkt/d", f"--output s3://***@bkt/d: {CREDENTIALS}"),
    ("s3://TOKENONLY@bkt/d", f"--output s3://***@bkt/d: {CREDENTIALS}"),
    ("gs://u:p@bkt/d", "--output gs://***@bkt/d: credentials in a data URL would be recorded with the run (its "
                       "MLflow params, config.yaml, manifest.json) and printed; give them in the environment "
                       "instead (GOOGLE_APPLICATION_CREDENTIALS)"),
    ("file://u:p@localhost/x", "--output file://***@localhost/x: a file:// URL takes no credentials"),
    ("ftp://user:pw@host/x", f"--output ftp://***@host/x: ftp:// {OTHER_SCHEME}"),
    ("hdfs://nn/x", f"--output hdfs://nn/x: hdfs:// {OTHER_SCHEME}"),
    ("az://container/d", f"--output az://container/d: {AZURE}"),
    ("s3a://bkt/d", "--output s3a://bkt/d: s3a:// is not a store a dataset can be read from; write s3:// (litdata "
                    "streams no s3a:// URL)"),
    ("https://h/d?sig=SIGSECRET", "--output https://h/d?sig=***: https:// is not a store a dataset can be read "
                                  "from; a web URL is not a folder a dataset can be listed and streamed from (a "
                                  "presigned URL names one file); give the bucket's URL (s3://bucket/path) and the "
                                  "credentials in the environment"),
    ("s3://bkt/d?X-Amz-Signature=SIGSECRET", "--output s3://bkt/d?X-Amz-Signature=***: a dataset URL names a folder "
                                             "and takes no query string or fragment (a presigned URL's signature "
                                             "would be recorded with the run); give the folder's URL, the "
                                             "credentials in the environment"),
    ("s3://", "--output s3://: names no bucket (s3://bucket/path)"),
    ("gs:///d", "--output gs:///d: names no bucket (gs://bucket/path)"),
    ("s3://localhost:9000/bkt", "--output s3://localhost:9000/bkt: a bucket name holds no ':' ('localhost:9000'); a "
                                "store's endpoint is set in the environment (AWS_ENDPOINT_URL for an S3-compatible "
                                "store), not in the URL"),
    ("file://otherhost/x", "--output file://otherhost/x: a file:// URL names this machine's files, not host "
                           "'otherhost'"),
    ("s3:/bkt/d", "--output s3:/bkt/d: not a URL (write s3://bucket/path) nor a folder"),
    ("simplecache::s3://bkt/d", "--output simplecache::s3://bkt/d: not a URL this project reads "
                                "(scheme://bucket/path; no chained fsspec URLs)"),
    ("", "--output '': no dataset location given (a folder, or an s3:// or gs:// URL)"),
])
def test_check_data_url_refuses_in_one_line_naming_the_redacted_url(url: str, line: str) -> None:
    with pytest.raises(ValueError) as refused:
        check_data_url(url, "--output {url}")
    assert str(refused.value) == line
    assert leaked(line) == [] and "\n" not in line


def test_check_data_url_names_the_url_as_its_label_says() -> None:
    with pytest.raises(ValueError, match=r"^StreamingImageDataModule\(url='s3://\*\*\*@bkt/d'\): credentials "):
        check_data_url("s3://K:SECRETXYZ@bkt/d", "StreamingImageDataModule(url={url!r})")


def test_excepthook_prints_the_traceback_redacted(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        raise RuntimeError(f"cannot open s3://AKIA:{SECRET}@bkt/d (https://h/k?X-Amz-Signature=SIGSECRET)")
    except RuntimeError as err:
        excepthook(type(err), err, err.__traceback__)
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):\n")
    assert err.endswith("RuntimeError: cannot open s3://***@bkt/d (https://h/k?X-Amz-Signature=***)\n")
    assert leaked(err) == []


class NoCredentialsError(Exception):
    """Stands for botocore's: not an OSError, and its traceback would quote the URL."""


class RefusingStore:
    def open(self, path: str, mode: str = "rb") -> None:
        raise NoCredentialsError(f"Unable to locate credentials for s3://AKIA:{SECRET}@bkt/d")


def test_prepare_turns_any_failure_of_the_store_into_one_line(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """botocore raises its own types, not OSError: before, they ended the tool in a traceback."""
    monkeypatch.setattr(prepare, "_destination", lambda url: (RefusingStore(), "bkt/d"))
    monkeypatch.setattr(prepare, "describe", lambda args: ({"source_digest": "0" * 64}, {}))
    assert prepare.main(["digits", "--output", "s3://bkt/d"]) == 2
    out = capsys.readouterr()
    assert out.err == ("error: --output s3://bkt/d: NoCredentialsError: Unable to locate credentials for "
                       "s3://***@bkt/d\n")
    assert out.out == ""


def test_a_tool_parse_error_quoting_a_url_is_redacted(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        prepare.main(["digits", f"s3://AKIA:{SECRET}@bkt/d", "--output", "data/x"])
    assert done.value.code == 2
    assert capsys.readouterr().err == "error: unrecognized arguments: s3://***@bkt/d\n"

