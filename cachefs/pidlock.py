"""An exclusive lock on a file that also records the holder's pid, so a refusal can name it.

The lock is an flock(2): the kernel releases it when its holder exits, however it exits (a
SIGKILL included), so a stale lock file never blocks the next start; only its pid text stays.
"""

from __future__ import annotations

import fcntl
import os
from typing import IO

#: The lock a worker holds in its state directory while it runs (mounted or starting).
WORKER_LOCK_NAME = "worker.lock"


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


def is_locked(path: str) -> bool:
    """Whether some process holds the lock on ``path`` now. Read from /proc/locks, without
    trying the lock: a check that took it, even for an instant, could make a worker starting
    at that moment refuse to start."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return False
    # /proc/locks names a file as "MAJOR:MINOR:INODE", the device numbers in hex.
    file_id = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    with open("/proc/locks") as locks:
        for line in locks:
            fields = line.split()
            if "FLOCK" in fields and file_id in fields:
                return True
    return False
