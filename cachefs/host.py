"""What this machine offers a worker: its mounts (``/proc/self/mountinfo``), its memory, and the
size of the filesystems that hold the cache tiers.

Used at startup, before anything is created, so that a tier that can never fit is refused with
one line instead of failing (ENOSPC, or the OOM killer) once it has filled.
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass

from cachefs.errors import ConfigError
from cachefs.units import format_size

log = logging.getLogger(__name__)

MOUNTINFO = "/proc/self/mountinfo"
#: Filesystems whose files live in memory: a RAM tier there also counts against the memory.
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
# A cgroup memory limit this large means "no limit" (cgroup v1 writes the page-rounded maximum).
_NO_LIMIT = 1 << 60
#: The open-file limit a worker raises its own to, as far as the hard limit allows: one
#: descriptor per connection to a peer (the native READ path holds up to 1,024, in the worker
#: and in each serving process) and per peer connected to it, the block files kept open (up to
#: 4,096 in the native table), the store's sockets. Many hosts start processes at a soft limit
#: of 1,024 under a far higher hard one; the children (serving and fetcher processes) inherit it.
OPEN_FILES_WANTED = 1 << 16
#: Below this many the worker warns: a node with a few hundred peers could run out.
OPEN_FILES_LOW = 4096


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo (see proc(5))."""

    mount_id: int
    device: str  # "major:minor"; for FUSE the minor is the connection's number
    path: str  # the mountpoint, with mountinfo's octal escapes decoded
    fstype: str  # e.g. "fuse.cachefs", "tmpfs", "ext4"
    root: str = "/"  # the directory of the filesystem mounted here: "/imagenet" for a bind
    options: tuple[str, ...] = ()  # this mount's own options, e.g. ("ro", "nosuid", "nodev")
    source: str = ""  # the field after the type: a FUSE mount's fsname, "tmpfs", "/dev/sda1"

    @property
    def is_fuse(self) -> bool:
        return self.fstype == "fuse" or self.fstype.startswith("fuse.")

    @property
    def fuse_connection(self) -> str:
        """The directory name of this mount's connection under /sys/fs/fuse/connections."""
        return self.device.split(":")[1]


def _unescape(field: str) -> str:
    # The kernel writes space, tab, newline and backslash in paths as \040, \011, \012, \134.
    if "\\" not in field:
        return field
    raw = field.encode("utf-8", "surrogateescape")
    out, i = bytearray(), 0
    while i < len(raw):
        if raw[i] == 0x5C and raw[i + 1 : i + 4].isdigit():
            out.append(int(raw[i + 1 : i + 4], 8))
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return out.decode("utf-8", "surrogateescape")


def mounts(mountinfo: str = MOUNTINFO) -> list[MountEntry]:
    """Every mount of this process's mount namespace, oldest first (a later mount on the same
    path hides the earlier ones)."""
    entries = []
    with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            before, _, after = line.partition(" - ")
            fields, tail = before.split(), after.split()
            if len(fields) < 5 or not tail:
                continue
            entries.append(
                MountEntry(
                    int(fields[0]),
                    fields[2],
                    _unescape(fields[4]),
                    tail[0],
                    root=_unescape(fields[3]),
                    options=tuple(fields[5].split(",")) if len(fields) > 5 else (),
                    source=_unescape(tail[1]) if len(tail) > 1 else "",
                )
            )
    return entries


def mounts_at(path: str) -> list[MountEntry]:
    """The mounts on ``path`` (already resolved), oldest first: the last one is visible."""
    return [entry for entry in mounts() if entry.path == path]


