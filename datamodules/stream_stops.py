"""How streamed data stops a run: one line, said once, and an exit code that tells a scheduler whether to requeue.

- :class:`StreamUnavailable` (exit 75, ``EX_TEMPFAIL``): the store could not be read for ``read_timeout_s``; the
  relaunch resumes from the newest checkpoint, as after a spot interruption.
- :class:`datamodules.verified_chunks.DataDamaged` (65) and :class:`~datamodules.verified_chunks.CacheUnwritable`
  (74): a relaunch meets the same fault, so no requeue.
- :class:`datamodules.verified_chunks.UnsafeData` and a refused resume on other data (2): bad input.

:class:`StreamStopped` carries the code and the line out of the training loop (a ``SystemExit``: Lightning lets
it through); global rank 0 prints the line, a further rank leaves it for rank 0 (``recipes/run/stop_line.py``).

Copy with it (paths under ``datamodules/``): ``verified_chunks.py``, ``urls.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from .urls import redact
from .verified_chunks import StreamFault, UnsafeData

__all__ = ["UNAVAILABLE_EXIT_CODE", "StopOnFault", "StreamStopped", "StreamUnavailable", "stop"]

#: The exit code of a run whose data cannot be read: the relaunch resumes it (EX_TEMPFAIL, as a spot interruption).
UNAVAILABLE_EXIT_CODE = 75


class StreamUnavailable(StreamFault):
    """The streamed data could not be read for ``read_timeout_s``; the message is the run's one line."""

    exit_code = UNAVAILABLE_EXIT_CODE


class StreamStopped(SystemExit):
    """The run's stop on streamed data: its exit code (75: the relaunch resumes; 65 damaged, 74 the cache, 2 a
    refused digest: no requeue) and the line that says why (printed by global rank 0; a further rank's is left for
    rank 0 by the CLI: recipes/run/stop_line.py)."""

    def __init__(self, line: str, code: int = UNAVAILABLE_EXIT_CODE) -> None:
        super().__init__(code)
        self.line = line


def stop(err: StreamFault | UnsafeData | str, loud: bool, code: int | None = None) -> StreamStopped:
    """The stop for ``err`` (its last ``atscale:`` line, as a loader worker's re-raise wraps it), said if ``loud``."""
    text = str(err).strip()
    line = text.splitlines()[-1] if text else "atscale: the streamed data is gone"
    line = redact(line[line.find("atscale:"):] if "atscale:" in line else line)
    if loud:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    return StreamStopped(line, code if code is not None else getattr(err, "exit_code", 2))


def _reason(err: BaseException) -> str:
    """A store's error in a few words: an S3 error's code and message, else the exception's type and first line."""
    details = (getattr(err, "response", None) or {}).get("Error") or {}
    if details.get("Code"):
        return redact(f"{details['Code']}: {details.get('Message') or 'no message'}")
    text = redact(" ".join(str(err).split()))[:200]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


class StopOnFault(Iterator):
    """An iterator that turns a :class:`StreamFault` (or :class:`UnsafeData`) into its one line and exit code."""

    def __init__(self, inner: Iterator, loud: bool) -> None:
        self.inner = inner
        self.loud = loud

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.inner)
        except (StreamFault, UnsafeData) as err:  # raised here, or re-raised from a loader worker
            raise stop(err, self.loud) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
