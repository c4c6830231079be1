"""A secret in a data URL is never printed: ``recipes.prepare --output`` and ``recipes.fit --data.url``, run as a user
runs them, refuse a bad URL in one redacted ``error:`` line with exit 2 before any connection (issue 59, item 6).

Before: ``prepare --output s3://KEY:SECRET@bkt/d`` ended in a 70-line botocore traceback quoting the secret (exit 1),
``fit --data.url`` with it in 78 lines, ``ftp://user:pw@host`` in a traceback too. No network: each URL is refused
before a store is asked, and the one store call made (no credentials) fails in botocore before any connection.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, FAST, cli_env, run_fit, run_module, runs_of

#: An AWS-style secret key: holds a ``/`` and a ``+``, as real ones do.
SLASHED = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYzz9Q"
#: Every secret put in a URL here; none may be shown, whole or in part.
SECRETS = ("SECRETXYZ", "SIGSECRET", "wJalrXUtnFEMI", "K7MDENG", "bPxRfiCYzz9Q")

#: (URL, how the line shows it, what the line says is wrong).
BAD_URLS = [
    pytest.param("s3://AKIAKEY:SECRETXYZ@bkt/d", "s3://***@bkt/d", "credentials in a data URL", id="s3-credentials"),
    pytest.param(f"s3://AKIAKEY:{SLASHED}@bkt/d", "s3://***@bkt/d", "credentials in a data URL", id="slashed-secret"),
    pytest.param("ftp://user:SECRETXYZ@host/x", "ftp://***@host/x", "ftp:// is not a store", id="ftp"),
    pytest.param("s3://bkt/d?X-Amz-Signature=SIGSECRET", "s3://bkt/d?X-Amz-Signature=***",
                 "a dataset URL names a folder", id="presigned"),
]


def assert_one_redacted_line(result: subprocess.CompletedProcess, *expected: str) -> str:
    """Exit 2, exactly one ``error:`` line holding each of ``expected``, no traceback, no secret anywhere; the
    line."""
    shown = result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, shown[-3000:]
    assert len(errors) == 1, shown[-3000:]
    assert all(part in errors[0] for part in expected), errors[0]
    assert "Traceback" not in shown, shown[-3000:]
    assert [secret for secret in SECRETS if secret in shown] == [], shown[-3000:]
    return errors[0]


def no_store_env(workdir: Path) -> dict[str, str]:
    """The CLI's environment with no AWS settings at all: no credentials, no metadata service, no config files."""
    env = {key: value for key, value in cli_env(workdir).items() if not key.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=str(workdir / "no-aws-config"),
               AWS_SHARED_CREDENTIALS_FILE=str(workdir / "no-aws-credentials"), AWS_DEFAULT_REGION="us-east-1",
               AWS_ENDPOINT_URL="http://127.0.0.1:9")  # never reached: signing fails first
    return env


@pytest.mark.parametrize(("url", "shown", "problem"), BAD_URLS)
def test_prepare_refuses_a_bad_output_url_in_one_redacted_line(tmp_path: Path, url: str, shown: str,
                                                               problem: str) -> None:
    result = run_module("recipes.prepare", "digits", "--output", url, "--staging", str(tmp_path / "staging"),
                        cwd=tmp_path, env=no_store_env(tmp_path), timeout=120)
    line = assert_one_redacted_line(result, problem)
    assert line.startswith(f"error: --output {shown}: "), line
    assert not (tmp_path / "staging").exists()  # refused before any work


def test_prepare_quoting_the_url_in_a_parse_error_shows_no_secret(tmp_path: Path) -> None:
    result = run_module("recipes.prepare", "digits", f"s3://AKIAKEY:{SLASHED}@bkt/d", "--output", "data/x",
                        cwd=tmp_path, env=no_store_env(tmp_path), timeout=120)
    assert assert_one_redacted_line(result) == "error: unrecognized arguments: s3://***@bkt/d"


def test_prepare_a_store_refusal_from_botocore_is_one_line(tmp_path: Path) -> None:
    """A valid URL and no credentials: botocore's own error (not an OSError) was an 85-line traceback."""
    result = run_module("recipes.prepare", "digits", "--output", "s3://atscale-test-bucket/d", "--max_items", "40",
                        "--staging", str(tmp_path / "staging"), cwd=tmp_path, env=no_store_env(tmp_path),
                        timeout=120)
    assert assert_one_redacted_line(result) == ("error: --output s3://atscale-test-bucket/d: NoCredentialsError: "
                                                    "Unable to locate credentials")


def test_prepare_an_unexpected_failure_prints_its_traceback_redacted(tmp_path: Path) -> None:
    """The last resort: a failure no step turned into one line still shows the traceback, its URLs redacted."""
    program = ("import runpy, sys\n"
               "import recipes.run.common as common\n"
               "def run_main(body):\n"
               f"    raise RuntimeError('cannot open s3://AKIAKEY:{SLASHED}@bkt/d?X-Amz-Signature=SIGSECRET')\n"
               "common.run_main = run_main\n"
               "sys.argv = ['prepare', 'digits', '--output', 'data/x']\n"
               "runpy.run_module('recipes.prepare', run_name='__main__', alter_sys=True)\n")
    result = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=no_store_env(tmp_path),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.startswith("Traceback (most recent call last):"), result.stderr[-3000:]
    assert result.stderr.endswith("RuntimeError: cannot open s3://***@bkt/d?X-Amz-Signature=***\n")
    assert [secret for secret in SECRETS if secret in result.stdout + result.stderr] == []


@pytest.mark.parametrize(("url", "shown", "problem"), [BAD_URLS[0], BAD_URLS[2]])
def test_fit_refuses_a_bad_data_url_in_one_redacted_line(tmp_path: Path, url: str, shown: str, problem: str) -> None:
    result = run_fit(tmp_path, "--config", str(CONFIGS / "digits-stream.yaml"), *FAST, "--data.url", url,
                     env=no_store_env(tmp_path), timeout=300)
    assert_one_redacted_line(result, f"(url='{shown}'): {problem}")
    assert runs_of(tmp_path, "digits-stream") == []  # refused before a run was recorded

