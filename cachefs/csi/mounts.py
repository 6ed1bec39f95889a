"""The mount(2) calls of the node plugin: a read-only bind mount and its removal.

Made with the system calls themselves (through libc), not the ``mount`` command: the flags
are exactly those below, and a failure is an errno, not a message to parse. Everything here
blocks; the plugin calls it from gRPC's worker threads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

from cachefs.host import MountEntry, mounts_at

# <sys/mount.h>
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MNT_DETACH = 0x2
UMOUNT_NOFOLLOW = 0x8

#: The options of every published volume, as /proc/self/mountinfo shows them.
READ_ONLY_OPTIONS = ("ro", "nosuid", "nodev")
_READ_ONLY_FLAGS = MS_RDONLY | MS_NOSUID | MS_NODEV
# Mounts stacked on one target path that an unpublish removes at most (one is the norm).
_MAX_STACKED = 16

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p,) * 3 + (ctypes.c_ulong, ctypes.c_void_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


class MountFailed(OSError):
    """A mount(2) or umount2(2) call failed; ``errno`` says why, ``str()`` is one line."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise MountFailed(code, f"{what} failed: {os.strerror(code)}")


def bind_read_only(source: str, target: str) -> None:
    """Bind-mount the directory ``source`` on ``target`` with ``ro,nosuid,nodev``.

    Linux ignores MS_RDONLY (and the others) on the bind itself: the flags take effect with a
    second call that remounts the new bind mount. Should that one fail, the bind is removed
    again, so a failure leaves ``target`` as it was."""
    _check(
        _libc.mount(source.encode(), target.encode(), None, MS_BIND, None),
        f"bind mount of {source} on {target}",
    )
    try:
        _check(
            _libc.mount(None, target.encode(), None, MS_REMOUNT | MS_BIND | _READ_ONLY_FLAGS, None),
            f"read-only remount of {target}",
        )
    except MountFailed:
        unmount(target)
        raise


def unmount(target: str) -> None:
    """Detach the mount on ``target`` (lazily: a reader still holding a file open keeps it
    until it closes it; new lookups no longer see it). A symlink is not followed."""
    _check(_libc.umount2(target.encode(), MNT_DETACH | UMOUNT_NOFOLLOW), f"unmount of {target}")


def visible_mount(path: str) -> MountEntry | None:
    """The mount that is visible on ``path`` (absolute, resolved), None if ``path`` is no mount
    point. Read from /proc/self/mountinfo: never a stat of ``path``, which on a FUSE mount
    whose server is gone fails (ENOTCONN), or never returns on one whose server is stopped."""
    stacked = mounts_at(path)
    return stacked[-1] if stacked else None


def unmount_all(target: str) -> int:
    """Remove every mount stacked on ``target``; the number removed."""
    removed = 0
    while visible_mount(target) is not None:
        if removed == _MAX_STACKED:
            raise MountFailed(errno.EBUSY, f"{target}: {_MAX_STACKED} stacked mounts")
        unmount(target)
        removed += 1
    return removed
