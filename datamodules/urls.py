"""Secrets in data URLs: masked in every text that is shown, refused in the URL a dataset is read from or written to.

- :func:`redact`: ``text`` with the userinfo of every URL in it (``s3://KEY:SECRET@bucket`` ->
  ``s3://***@bucket``) and the secret query parameters of presigned URLs (:data:`SECRET_QUERY_KEYS`:
  ``X-Amz-Signature=***``) masked. For any text that is printed: an error line, a traceback (:func:`excepthook`).
- :func:`check_data_url`: the dataset location a run or ``recipes.prepare`` is given, checked before any library
  sees it: a folder, ``file://``, ``s3://`` or ``gs://`` (:data:`DATA_SCHEMES`), with a bucket, no credentials and
  no query string. Anything else is a ``ValueError`` of one line that names the URL, redacted.

Why refuse credentials rather than mask them: a run records its data URL (the MLflow dataset input and params,
``config.yaml``, ``manifest.json``) and the libraries under it print it in their own errors, not always as a URL:
botocore quotes ``s3://KEY:SECRET@bucket/d`` as the bucket name ``"KEY:SECRET@bucket"``, which no redaction can
recognize. The stores take their credentials from the environment instead (``AWS_ACCESS_KEY_ID`` and
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``; ``GOOGLE_APPLICATION_CREDENTIALS``), where nothing records them.

Standard library only: :mod:`datamodules.streaming` and the tools (``recipes.prepare``, the CLI) share it.

Copy with it: nothing.
"""

from __future__ import annotations

import re
import sys
import traceback
from types import TracebackType

__all__ = ["DATA_SCHEMES", "SECRET_QUERY_KEYS", "check_data_url", "excepthook", "redact"]

#: Where a dataset can live, besides a local folder: the schemes that both fsspec (``atscale.json``, each split's
#: ``index.json``, ``recipes.prepare``'s upload) and litdata 0.2.76's ``StreamingDataset`` (the chunks) open, with
#: where each takes its credentials from.
DATA_SCHEMES = {
    "file": "",  # this machine's files: read as the folder the URL names
    "s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS",
}

#: Schemes that are refused, with why. litdata 0.2.76 streams Azure only from ``azure://`` URLs, which fsspec does
#: not open, and reads ``az://`` as a local folder; it knows no ``s3a://`` or ``gcs://`` either.
_REFUSED = {
    "s3a": "write s3:// (litdata streams no s3a:// URL)",
    "gcs": "write gs:// (litdata streams no gcs:// URL)",
    **{scheme: "litdata 0.2.76 streams Azure only from azure:// URLs, which fsspec does not open; copy the dataset "
               "to an s3:// or gs:// bucket or a folder" for scheme in ("az", "abfs", "abfss", "azure", "adl")},
    **{scheme: "a web URL is not a folder a dataset can be listed and streamed from (a presigned URL names one "
               "file); give the bucket's URL (s3://bucket/path) and the credentials in the environment"
       for scheme in ("http", "https")},
}

#: Query parameters whose value is a secret (matched without regard to case): the signatures and credentials of
#: presigned URLs (AWS SigV4 and SigV2, Google Cloud Storage V4 and V2, an Azure SAS's ``sig``) and the usual
#: names of tokens and keys. Their values are masked; the other parameters (``X-Amz-Expires``, ``se``) are kept.
SECRET_QUERY_KEYS = (
    "X-Amz-Signature", "X-Amz-Credential", "X-Amz-Security-Token", "Signature", "AWSAccessKeyId",
    "X-Goog-Signature", "X-Goog-Credential", "GoogleAccessId", "sig",
    "token", "access_token", "refresh_token", "id_token", "api_key", "apikey", "key", "password", "secret",
    "client_secret",
)

_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]*"
#: A URL's scheme and userinfo. First the userinfo as a parser reads it: the authority ends at the first ``/``, ``?``
#: or ``#`` (or a space) and the userinfo is all of it before its LAST ``@``, as urllib3 and ``urllib.parse`` split
#: it (a password holding an ``@`` is masked whole). Else, when the authority holds a ``:`` and an ``@`` follows
#: before the next space, everything up to that ``@``: a password may hold ``/`` (AWS secret keys do), and then
#: no parser tells it from a port and a path. The second rule may mask a port and a path too; masking too much is
#: the safe mistake.
_USERINFO = re.compile(rf"(?P<scheme>{_SCHEME}://)(?:[^\s/?#]*@|[^\s/?#@:]*:\S*@)")
#: A secret parameter's value ends where the query does (``&``, ``#``, a space, a quote) or before the punctuation
#: that ends a sentence there (``...&sig=ab12: refused``), so that redacting a line twice changes nothing.
_QUERY_SECRET = re.compile(r"(?P<key>[?&;](?:" + "|".join(map(re.escape, SECRET_QUERY_KEYS)) + r")=)"
                           r"[^&#\s\"'<>]*?(?=[:;,.)\]]*(?:[&#\s\"'<>]|$))", re.IGNORECASE)
