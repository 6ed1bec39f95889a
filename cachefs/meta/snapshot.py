"""Reading a namespace snapshot: getattr, lookup, readdir and resolve straight from LMDB.

The FUSE core calls these inline on the trio loop and from worker threads, so every call is
one short read transaction doing O(log n + result) work, and nothing of the namespace is kept in
Python but a bounded table of recent ``lookup`` answers. A snapshot is immutable once built;
that is what makes the choices below safe:

* ``lock=False``: LMDB's lock file exists to keep readers and a writer apart. A finished
  snapshot never has a writer, so readers need no reader-table slot: no shared mutex per
  transaction (4 threads doing begin+get: 431k/s unlocked vs 172k/s locked, measured here), no
  ``max_readers`` ceiling, no stale slots left by killed processes, and a read-only directory
  works.
* ``readahead`` stays on (LMDB's default): with the pages not yet in the page cache, a full
  walk of an ImageNet-sized snapshot (224 MB) took 12 s with it and 31 s without, and 20k random
  resolves 47 µs vs 275 µs each. Turning it off only pays for snapshots much larger than RAM.
* ``close()`` never unmaps the file under a call in flight: it only drops this object's
  reference to the environment. Each call holds its own reference for its duration (and a
  ``readdir`` iterator until it is exhausted or discarded), and CPython closes the environment
  when the last reference goes. LMDB releases the GIL inside its C calls, so an eager close
  could otherwise unmap memory another thread is reading.
* ``lookup`` answers (the decoded entry, or None) are remembered by (parent, name) with no
  invalidation: they cannot change. The table is emptied when full and on ``close()``.
"""

from __future__ import annotations

import builtins
import ctypes
import json
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Final, TypeVar

import lmdb

from cachefs.errors import CachefsError
from cachefs.meta.names import MAX_NAME_BYTES
from cachefs.meta.records import (
    DB_COUNT,
    DIRENTS_DB,
    HEADER,
    INO,
    INODES_DB,
    KIND_DIR,
    META_COMPLETE,
    META_DB,
    META_FORMAT,
    META_NEXT_INO,
    META_STATS,
    NO_MODE,
    RECORD_UPGRADES,
    ROOT,
    Entry,
    unpack_entry,
)

T = TypeVar("T")
#: A child as a directory listing shows it (:meth:`Snapshot.readdir_fields`): name, inode,
#: is_dir, size (0 for a directory), mtime_ns, nlink, then the mode, uid and gid the source
#: recorded (mode None: none recorded, the mount's defaults apply).
ListedChild = tuple[bytes, int, bool, int, int, int, "int | None", int, int]

# readdir reads this many entries in its first transaction and doubles up to the maximum:
# the kernel asks for a few dozen entries per call, a `ls` of a big directory for all of them.
_READDIR_FIRST_CHUNK = 32
_READDIR_MAX_CHUNK = 1024
_MAX_KEY_INO = (1 << 64) - 1
#: ``lookup`` answers a Snapshot remembers (~400 bytes each).
LOOKUPS_KEPT = 4096


class _Missing(Enum):
    """What a table holds for a question not asked before (None is a kept answer)."""

    NOT_KEPT = "not kept"


_NOT_KEPT: Final = _Missing.NOT_KEPT


class SnapshotError(CachefsError):
    """A snapshot directory that cannot be served (missing, incomplete, wrong format) or a
    snapshot used after ``close()``."""


@dataclass(frozen=True)
class SnapshotStats:
    files: int
    dirs: int  # directories below the root
    bytes: int  # total size of the files
    skipped: dict[str, int]  # reason -> count (only reasons that occurred; see names.py)
    skipped_samples: list[str]  # up to 20 skipped keys as ascii() reprs (safe to print)
    built_at: float  # unix time
    build_seconds: float

    # The field ``bytes`` shadows the type in this class's scope: the methods name builtins'.
    def to_json(self) -> builtins.bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: builtins.bytes) -> SnapshotStats:
        return cls(**json.loads(data))


