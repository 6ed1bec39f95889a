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
        with open(path) as lock_file:
            holder = lock_file.read().strip()
            stat = os.fstat(lock_file.fileno())
    except FileNotFoundError:
        return False
    with open("/proc/locks") as locks:
        return any(names_held_lock(line, stat, holder) for line in locks)


def names_held_lock(line: str, stat: os.stat_result, holder: str) -> bool:
    """Whether a line of /proc/locks is a held flock of the file of ``stat``, whose lock file
    names ``holder`` as its pid.

    A line names the file as "MAJOR:MINOR:INODE" (the device in hex), but its device is the
    filesystem's own, which stat()'s st_dev need not be (a btrfs subvolume, overlayfs). So the
    inode must match and then either the device or the pid: the holder writes its pid into the
    file right after taking the lock."""
    # "1: FLOCK  ADVISORY  WRITE 4242 00:2b:1234 0 EOF"; a waiter's line has "->" after "1:".
    fields = line.split()
    if "->" in fields or "FLOCK" not in fields:
        return False
    at = fields.index("FLOCK")
    try:
        pid, file_id = fields[at + 3], fields[at + 4]
        major, minor, inode = file_id.split(":")
        device = (int(major, 16), int(minor, 16))
        if int(inode) != stat.st_ino:
            return False
    except (IndexError, ValueError):
        return False
    return device == (os.major(stat.st_dev), os.minor(stat.st_dev)) or pid == holder
