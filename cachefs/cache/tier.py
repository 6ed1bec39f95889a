"""One storage tier of the block cache: a directory of block files plus its byte accounting.

Layout of a tier directory::

    <path>/.cachefs-tier-<instance id>        empty file naming the directory's random instance
                                              id (see ``prepare_directory``)
    <path>/tmp/                               blocks being written, renamed into place when whole
    <path>/<d0>/<d1>/<key hex>.<file id hex>  one file per block, mode 0600

``d0``/``d1`` are the first two bytes of the key's *digest* part: the leading bytes of a key are
its source id and shard, identical for many blocks, so fanning out on them would put a whole
dataset into one directory.

The file id (from the index, unique per admission) makes every admission of a block write its
own file, so removing a block deletes exactly the file that was removed from the index — never
the file of a new admission of the same key that raced with the removal. It also means a path is
never reused within a process, which is what lets a tier keep read descriptors of its block
files open (``open_files.py``).

A tier also remembers, for the latest blocks it wrote itself, the state (inode number, ctime)
each block file was in right after it was put in place: the bytes it holds then are the ones
the cache computed the checksums from, so the native READ path may splice them without reading
them first for as long as the file stays in that state (any write moves the ctime; see rule 2
of ``third_party/pyfuse3/cachefs_fast_read.c`` and ``Tier.written_state``). A block another
process wrote (a preload fetcher's reservation) came with that process's checksums, which
nothing here compared with its bytes: its first READ reads and checks it.

Accounting counts what the files take on the filesystem, not their sizes: a file takes whole
allocation units (tmpfs: pages; a disk filesystem: blocks), so a block's *footprint* is its size
rounded up to the unit, and the footprints of a tier's blocks are what ``du`` of the directory
counts for them. On tmpfs that is all ``du`` counts (its directories and the empty marker take
no pages), so ``du`` of a RAM tier never exceeds its capacity. On a disk filesystem each
directory also takes a block (at most 2 + 256 + 65,536 of them, created as blocks arrive); they
are not counted.
"""

from __future__ import annotations

import os
import re
import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cachefs.cache.base import KEY_LEN
from cachefs.cache.open_files import OpenBlockFiles
from cachefs.errors import ConfigError

MARKER_PREFIX = ".cachefs-tier-"
# The marker before it was empty: the instance id was its content (and it took a page of tmpfs).
_OLD_MARKER_NAME = ".cachefs-tier"
TMP_DIR_NAME = "tmp"
# Offset of the xxh3_128 digest inside BlockKey.raw (after source id and shard).
_DIGEST_OFFSET = 10
_FANOUT_NAME = re.compile(r"[0-9a-f]{2}")
_BLOCK_NAME = re.compile(rf"([0-9a-f]{{{2 * KEY_LEN}}})\.([0-9a-f]{{1,16}})")
_INSTANCE_ID = re.compile(r"[0-9a-f]{32}")  # 16 random bytes, as stored in the index
_MARKER_NAME = re.compile(re.escape(MARKER_PREFIX) + r"([0-9a-f]{32})")
#: Blocks whose written state a tier remembers (~200 bytes each), the oldest dropped first: a
#: block read soon after a cold read admitted it is the case served.
WRITTEN_STATES_KEPT = 32_768


@dataclass(frozen=True, slots=True)
class TierConfig:
    """A tier as configured: ``capacity`` bytes of blocks under ``path``, of which the first
    ``reserve`` bytes admitted are never evicted by the lru policy."""

    name: str
    path: str
    capacity: int
    reserve: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("cache tier: the name must not be empty")
        if not self.path:
            raise ConfigError(f"cache tier {self.name!r}: the directory path must not be empty")
        if not isinstance(self.capacity, int) or self.capacity < 0:
            raise ConfigError(
                f"cache tier {self.name!r}: capacity must be a byte count >= 0, "
                f"got {self.capacity!r}"
            )
        if not isinstance(self.reserve, int) or not 0 <= self.reserve <= self.capacity:
            raise ConfigError(
                f"cache tier {self.name!r}: reserve must be between 0 and the capacity "
                f"({self.capacity} bytes), got {self.reserve!r}"
            )