class Snapshot:
    """A read-only view of one built snapshot; thread-safe, many concurrent readers."""

    def __init__(
        self,
        env: lmdb.Environment,
        path: str,
        stats: SnapshotStats,
        next_ino: int,
        upgrade_record: Callable[[bytes], bytes] | None,
    ) -> None:
        # Use Snapshot.open(); this only wires up an environment that open() has checked.
        self._env: lmdb.Environment | None = env
        self._inodes = env.open_db(INODES_DB, create=False)
        self._dirents = env.open_db(DIRENTS_DB, create=False)
        self.path = path
        self.stats = stats
        self._next_ino = next_ino  # refreshes allocate new inodes from here
        # A snapshot of an older format decodes each record through its upgrade (records.py);
        # a refresh reading this one as its `previous` does the same.
        self._upgrade_record = upgrade_record
        self._unpack: Callable[[int, bytes], Entry] = (
            unpack_entry
            if upgrade_record is None
            else lambda ino, record: unpack_entry(ino, upgrade_record(record))
        )
        #: False for a snapshot written before the source's mode and owner were recorded
        #: (format 1): every entry then shows the mount's defaults.
        self.records_owners = upgrade_record is None
        # (parent, name) -> entry or None. Plain dict operations are atomic under the GIL, so
        # the loop thread and worker threads share it without a lock.
        self._lookups: dict[tuple[int, bytes], Entry | None] = {}

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Snapshot:
        """Open a complete snapshot read-only; raises SnapshotError naming the problem."""
        path = os.fspath(path)
        # One opener at a time: LMDB forbids opening databases concurrently in one environment.
        with _open_envs_lock:
            env = _shared_env(path)
            stats, next_ino, upgrade_record = _read_meta(env, path)
            return cls(env, path, stats, next_ino, upgrade_record)

    def close(self) -> None:
        """Stop serving from this snapshot. Calls already running (and readdir iterators already
        handed out) finish normally; later calls raise SnapshotError."""
        self._env = None
        self._lookups = {}

    def getattr(self, ino: int) -> Entry | None:
        if not 0 < ino <= _MAX_KEY_INO:
            return None
        with self._live_env().begin(db=self._inodes) as txn:
            record = txn.get(INO.pack(ino))
        return None if record is None else self._unpack(ino, record)

    def lookup(self, parent: int, name: bytes) -> Entry | None:
        if not 0 < parent <= _MAX_KEY_INO or not 0 < len(name) <= MAX_NAME_BYTES:
            return None
        env = self._live_env()
        question = (parent, name)
        entry = self._lookups.get(question, _NOT_KEPT)
        if entry is not _NOT_KEPT:
            return entry
        with env.begin(db=self._inodes) as txn:
            entry = self._lookup_in(txn, INO.pack(parent), name)
        lookups = self._lookups
        if len(lookups) >= LOOKUPS_KEPT:
            lookups.clear()
        lookups[question] = entry
        return entry

    def resolve(self, path: str) -> Entry | None:
        """The entry at ``path`` relative to the root ("" is the root, no leading slash)."""
        env = self._live_env()
        with env.begin(db=self._inodes) as txn:
            if not path:
                return self._stored_entry(txn, INO.pack(ROOT))
            entry = None
            parent_key = INO.pack(ROOT)
            for part in path.split("/"):
                entry = self._lookup_part(txn, parent_key, part)
                if entry is None:
                    return None
                parent_key = INO.pack(entry.ino)
            return entry

    def resolve_many(self, paths: Iterable[str]) -> list[Entry | None]:
        """:meth:`resolve` of many paths in one read transaction, each directory they share
        looked up once: a file under ``train/n01440764/`` costs one lookup, not three (what
        a short-circuit reader's batch of an epoch's files asks)."""
        env = self._live_env()
        root_key = INO.pack(ROOT)
        dir_keys: dict[str, bytes | None] = {"": root_key}  # path -> inode key; None: no dir
        entries: list[Entry | None] = []
        with env.begin(db=self._inodes) as txn:
            for path in paths:
                if not path:
                    entries.append(self._stored_entry(txn, root_key))
                    continue
                parent_key, name = self._parent_key(txn, dir_keys, path)
                entries.append(
                    None if parent_key is None else self._lookup_part(txn, parent_key, name)
                )
        return entries

    def readdir(self, ino: int, after: int = 0) -> Iterator[Entry]:
        """Children of directory ``ino`` sorted by name bytes; if ``after`` is a child's ino,
        start right after that child. Yields nothing if ``ino`` is not a directory or ``after``
        is not one of its children (e.g. it was removed by a refresh between two calls).

        Entries are read in chunks, each in its own short transaction, so an iterator the
        caller abandons (a full kernel buffer) holds no transaction open and wasted little work.
        The iterator keeps the environment alive until it is exhausted or discarded.
        """
        return self._iter_children(self._live_env(), ino, after, self._entry_of)

    def readdir_fields(self, ino: int, after: int = 0) -> Iterator[ListedChild]:
        """What a directory listing shows of each child, in :meth:`readdir`'s order and with
        its ``after``, without building an :class:`Entry`: a listing of a million files decodes
        a million records, and this skips the etag and key (a third of the cost)."""
        return self._iter_children(self._live_env(), ino, after, self._listed_child)

    def _entry_of(self, name: bytes, ino: int, record: bytes) -> Entry:
        return self._unpack(ino, record)

    def _listed_child(self, name: bytes, ino: int, record: bytes) -> ListedChild:
        if self._upgrade_record is not None:
            record = self._upgrade_record(record)
        kind, _etag_len, nlink, size, mtime_ns, _parent, mode, uid, gid = HEADER.unpack_from(record)
        is_dir = kind == KIND_DIR
        return (name, ino, is_dir, 0 if is_dir else size, mtime_ns, nlink,
                None if mode == NO_MODE else mode, uid, gid)  # fmt: skip

    def dir_inos(self) -> list[int]:
        """The inode of every directory (one pass over the inode table; run it in a thread):
        what a refresh invalidates when it cannot name the directories whose listing changed."""
        env = self._live_env()
        inos = []
        with env.begin(db=self._inodes) as txn:
            for ino_key, record in txn.cursor():
                if record[0] == KIND_DIR:
                    inos.append(INO.unpack(ino_key)[0])
        return inos

    def iter_files(self) -> Iterator[Entry]:
        """Every file of the snapshot, in inode order (one pass over the inode table: what a
        preload planner walks; it runs in a thread, and the snapshot is immutable, so one long
        read transaction is harmless)."""
        env = self._live_env()
        with env.begin(db=self._inodes) as txn:
            for ino_key, record in txn.cursor():
                entry = self._unpack(INO.unpack(ino_key)[0], record)
                if not entry.is_dir:
                    yield entry

    def unmap_pages(self) -> int:
        """Drop this process's page-table entries for the snapshot's file (``madvise``
        MADV_DONTNEED over every mapping of it); returns the bytes of the ranges advised.

        Why: LMDB reads through a shared read-only mapping, so every record read stays mapped
        and counts in the worker's RSS until the snapshot closes: a walk of 1.28 M entries left
        216 MiB of it. The pages themselves stay in the page cache (a later read maps one back
        with a minor fault and the same bytes, also under a read in another thread: py-lmdb
        hands out copies, never views of the map), and unmapped page cache is what reclaim
        takes first, so a worker that walked a large dataset no longer holds it."""
        # Held until the advice is given: while this reference lives the environment cannot
        # be closed, so its mapping cannot be unmapped and its address reused by another
        # mapping (say, malloc's: MADV_DONTNEED would zero that) between reading
        # /proc/self/maps and madvise. Raises SnapshotError once the snapshot is closed.
        env = self._live_env()
        data_file = os.path.realpath(os.path.join(self.path, "data.mdb"))
        advised = _unmap_file_pages(data_file)
        del env
        return advised

    # --- internals ------------------------------------------------------------------------

    def _live_env(self) -> lmdb.Environment:
        env = self._env
        if env is None:
            raise SnapshotError(f"snapshot at {self.path!r} is closed")
        return env

    def _dir_key(
        self, txn: lmdb.Transaction[bytes], dir_keys: dict[str, bytes | None], path: str
    ) -> bytes | None:
        """The inode key of directory ``path`` (None if it is not one), remembered in
        ``dir_keys``. A method, not a closure: a recursive closure is a reference cycle that
        would keep ``txn``, and so the environment, alive until the next garbage collection."""
        key = dir_keys.get(path, _NOT_KEPT)
        if key is _NOT_KEPT:
            parent_key, name = self._parent_key(txn, dir_keys, path)
            entry = None if parent_key is None else self._lookup_part(txn, parent_key, name)
            key = INO.pack(entry.ino) if entry is not None and entry.is_dir else None
            dir_keys[path] = key
        return key

    def _parent_key(
        self, txn: lmdb.Transaction[bytes], dir_keys: dict[str, bytes | None], path: str
    ) -> tuple[bytes | None, str]:
        """The inode key of the directory holding ``path`` (a non-empty path), and the last
        component. ``"/a"`` has an empty first component: no parent, as :meth:`resolve` says."""
        parent, slash, name = path.rpartition("/")
        if slash and not parent:
            return None, name
        return self._dir_key(txn, dir_keys, parent), name

    def _lookup_part(
        self, txn: lmdb.Transaction[bytes], parent_key: bytes, part: str
    ) -> Entry | None:
        """One path component under ``parent_key`` (None if not a valid name, or missing)."""
        try:
            name = part.encode("utf-8")
        except UnicodeEncodeError:
            return None
        if not 0 < len(name) <= MAX_NAME_BYTES:
            return None
        return self._lookup_in(txn, parent_key, name)

    def _lookup_in(
        self, txn: lmdb.Transaction[bytes], parent_key: bytes, name: bytes
    ) -> Entry | None:
        child_key = txn.get(parent_key + name, db=self._dirents)
        if child_key is None:
            return None
        return self._stored_entry(txn, child_key)

    def _stored_entry(self, txn: lmdb.Transaction[bytes], ino_key: bytes) -> Entry:
        """The entry of an inode the snapshot names (the root, a directory entry's child)."""
        record = txn.get(ino_key)
        if record is None:
            raise self._damaged(ino_key)
        return self._unpack(INO.unpack(ino_key)[0], record)

    def _damaged(self, ino_key: bytes) -> SnapshotError:
        """A complete snapshot holds the record of every inode it names; this one does not."""
        return SnapshotError(
            f"snapshot at {self.path!r} is damaged: inode {INO.unpack(ino_key)[0]} has no "
            "record; delete it and build a new one"
        )

    def _iter_children(
        self, env: lmdb.Environment, ino: int, after: int, decode: Callable[[bytes, int, bytes], T]
    ) -> Iterator[T]:
        """The children of ``ino`` after ``after``, each as ``decode(name, ino, record)``."""
        if not 0 < ino <= _MAX_KEY_INO:
            return
        prefix = INO.pack(ino)
        start = prefix
        if after:
            if not 0 < after <= _MAX_KEY_INO:
                return
            with env.begin(db=self._inodes) as txn:
                record = txn.get(INO.pack(after))
            after_entry = None if record is None else self._unpack(after, record)
            if after_entry is None or after_entry.parent != ino or after == ROOT:
                return
            start = prefix + after_entry.name
        skip_start = bool(after)
        chunk_size = _READDIR_FIRST_CHUNK
        while True:
            chunk, last_name = self._read_children(
                env, prefix, start, skip_start, chunk_size, decode
            )
            yield from chunk
            if len(chunk) < chunk_size:
                return
            start = prefix + last_name
            skip_start = True
            chunk_size = min(chunk_size * 2, _READDIR_MAX_CHUNK)

    def _read_children(
        self,
        env: lmdb.Environment,
        prefix: bytes,
        start: bytes,
        skip_start: bool,
        limit: int,
        decode: Callable[[bytes, int, bytes], T],
    ) -> tuple[list[T], bytes]:
        """Up to ``limit`` children whose dirent key is >= ``start`` (> if ``skip_start``),
        decoded, and the name of the last one (b"" if none)."""
        children: list[T] = []
        name = b""
        with env.begin(db=self._inodes) as txn:
            cursor = txn.cursor(db=self._dirents)
            if not cursor.set_range(start):
                return children, name
            if skip_start and cursor.key() == start and not cursor.next():
                return children, name
            get, unpack_ino, cut = txn.get, INO.unpack, len(prefix)
            for dirent_key, child_key in cursor.iternext():
                if not dirent_key.startswith(prefix) or len(children) == limit:
                    break
                name = dirent_key[cut:]
                record = get(child_key)
                if record is None:
                    raise self._damaged(child_key)
                children.append(decode(name, unpack_ino(child_key)[0], record))
        return children, name


