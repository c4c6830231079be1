"""A failure read for what it means to a person: a parse error cut to one line, a full disk, a lost peer rank, an
optimizer's refusal of a value brought forward to the module's construction.

The run flow (:mod:`recipes.run.cli`) and the tools (:func:`recipes.run.common.run_main`) turn each into one line
and an exit code instead of a traceback.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Callable
from typing import Any

#: Errors of the machine rather than of the input: reported in one line, exit code 1.
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}


def parse_error_message(message: str) -> str:
    """jsonargparse's error cut to one line: the key, what it expects, the value given.

    jsonargparse nests every Union alternative it tried (``LightningModule | None`` and so on) into a
    dozen lines; a person needs the key and the bad value.
    """
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    keys = re.findall(r'Parser key "([^"]+)"', message)
    nested = re.findall(r"NestedArg\(key='([^']+)', val='([^']*)'\)", message)
    given = re.findall(r"Given value: (.*)", message)
    expected = [e for e in re.findall(r"Expected a <class '([\w.]+)'>", message) if e != "NoneType"]
    problem = re.findall(r"Problem with given class_path '[^']+':\s*(?!Parser key)(.+)", message)
    if not keys and message.startswith("Does not validate against any of the Union subtypes"):
        # a class's own error while jsonargparse instantiated it (say ImageClassifier's bad cost matrix)
        errors = [e for e in re.findall(r"^\s*- (.+)$", message, re.MULTILINE) if "NoneType" not in e]
        return errors[0] if errors else " ".join(lines[:2])
    if keys and nested:
        key, value = f"{keys[0]}.init_args.{nested[-1][0]}", nested[-1][1]
    elif keys and given:
        key, value = keys[0], given[-1]
    else:
        return " ".join(lines[:2]) if lines else message
    if expected:
        return f"{key}: expected {expected[0].rsplit('.', 1)[-1]}, got {value!r}"
    if problem:
        return f"{key}: {problem[-1]}"
    return f"{key}: invalid value {value!r}"


def disk_error(err: BaseException) -> OSError | None:
    """The full-disk (or read-only, I/O) error behind ``err``, following its causes, if that is what it is."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _DISK_ERRNOS:
            return current
        current = current.__cause__ or current.__context__
    return None


#: A collective's transport saying its peer process is gone (gloo over TCP): the message and the peer's address.
_LOST_PEER = re.compile(r"gloo/transport/tcp/\S+\] (?:Read error )?(?:\[(?P<addr1>[^\]]+)\]:(?P<port1>\d+): )?"
                        r"(?P<what>Connection (?:reset|closed) by peer)(?: \[(?P<addr2>[^\]]+)\]:(?P<port2>\d+))?")


def lost_peer(err: BaseException) -> str | None:
    """What a failure says about a lost peer rank ("Connection reset by peer at host:port"), following its causes.

    A peer that died (its node lost, its process killed) fails the others' next collective. That is a stop, not
    a bug: under ``torchrun --nnodes MIN:MAX`` the survivors restart on the nodes left and resume from the newest
    checkpoint, so the failure is one line, not a traceback of the collective.
    """
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        match = _LOST_PEER.search(str(current)) if isinstance(current, RuntimeError) else None
        if match:
            addr, port = match["addr1"] or match["addr2"], match["port1"] or match["port2"]
            return f"{match['what']} at {addr}:{port}" if addr else match["what"]
        current = current.__cause__ or current.__context__
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
