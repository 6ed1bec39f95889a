"""The worker's mountpoint: create it, clear a FUSE mount that nobody serves any more, refuse
one that is served.

A worker killed by SIGKILL (the OOM killer does this) cannot unmount. The kernel aborts its FUSE
connection when the last descriptor of /dev/fuse closes, and from then on every request there
fails with ENOTCONN ("Transport endpoint is not connected"), but the mount stays until someone
unmounts it. The next worker started on that mountpoint clears it and mounts again, without a
manual `fusermount3 -u`; its cache is warm, since the tier files and the index survive a kill.

How a FUSE mount found on the mountpoint is judged (the caller already holds the state
directory's lock, cachefs/pidlock.py, so the worker that last used this state directory is
gone):

- ``statfs()`` is sent to the mount's server. It is never answered from the kernel's caches,
  unlike ``stat()``, whose attributes the kernel keeps for ``--attr-timeout`` (an hour) and may
  still show for a dead mount.
- ENOTCONN or ECONNABORTED: the connection has no server. It is detached (``umount -l``).
- Any other answer, an error included: someone serves it. Refused.
- No answer within :data:`PROBE_TIMEOUT_S`: the connection is open but its server does not read
  it (stopped, or a leftover process holds /dev/fuse). If it is the very mount that the previous
  worker of this state directory recorded (``<state>/mount.json``), that server is dead: the
  connection is aborted through ``/sys/fs/fuse/connections/<N>/abort`` (so readers blocked in it
  get an error instead of waiting forever) and detached. Any other mount is refused.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
from dataclasses import asdict, dataclass

import trio

from cachefs.errors import ConfigError
from cachefs.host import MountEntry, mounts, mounts_at, resolve_mountpoint

log = logging.getLogger(__name__)

#: How long a FUSE mount on the mountpoint has to answer a statfs() before it counts as not
#: answering. A live worker answers in microseconds; this is for a loaded machine.
PROBE_TIMEOUT_S = 10.0
#: Where the worker records its mount, in its state directory (removed at a clean unmount).
MOUNT_RECORD = "mount.json"
FUSE_CONNECTIONS = "/sys/fs/fuse/connections"
_DEAD_ERRNOS = (errno.ENOTCONN, errno.ECONNABORTED)
# Mounts stacked on one path that a start clears at most (each crash without a clean unmount
# may leave one, if someone mounted over them by hand).
_MAX_STACKED = 16
# Unmount commands, tried in order: root's `umount`, then FUSE's own for a user's mount.
_DETACH_COMMANDS = (("umount", "-l"), ("fusermount3", "-uz"), ("fusermount", "-uz"))


@dataclass(frozen=True)
class MountRecord:
    """The mount a worker made, as /proc/self/mountinfo showed it right after mounting."""

    path: str
    mount_id: int
    device: str
    pid: int
    # The mount's fsname (mountinfo's source field), unique to each mount a worker makes
    # (cachefs/fs/fuse_ops.py): the kernel gives a later mount on the same path the same
    # mount id and device again when those are the lowest free, but never this name.
    source: str

    def matches(self, entry: MountEntry) -> bool:
        return (self.path, self.mount_id, self.device, self.source) == (
            entry.path,
            entry.mount_id,
            entry.device,
            entry.source,
        )


def remember_mount(state_dir: str, mount_path: str) -> None:
    """Record the FUSE mount just made on ``mount_path`` (resolved), for the next start."""
    entry = _visible_mount(mount_path)
    if entry is None:
        return
    record = MountRecord(mount_path, entry.mount_id, entry.device, os.getpid(), entry.source)
    path = os.path.join(state_dir, MOUNT_RECORD)
    with open(f"{path}.tmp", "w") as f:
        json.dump(asdict(record), f)
    os.replace(f"{path}.tmp", path)


def forget_mount(state_dir: str) -> None:
    """The mount is gone (a clean unmount): nothing for the next start to clear."""
    try:
        os.unlink(os.path.join(state_dir, MOUNT_RECORD))
    except FileNotFoundError:
        pass


def _recorded_mount(state_dir: str) -> MountRecord | None:
    try:
        with open(os.path.join(state_dir, MOUNT_RECORD)) as f:
            return MountRecord(**json.load(f))
    # None, unreadable, or written before records named the source: nothing is known.
    except (OSError, ValueError, TypeError):
        return None


def _visible_mount(path: str) -> MountEntry | None:
    stacked = mounts_at(path)
    return stacked[-1] if stacked else None


async def prepare_mountpoint(mountpoint: str, state_dir: str) -> str:
    """Make ``mountpoint`` ready to mount on: clear the FUSE mounts nobody serves, refuse one
    that is served or another kind of mount, create the directory, refuse it non-empty.
    Returns the resolved path. Raises ConfigError (one line). Call with the state directory's
    lock held."""
    path = resolve_mountpoint(mountpoint)
    recorded = _recorded_mount(state_dir)
    for _ in range(_MAX_STACKED):
        entry = _visible_mount(path)
        if entry is None:
            break
        if not entry.is_fuse:
            raise ConfigError(
                f"mountpoint {mountpoint} is already a mount point ({entry.fstype}): "
                "choose another --mount"
            )
        state = await _probe(path)
        if state == "served":
            raise ConfigError(
                f"mountpoint {mountpoint} is served by a running FUSE server ({entry.fstype}; "
                "another cachefs worker?): stop it (`cachefs down --state ITS_STATE`) or "
                "choose another --mount"
            )
        if state == "silent" and (recorded is None or not recorded.matches(entry)):
            raise ConfigError(
                f"mountpoint {mountpoint} is a FUSE mount ({entry.fstype}) whose server does "
                f"not answer (stopped?); if nothing serves it any more, clear it with "
                f"`fusermount3 -uz {mountpoint}`"
            )
        await _clear(entry, state, mountpoint, recorded)
    else:
        raise ConfigError(f"mountpoint {mountpoint}: {_MAX_STACKED} stacked mounts, not cleared")
    return await trio.to_thread.run_sync(_make_empty_dir, mountpoint, path, limiter=_limiter())


async def clear_left_mount(state_dir: str) -> str | None:
    """`cachefs down` with no worker running: clear the mount that the last worker of this
    state directory recorded, if it is still there and nobody serves it (the worker was
    killed). Returns its path, or None if there was nothing to clear. Call only while the state
    directory's lock is free (its worker is gone)."""
    recorded = _recorded_mount(state_dir)
    entry = None if recorded is None else _visible_mount(recorded.path)
    if recorded is None or entry is None or not recorded.matches(entry):
        forget_mount(state_dir)  # gone already (unmounted by hand, or a reboot)
        return None
    state = await _probe(recorded.path)
    if state == "served":  # not ours any more, whatever the record says: left alone
        return None
    await _clear(entry, state, recorded.path, recorded, report=False)  # the caller says it
    forget_mount(state_dir)
    return recorded.path