def _unmap_file_pages(path: str) -> int:
    """``madvise(MADV_DONTNEED)`` over every mapping of ``path`` in this process (as
    /proc/self/maps lists them); the bytes advised. A file-backed shared mapping loses only its
    page-table entries: the file's pages stay in the page cache."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == path:
                low, _, high = fields[0].partition("-")
                ranges.append((int(low, 16), int(high, 16)))
    advised = 0
    for start, end in ranges:
        if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED):
            err = ctypes.get_errno()
            raise OSError(err, f"madvise of {path}: {os.strerror(err)}")
        advised += end - start
    return advised


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


# py-lmdb refuses to open one environment twice in a process (a second handle would share, and
# on close drop, the first one's POSIX locks). Snapshots of the same directory share one
# Environment instead; it closes when the last of them lets go.
_open_envs: weakref.WeakValueDictionary[tuple[int, int], lmdb.Environment] = (
    weakref.WeakValueDictionary()
)
_open_envs_lock = threading.Lock()


def _shared_env(path: str) -> lmdb.Environment:
    """The open environment of this snapshot directory, or a newly opened one. The caller
    holds _open_envs_lock."""
    try:
        data_file = os.stat(os.path.join(path, "data.mdb"))
    except FileNotFoundError:
        raise SnapshotError(f"no snapshot at {path!r}: data.mdb does not exist") from None
    file_id = (data_file.st_dev, data_file.st_ino)
    env = _open_envs.get(file_id)
    if env is None:
        try:
            env = lmdb.open(path, readonly=True, lock=False, max_dbs=DB_COUNT, create=False)
        except lmdb.Error as err:
            raise SnapshotError(f"cannot open snapshot at {path!r}: {err}") from err
        _open_envs[file_id] = env
    return env


def _read_meta(
    env: lmdb.Environment, path: str
) -> tuple[SnapshotStats, int, Callable[[bytes], bytes] | None]:
    """Check that ``env`` is a complete snapshot of a format we read; return its stats, next
    ino and record upgrade (records.RECORD_UPGRADES)."""
    try:
        meta_db = env.open_db(META_DB, create=False)
    except lmdb.Error as err:  # NotFoundError, or IncompatibleError for a plain key "meta"
        raise SnapshotError(
            f"{path!r} is not a cachefs snapshot (no {META_DB.decode()} database: {err})"
        ) from None
    with env.begin(db=meta_db) as txn:
        version = txn.get(META_FORMAT)
        complete = txn.get(META_COMPLETE)
        stats = txn.get(META_STATS)
        next_ino = txn.get(META_NEXT_INO)
    if version not in RECORD_UPGRADES:
        readable = ", ".join(repr(known) for known in sorted(RECORD_UPGRADES))
        raise SnapshotError(
            f"snapshot at {path!r} has format {version!r}, this version reads {readable}; "
            "rebuild it"
        )
    if complete is None or stats is None or next_ino is None:
        raise SnapshotError(
            f"snapshot at {path!r} is incomplete (its build did not finish); delete it and "
            "build a new one"
        )
    return SnapshotStats.from_json(stats), INO.unpack(next_ino)[0], RECORD_UPGRADES[version]