def resolve_without_entering(path: str) -> str:
    """``path`` made absolute with its parent's symlinks resolved, without a stat of ``path``
    itself: on a FUSE mount whose server is stopped, that stat would never return."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    return os.path.join(os.path.realpath(parent), name) if name else path


# How many symlinks resolve_mountpoint follows, as the kernel's own limit (SYMLOOP_MAX).
_MAX_SYMLINKS = 40


def resolve_mountpoint(path: str) -> str:
    """``path`` with every symlink resolved, its own too, the way the kernel lists a mount made
    through it, without entering a mount on ``path`` (see :func:`resolve_without_entering`).

    A path listed in mountinfo is a mount point and is returned as it is. Any other path is
    not a mount point, so an lstat() of it never reaches a FUSE server: a symlink is followed
    (readlink), and its target looked up in mountinfo again."""
    path = resolve_without_entering(path)
    for _ in range(_MAX_SYMLINKS):
        if mounts_at(path):
            return path
        try:
            if not os.path.islink(path):
                return path
            target = os.readlink(path)
        except OSError:  # gone meanwhile: what it names is as good as anything
            return path
        path = resolve_without_entering(os.path.join(os.path.dirname(path), target))
    raise ConfigError(f"{path}: more than {_MAX_SYMLINKS} symlinks to follow")


def _existing_ancestor(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def filesystem_type(path: str) -> str:
    """The type of the filesystem that holds ``path`` (or would, once created)."""
    target = os.path.realpath(_existing_ancestor(path))
    best, fstype = -1, "?"
    for entry in mounts():
        inside = target == entry.path or target.startswith(entry.path.rstrip("/") + "/")
        if inside and len(entry.path) >= best:  # the longest (and then the newest) wins
            best, fstype = len(entry.path), entry.fstype
    return fstype


def raise_open_file_limit(wanted: int = OPEN_FILES_WANTED) -> int:
    """Raise this process's soft limit on open files to ``wanted``, or to its hard limit where
    that is lower (never lower it), and warn when what it gets is below OPEN_FILES_LOW.
    Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
        else:
            log.info("open-file limit raised from %d to %d", soft, target)
            soft = target
    if soft != resource.RLIM_INFINITY and soft < OPEN_FILES_LOW:
        log.warning(
            "the open-file limit is %d: peer connections and open block files "
            "share it, and a node with many peers may run out; raise the hard limit "
            "(`ulimit -Hn`, systemd's LimitNOFILE=) to at least %d",
            soft,
            OPEN_FILES_LOW,
        )
    return int(soft)


def memory_limit() -> int:
    """The memory this process may use: the machine's, or less under a cgroup limit."""
    limit = _NO_LIMIT
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                limit = int(line.split()[1]) * 1024
                break
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < _NO_LIMIT:
            limit = min(limit, int(text))
    return limit


@dataclass(frozen=True)
class TierRequest:
    """A tier the worker is asked to create: its option (for messages), directory and size."""

    option: str  # "--ram", "--ssd"
    path: str
    capacity: int
    in_memory: bool  # the RAM tier: on tmpfs it also needs the machine's memory


def check_tier_sizes(tiers: list[TierRequest]) -> None:
    """Refuse a tier larger than the filesystem that holds it, or (a RAM tier on tmpfs) than
    this machine's memory: it could never be filled, and filling it would end in ENOSPC or in
    the OOM killer. Call before creating anything."""
    for tier in tiers:
        stats = os.statvfs(_existing_ancestor(tier.path))
        size = stats.f_blocks * stats.f_frsize
        limits = [(size, f"the filesystem of {tier.path} holds {format_size(size)}")]
        if tier.in_memory and filesystem_type(tier.path) in MEMORY_FILESYSTEMS:
            memory = memory_limit()
            limits.append((memory, f"this machine has {format_size(memory)} of memory"))
        for limit, why in limits:
            if tier.capacity > limit:
                raise ConfigError(
                    f"{tier.option} {format_size(tier.capacity)} cannot fit: {why}; "
                    f"give {tier.option} at most that"
                )


def warn_if_short(tier: TierRequest, held: int) -> None:
    """Warn (only) when a tier is larger than the room free on its filesystem now plus the
    ``held`` bytes it already holds there: other files may leave that room, and until they do
    the blocks that do not fit are read through, not cached."""
    stats = os.statvfs(tier.path)
    room = stats.f_bavail * stats.f_frsize + held
    if tier.capacity > room:
        log.warning(
            "%s %s is more than the %s its filesystem has room for now (%s): blocks that do "
            "not fit are read through, not cached",
            tier.option,
            format_size(tier.capacity),
            format_size(room),
            tier.path,
        )