#: ``scheme://`` at the start of a location; ``scheme:`` alone (``s3:/bucket``: a ``/`` short).
_URL_START = re.compile(rf"^(?P<scheme>{_SCHEME})://")
_SCHEME_ONLY = re.compile(rf"^(?P<scheme>{_SCHEME}):(?!//)")


def redact(text: str) -> str:
    """``text`` with every URL's userinfo and every secret query parameter's value replaced by ``***``.

    ``s3://KEY:SECRET@bucket/d`` -> ``s3://***@bucket/d`` (a lone ``https://TOKEN@host`` too: a name alone may
    be a token); ``https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F...&X-Amz-Signature=ab12`` ->
    ``...?X-Amz-Credential=***&X-Amz-Signature=***`` (:data:`SECRET_QUERY_KEYS`). Text with no URL comes back as
    it is; ``redact(redact(text)) == redact(text)``.
    """
    return _QUERY_SECRET.sub(r"\g<key>***", _USERINFO.sub(r"\g<scheme>***@", text))


def _known_scheme(scheme: str) -> bool:
    return scheme.lower() in DATA_SCHEMES or scheme.lower() in _REFUSED


def check_data_url(url: str, label: str = "{url}") -> str:
    """``url`` if a dataset can be read from (and written to) it; else ``ValueError`` of one line, the URL redacted.

    Accepted: a local folder (relative or absolute), ``file:///abs/path`` (returned as ``/abs/path``: litdata would
    read ``file:`` as part of a relative folder's name), ``s3://bucket[/path]`` and ``gs://bucket[/path]``
    (:data:`DATA_SCHEMES`). Refused, before any connection: another scheme (``ftp://``; ``az://``, which litdata
    0.2.76 cannot stream; ``https://``), a URL with no bucket, a bucket name with a ``:`` (an endpoint belongs in
    ``AWS_ENDPOINT_URL``), credentials in the URL (they would be recorded with the run: see the module's
    docstring), a query string or fragment (a presigned URL's signature; a dataset URL names a folder), an empty
    location, and a known scheme missing its ``//`` (``s3:/bucket``, which fsspec would take for a local folder).

    Args:
        url: the dataset's location, as given.
        label: how the message names it, ``{url}`` standing for the redacted URL: ``"--output {url}"``,
            ``"StreamingImageDataModule(url={url!r})"``.

    Returns:
        ``url`` (its scheme in lower case: litdata knows ``s3://``, not ``S3://``), or the path a ``file://`` URL
        names.

    Raises:
        ValueError: ``"<label>: <what is wrong and what to do>"``, e.g. ``--output s3://***@bkt/d: credentials in
            a data URL would be recorded with the run ...``.
    """
    def refuse(problem: str) -> ValueError:
        return ValueError(f"{label.format(url=redact(url) or repr(url))}: {problem}")

    if not url.strip():
        raise refuse("no dataset location given (a folder, or an s3:// or gs:// URL)")
    start = _URL_START.match(url)
    if start is None:
        if "://" in url or "::" in url:
            raise refuse("not a URL this project reads (scheme://bucket/path; no chained fsspec URLs)")
        only = _SCHEME_ONLY.match(url)
        if only is not None and len(only["scheme"]) > 1 and _known_scheme(only["scheme"]):
            raise refuse(f"not a URL (write {only['scheme']}://bucket/path) nor a folder")
        return url  # a local folder
    scheme = start["scheme"].lower()
    if scheme not in DATA_SCHEMES:
        why = _REFUSED.get(scheme, "give a folder, or an s3:// or gs:// URL")
        raise refuse(f"{scheme}:// is not a store a dataset can be read from; {why}")
    rest = url[start.end():]
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in authority or (":" in authority and "@" in rest):
        if scheme == "file":
            raise refuse("a file:// URL takes no credentials")
        raise refuse("credentials in a data URL would be recorded with the run (its MLflow params, config.yaml, "
                     f"manifest.json) and printed; give them in the environment instead ({DATA_SCHEMES[scheme]})")
    if "?" in rest or "#" in rest:
        raise refuse("a dataset URL names a folder and takes no query string or fragment (a presigned URL's "
                     "signature would be recorded with the run); give the folder's URL, the credentials in the "
                     "environment")
    if scheme == "file":
        if authority not in ("", "localhost"):
            raise refuse(f"a file:// URL names this machine's files, not host {authority!r}")
        return rest[len(authority):] or "/"
    if not authority:
        raise refuse(f"names no bucket ({scheme}://bucket/path)")
    if ":" in authority:
        raise refuse(f"a bucket name holds no ':' ({authority!r}); a store's endpoint is set in the environment "
                     "(AWS_ENDPOINT_URL for an S3-compatible store), not in the URL")
    return f"{scheme}://{rest}"


def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    """A ``sys.excepthook`` that prints the traceback as the interpreter does, passed through :func:`redact`.

    The last resort of an entry point (``sys.excepthook = excepthook`` in its ``__main__`` block): a failure
    nothing turned into one line still shows no URL's secret. Text a library wrote without the URL's scheme
    (botocore's bucket name) is beyond it: :func:`check_data_url` keeps such URLs out of the libraries.
    """
    sys.stderr.write(redact("".join(traceback.format_exception(kind, value, tb))))
    sys.stderr.flush()
