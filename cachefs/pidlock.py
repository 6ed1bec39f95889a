"""An exclusive lock on a file that also records the holder's pid, so a refusal can name it."""

from __future__ import annotations

import fcntl
import os
from typing import IO


class LockHeld(Exception):
    def __init__(self, holder: str):
        super().__init__(f"held by pid {holder}")
        self.holder = holder  # the pid written by the holder, or "?"


def take_pid_lock(path: str) -> IO[str]:
    """Lock ``path`` (created if missing) without waiting and write our pid into it. Keep the
    returned file open for as long as the lock must be held; raises :class:`LockHeld`."""
    lock_file = open(path, "a+")  # noqa: SIM115 - the caller holds it
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.seek(0)
        holder = lock_file.read().strip() or "?"
        lock_file.close()
        raise LockHeld(holder) from None
    lock_file.truncate(0)
    lock_file.write(str(os.getpid()))
    lock_file.flush()
    return lock_file