async def _clear(
    entry: MountEntry,
    state: str,
    mountpoint: str,
    recorded: MountRecord | None,
    *,
    report: bool = True,
) -> None:
    """Detach a mount that nobody serves: "dead", or "silent" and recorded by a worker that is
    gone (its connection is then aborted first). ``report``: log what is done."""
    say = log.warning if report else log.debug
    if state == "silent":
        # prepare_mountpoint clears a silent mount only when a worker recorded it.
        assert recorded is not None, f"silent mount at {mountpoint} without a record"
        say(
            "the FUSE connection of %s (left by pid %d) is held open but not served: aborting it",
            mountpoint,
            recorded.pid,
        )
        await trio.to_thread.run_sync(_abort_connection, entry, limiter=_limiter())
    say("clearing the FUSE mount at %s left by a worker that was killed", mountpoint)
    await trio.to_thread.run_sync(_detach, entry, mountpoint, limiter=_limiter())


def _limiter() -> trio.CapacityLimiter:
    return trio.CapacityLimiter(1)  # one blocking call at a time; startup does nothing else


async def _probe(path: str) -> str:
    """The mount's state: "dead" (no server), "served" (it answered) or "silent"."""

    def statfs() -> str:
        try:
            os.statvfs(path)
        except OSError as exc:
            return "dead" if exc.errno in _DEAD_ERRNOS else "served"
        return "served"

    with trio.move_on_after(PROBE_TIMEOUT_S):
        # Abandoned if it never returns: the thread ends when the connection is aborted, or
        # with the process.
        return await trio.to_thread.run_sync(statfs, abandon_on_cancel=True, limiter=_limiter())
    return "silent"


def _abort_connection(entry: MountEntry) -> None:
    abort = os.path.join(FUSE_CONNECTIONS, entry.fuse_connection, "abort")
    if not os.path.exists(abort) and not any(m.fstype == "fusectl" for m in mounts()):
        # The FUSE control filesystem is not mounted (systemd mounts it at boot; containers
        # often do not): mount it to reach the connection.
        subprocess.run(
            ["mount", "-t", "fusectl", "fusectl", FUSE_CONNECTIONS],
            capture_output=True,
            check=False,
        )
    try:
        with open(abort, "w") as f:
            f.write("1")
    except OSError as exc:  # the lazy unmount still detaches it; blocked readers stay blocked
        log.warning("could not abort FUSE connection %s: %s", entry.fuse_connection, exc)


def _detach(entry: MountEntry, mountpoint: str) -> None:
    """Lazily unmount ``entry`` (it disappears from the namespace now; the kernel lets go of it
    once nothing uses it)."""
    failures = []
    for command in _DETACH_COMMANDS:
        try:
            done = subprocess.run(
                [*command, entry.path], capture_output=True, text=True, check=False, timeout=60
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            failures.append(f"{command[0]}: {exc}")
            continue
        if entry not in mounts_at(entry.path):
            return
        # Its stderr may span lines: the error is one line.
        said = " ".join(done.stderr.split())[:300]
        failures.append(f"{command[0]}: {said or f'exit {done.returncode}'}")
    raise ConfigError(
        f"cannot clear the dead FUSE mount at {mountpoint} ({'; '.join(failures)}): "
        f"run `fusermount3 -uz {mountpoint}` as its owner"
    )


def _make_empty_dir(mountpoint: str, path: str) -> str:
    try:
        os.makedirs(path, exist_ok=True)
        if os.listdir(path):
            raise ConfigError(f"mountpoint {mountpoint} is not empty: choose an empty directory")
    except OSError as exc:
        raise ConfigError(f"cannot use mountpoint {mountpoint}: {exc.strerror}") from None
    return path