class Tier:
    """A configured tier at run time.

    The byte counters are owned by ``TieredBlockCache`` and only touched under its lock:
    ``used``/``reserved_used``/``blocks`` mirror what the index holds (committed blocks), and
    ``pending`` is room claimed for blocks that are being written right now, so that
    ``used + pending`` — everything that may be on disk — never exceeds ``capacity``.
    """

    def __init__(self, config: TierConfig, tier_id: int, open_files_limit: int = 0) -> None:
        self.name = config.name
        self.capacity = config.capacity
        self.reserve = config.reserve
        self.tier_id = tier_id
        self.root = os.path.abspath(config.path)
        self._tmp_dir = os.path.join(self.root, TMP_DIR_NAME)
        self.allocation_unit = allocation_unit(self.root)
        self.used = 0
        self.reserved_used = 0
        self.blocks = 0
        self.pending = 0
        # Descriptors of recently read block files: reads open and release them here.
        self.open_files = OpenBlockFiles(open_files_limit, self.block_path)
        # Called with a block's file id before its file is removed (TieredBlockCache.on_remove).
        self.before_remove: Callable[[int], None] | None = None
        # One flag per <d0>/<d1> directory: made (or found) by this process. In a fresh tier
        # nearly every block is the first in its directory, for the first tens of thousands of
        # blocks: one mkdir before the rename costs less than a rename that fails, a stat and
        # makedirs (bench/README.md, "Where a cold small file's worker CPU goes").
        self._fanout_made = bytearray(1 << 16)
        # file id -> (st_ino, st_ctime_ns) of its block file right after it was put in place.
        # Tier methods run on several threads: OrderedDict's setitem, pop and popitem are each
        # one C call under the GIL.
        self._written: OrderedDict[int, tuple[int, int]] = OrderedDict()

    def free(self) -> int:
        return self.capacity - self.used - self.pending

    def footprint(self, size: int) -> int:
        """Bytes of this tier's capacity a block of ``size`` bytes takes (what ``du`` counts)."""
        unit = self.allocation_unit
        return -(-size // unit) * unit

    # --- files ----------------------------------------------------------------------------------

    def block_path(self, raw: bytes, file_id: int) -> str:
        fanout = raw[_DIGEST_OFFSET : _DIGEST_OFFSET + 2].hex()
        return f"{self.root}/{fanout[:2]}/{fanout[2:]}/{raw.hex()}.{file_id:x}"

    def tmp_path(self, raw: bytes) -> str:
        """A new name in the tier's tmp directory for a block being written."""
        return f"{self._tmp_dir}/{raw.hex()}.{secrets.token_hex(6)}"

    def write_block(self, raw: bytes, file_id: int, data: bytes) -> None:
        """Write a block file so that readers see either no file or the complete one.

        No fsync: every block carries a checksum in the index and is verified before it is
        served after a restart, so a block torn by a power loss is dropped, never served.
        """
        tmp_path = self.tmp_path(raw)
        try:
            fd = _write_whole(tmp_path, data)
            try:
                self.place_block(tmp_path, raw, file_id)
                # Its state now, through the descriptor of the file written (the rename moved
                # its ctime, so after it): the one in which it holds ``data``, whose checksums
                # the caller computed from ``data`` itself (:meth:`written_state`).
                placed = _fstat_or_none(fd)
            finally:
                os.close(fd)
        except BaseException:
            unlink_if_present(tmp_path)
            raise
        if placed is None:  # only an optimisation: the block is in place either way
            return
        written = self._written
        written[file_id] = (placed.st_ino, placed.st_ctime_ns)
        if len(written) > WRITTEN_STATES_KEPT:
            try:
                written.popitem(last=False)
            except KeyError:  # emptied by other threads meanwhile
                pass

    def place_block(self, tmp_path: str, raw: bytes, file_id: int) -> None:
        """Rename a whole block file from the tmp directory into its place."""
        final_path = self.block_path(raw, file_id)
        fanout = int.from_bytes(raw[_DIGEST_OFFSET : _DIGEST_OFFSET + 2], "big")
        if not self._fanout_made[fanout]:
            _make_fanout_dir(os.path.dirname(final_path))
            self._fanout_made[fanout] = 1
        try:
            os.rename(tmp_path, final_path)
        except FileNotFoundError:
            # The directory went away under us (not cachefs's doing): make it again.
            if not os.path.exists(tmp_path):
                raise
            os.makedirs(os.path.dirname(final_path), mode=0o700, exist_ok=True)
            os.rename(tmp_path, final_path)

    def written_state(self, file_id: int) -> tuple[int, int] | None:
        """(st_ino, st_ctime_ns) of the block file of admission ``file_id`` right after
        :meth:`write_block` put it in place, if this tier still remembers it (the latest
        :data:`WRITTEN_STATES_KEPT` such blocks; never a block placed by :meth:`place_block`
        alone): a file found in that state holds the bytes that were written."""
        return self._written.get(file_id)

    def remove_block(self, raw: bytes, file_id: int) -> None:
        """Delete a block's file. Tell ``before_remove`` first (the native read path forgets the
        file), unlink, then close a kept descriptor of it: in that order no descriptor of the
        removed file can stay open (see ``open_files.py``)."""
        if self.before_remove is not None:
            self.before_remove(file_id)
        unlink_if_present(self.block_path(raw, file_id))
        self.open_files.forget(file_id)
        self._written.pop(file_id, None)

    # --- orphan sweep ---------------------------------------------------------------------------

    def iter_block_files(self) -> Iterator[tuple[bytes, int, str]]:
        """(key, file id, path) of every block file in the directory. Anything that does not
        look like a block file of ours is left alone."""
        for level0 in _subdirs(self.root):
            for level1 in _subdirs(level0.path):
                for entry in os.scandir(level1.path):
                    name = _BLOCK_NAME.fullmatch(entry.name)
                    if name and entry.is_file(follow_symlinks=False):
                        yield bytes.fromhex(name[1]), int(name[2], 16), entry.path


def allocation_unit(path: str) -> int:
    """Bytes the filesystem holding ``path`` allocates at a time: its fragment size, which is
    the page size on tmpfs (``os.sysconf("SC_PAGE_SIZE")``) and the block size on a disk
    filesystem."""
    stats = os.statvfs(path)
    return stats.f_frsize or stats.f_bsize or os.sysconf("SC_PAGE_SIZE")


def prepare_directory(path: str) -> str:
    """Create a tier directory if needed, remove temp files left by a crash, and return the
    directory's instance id.

    The instance id is the name of an empty marker file inside the directory (empty: it takes
    no room) and is copied into the index. A different (or absent) marker means the directory
    was emptied or replaced — a tmpfs after a reboot — so the index entries that point into it
    are stale.
    """
    tmp_dir = os.path.join(path, TMP_DIR_NAME)
    os.makedirs(tmp_dir, mode=0o700, exist_ok=True)
    for entry in os.scandir(tmp_dir):
        unlink_if_present(entry.path)
    markers = [
        name[1] for entry in os.scandir(path) if (name := _MARKER_NAME.fullmatch(entry.name))
    ]
    if len(markers) == 1:
        instance_id = markers[0]
    else:  # none (a new or emptied directory) or several (not cachefs's doing): a new identity,
        # except that the marker of an older version (its id as content) keeps its identity
        for old_id in markers:
            unlink_if_present(os.path.join(path, MARKER_PREFIX + old_id))
        instance_id = _read_old_marker(path) if not markers else None
        instance_id = instance_id or secrets.token_hex(16)
        _create_empty(os.path.join(path, MARKER_PREFIX + instance_id))
    unlink_if_present(os.path.join(path, _OLD_MARKER_NAME))  # after its id has a new marker
    return instance_id


def _read_old_marker(path: str) -> str | None:
    """The instance id in a marker written before markers were empty files, if any."""
    try:
        with open(os.path.join(path, _OLD_MARKER_NAME), encoding="ascii", errors="replace") as f:
            instance_id = f.read().strip()
    except FileNotFoundError:
        return None
    return instance_id if _INSTANCE_ID.fullmatch(instance_id) else None


def _make_fanout_dir(path: str) -> None:
    """Make ``<root>/<d0>/<d1>`` and, if needed, ``<root>/<d0>``; existing ones are fine."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:  # <d0> is new too
        os.makedirs(path, mode=0o700, exist_ok=True)


def _create_empty(path: str) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))


def _subdirs(path: str) -> Iterator[os.DirEntry[str]]:
    for entry in os.scandir(path):
        if _FANOUT_NAME.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
            yield entry


def write_new_file(path: str, data: bytes | bytearray) -> None:
    """Create ``path`` (it must not exist; mode 0600) holding ``data``: how a block file is
    written, here or by a preload fetcher process into a reservation."""
    os.close(_write_whole(path, data))


def _write_whole(path: str, data: bytes | bytearray) -> int:
    """:func:`write_new_file`, leaving the file open: returns its descriptor (the caller
    closes it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
    except BaseException:
        os.close(fd)
        raise
    return fd


def _fstat_or_none(fd: int) -> os.stat_result | None:
    try:
        return os.fstat(fd)
    except OSError:
        return None


def unlink_if_present(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
