"""A failure read for what it means to a person: a parse error cut to one line, a full disk, a full tracking store, a
lost peer rank, an optimizer's refusal of a value brought forward to the module's construction.

The run flow (:mod:`recipes.run.cli`) and the tools (:func:`recipes.run.common.run_main`) turn each into one line
and an exit code instead of a traceback.
"""

from __future__ import annotations

import errno
import sqlite3
from collections.abc import Callable, Iterator
from typing import Any

#: Errors of the machine rather than of the input: reported in one line, exit code 1.
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}
#: Of those, the ones that say the disk has no room left.
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


def parse_error_message(message: str) -> str:
    """jsonargparse's error cut to one line: the key, what it expects, the value given.

    jsonargparse nests every Union alternative it tried (``LightningModule | None`` and so on) into a
    dozen lines; a person needs the key and the bad value. Read from its words: :mod:`recipes.run.compat`.
    """
    from .compat import jsonargparse_error_line

    return jsonargparse_error_line(message)


def causes(err: BaseException) -> Iterator[BaseException]:
    """``err``, then what it was raised from or during (``__cause__``, else ``__context__``), each once.

    A database driver's error that SQLAlchemy wraps (its ``orig``) counts as a cause too, as MLflow's SQL
    store raises it: ``MlflowException`` <- ``sqlalchemy.exc.OperationalError`` <- ``sqlite3.OperationalError``.
    """
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        orig = getattr(current, "orig", None)
        if isinstance(orig, BaseException) and id(orig) not in seen and orig is not current.__cause__:
            seen.add(id(orig))
            yield orig
        current = current.__cause__ or current.__context__


def disk_error(err: BaseException) -> OSError | None:
    """The full-disk (or read-only, I/O) error behind ``err``, following its causes, if that is what it is."""
    return next((e for e in causes(err) if isinstance(e, OSError) and e.errno in _DISK_ERRNOS), None)


def out_of_space(err: BaseException) -> BaseException | None:
    """The no-room-left error behind ``err``, following its causes: SQLite's ``SQLITE_FULL`` ("database or disk is
    full": an MLflow store's file could not grow) or an ``OSError`` ENOSPC/EDQUOT. Told by type and error code,
    never by the message."""
    for current in causes(err):
        if isinstance(current, sqlite3.OperationalError) and \
                getattr(current, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            return current
        if isinstance(current, OSError) and current.errno in _FULL_ERRNOS:
            return current
    return None


def space_reason(err: BaseException) -> str:
    """What an :func:`out_of_space` error says, without the path or the SQL: "database or disk is full",
    "No space left on device"."""
    if isinstance(err, OSError):
        return err.strerror or errno.errorcode.get(err.errno or 0, "") or str(err)
    return " ".join(str(err).split()) or type(err).__name__


class StoreFull(Exception):
    """A new tracking store that could not be created for lack of space: the machine's fault (exit 1), not the
    input's. Its message is the whole line (the store's URI already redacted)."""

    def __init__(self, store: str, reason: str) -> None:
        super().__init__(f"the tracking store {store} is full ({reason}): it could not be created; free space and "
                         "relaunch the same command")


class MetricsRefused(RuntimeError):
    """The tracking store refused metric points after training had ended (its last writes); its ``__cause__`` is
    the store's error. Raised so that the run ends failed, and resumable, instead of "finished" without them."""


def store_full_message(store: str, reason: str, step: int | None, status_unwritten: bool = False) -> str:
    """The one line for a run that the full tracking store ``store`` stopped at ``step``.

    ``step`` ``None``: stopped before training began. ``status_unwritten``: the store could not take the run's
    end either, so its MLflow run still says RUNNING.
    """
    where = f"training stopped at step {step}" if step is not None else "the run stopped before training"
    status = "; its MLflow run's status could not be written either (it shows RUNNING until the relaunch)" \
        if status_unwritten else ""
    return (f"error: the tracking store {store} is full ({reason}): {where}; free space and relaunch the same "
            f"command to resume (the metric points this launch could not write are logged by the relaunch){status}")


def machine_failure(err: BaseException, store: str | None, step: int | None = None,
                    status_unwritten: bool = False) -> str | None:
    """The one line for a failure of the machine rather than of the run or its input, or ``None``.

    A tracking store ``store`` with no room left (SQLite could not grow its file) names the store and the step
    training stopped at (:func:`store_full_message`); another full, read-only or failing disk (a checkpoint's, an
    artifact's) says what its error says. The caller redacts the line.
    """
    created = next((e for e in causes(err) if isinstance(e, StoreFull)), None)
    if created is not None:
        return f"error: {created}"
    full = out_of_space(err)
    if isinstance(full, sqlite3.Error) and store is not None:
        return store_full_message(store, space_reason(full), step, status_unwritten)
    disk = disk_error(err)
    if disk is not None:
        return (f"error: {disk}. The run stopped; make room and relaunch the same command to resume from the newest "
                "good checkpoint.")
    return None


def lost_peer(err: BaseException) -> str | None:
    """What a failure says about a lost peer rank ("Connection reset by peer at host:port"), following its causes.

    A peer that died (its node lost, its process killed) fails the others' next collective. That is a stop, not
    a bug: under ``torchrun --nnodes MIN:MAX`` the survivors restart on the nodes left and resume from the newest
    checkpoint, so the failure is one line, not a traceback of the collective.

    Told by gloo's words, not by a type: torch raises gloo's lost connection as a plain ``RuntimeError``, and its
    typed errors do not tell a lost peer apart (:func:`recipes.run.compat.gloo_lost_peer` says how each falls short).
    """
    from .compat import gloo_lost_peer

    for current in causes(err):
        found = gloo_lost_peer(current) if isinstance(current, RuntimeError) else None
        if found:
            return found
    return None


def check_optimizer(owner: str, build: Callable[[], Any]) -> None:
    """Build a module's configured optimizer (and scheduler) once and drop it, so that their own checks refuse a
    bad value (``Invalid learning rate: -1.0``) when the module is built, before any run is opened.

    Lightning builds them in ``configure_optimizers``, inside ``trainer.fit``: a bad value there failed a run
    already opened and recorded. Only the optimizer's ``ValueError`` (its check of a value) is a refusal; any
    other failure (an optimizer that wants the parameters on the device the trainer moves them to) is left to
    the real construction.

    Raises:
        ValueError: ``"<owner>'s optimizer: <the optimizer's message>"``.
    """
    try:
        build()
    except ValueError as err:
        raise ValueError(f"{owner}'s optimizer: {err}") from None
    except Exception:  # not a value the optimizer refused: the real construction decides
        pass
