"""A further rank's reason to stop, left for global rank 0, which prints the run's one line.

Global rank 0 alone says why a run stopped. A further rank whose streamed data became unreadable stops the run in
order (exit 75 to be relaunched; 0 in a rank Lightning's launcher started) and leaves; rank 0, waiting for it in a
collective, sees only a lost peer, and its line ("a peer process was lost") did not say that the bucket was gone.
The stopping rank leaves its line in the job's rendezvous store (Lightning's launcher, torchrun and SLURM jobs all
serve one at ``MASTER_ADDR:MASTER_PORT``) before it exits; rank 0, on a lost peer, prints that line instead.
A store that cannot be reached leaves the lost-peer line as it was: never a failure of its own. torchrun's store
outlives the workers it restarts: each restart's lines have keys of their own (``TORCHELASTIC_RESTART_COUNT``).
"""

from __future__ import annotations

import logging
import os
import time

from callbacks.utils.watchdog import rendezvous_store

log = logging.getLogger(__name__)

KEY_PREFIX = "atscale/stop-line/"


def _key(rank: int) -> str:
    return f"{KEY_PREFIX}{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"


def leave(line: str, rank: int, code: int = 75, timeout_s: float = 2.0) -> bool:
    """Leave ``line`` and the exit code it stops with under this rank's key for global rank 0; whether it was
    stored (damaged data stops with 65 on whichever rank meets it first: rank 0 must not requeue it as 75)."""
    store = rendezvous_store(timeout_s, quiet=True)
    if store is None:
        return False
    try:
        store.set(_key(rank), f"{code} {line}")
        return True
    except Exception as err:  # the store's host is gone: rank 0 prints its lost-peer line, as before
        log.debug("The stop line could not be left in the rendezvous store: %s", err)
        return False


def left_by_peers(world_size: int, wait_s: float = 1.0, timeout_s: float = 2.0) -> tuple[int, str] | None:
    """The exit code and line a further rank left before it went (the lowest rank's), waiting up to ``wait_s``.

    The wait covers a peer still on its way out when its collective partner saw it gone; a peer that died (a
    lost node) leaves nothing, and the wait is what that lost-peer line costs.
    """
    store = rendezvous_store(timeout_s, quiet=True)
    if store is None:
        return None
    keys = [_key(rank) for rank in range(1, world_size)]
    deadline = time.monotonic() + wait_s
    try:
        while True:
            for key in keys:
                if store.check([key]):
                    code, line = store.get(key).decode().split(" ", 1)
                    return int(code), line
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
    except Exception as err:  # the store stopped answering: no line to add
        log.debug("The rendezvous store could not be read for a stop line: %s", err)
        return None
