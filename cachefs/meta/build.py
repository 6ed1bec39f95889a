"""Building a snapshot: stream a bucket listing into a fresh LMDB environment.

Memory stays O(depth): the only namespace state in Python is the chain of directories from the
root to the current key (``_DirFrame``s on a stack). With the sorted listing S3 returns, all keys
under one directory are contiguous, so a directory is opened once, collects its children's
newest mtime and its subdirectory count, and is written when the listing leaves it. Anything
that has to be known about keys seen earlier is asked of LMDB itself (the write transaction
reads its own writes), which is also what makes unsorted input correct:

* before creating a directory, its dirent is looked up: an existing directory is *reopened*
  (its record loaded back into a frame); an existing file loses (the directory wins, the file
  is dropped and counted as a "conflict");
* a file's dirent is written with ``overwrite=False``: if the name is taken (by a directory or
  by an earlier object with the same key) the put fails and the file is skipped as "conflict".

Directory markers (keys ending in "/", size 0) make a directory even if nothing is under it;
a marker whose path is a file's follows the rule above (the directory wins). A listing with
owners (a local directory, see ``ObjectInfo.mode``) gives every file and directory its source's
mode, uid and gid (the root's come with the marker ""); entries it lists with another file type
(symlinks, FIFOs, sockets, devices) are skipped and counted like invalid names.

Inodes are stable across refreshes: a path that existed in ``previous`` with the same kind gets
the same inode (looked up through the previous snapshot's dirents, one component at a time,
riding on the directory chain, so a file costs two reads of ``previous``), unless it is a file
whose bytes changed (size or etag). Every other path, and every file with new bytes, gets a new
inode from ``previous``'s ``next_ino``, so an inode number is never given to a second path or to
a second version of a file in the life of a dataset. The kernel keeps pages per inode: a process
that still holds the old version open reads the old inode, whose pages stay the old bytes, and
never lends them to a process that opens the new version.

Writes go in transactions of ``_BATCH_ENTRIES`` entries with ``sync=False``; keys above
everything already written use LMDB's append mode (sorted input makes that nearly all of them).
The "complete" marker is written last, in a separate synchronous transaction after an fsync of
everything else, so an interrupted build can never be opened as a finished snapshot.
"""

from __future__ import annotations

import errno
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import lmdb

from cachefs.meta.names import CONFLICT, EMPTY_SEGMENT, split_key, unservable_reason
from cachefs.meta.records import (
    DB_COUNT,
    DIRENTS_DB,
    FORMAT_VERSION,
    INO,
    INODES_DB,
    KIND_DIR,
    KIND_FILE,
    MAX_INO,
    META_COMPLETE,
    META_DB,
    META_FORMAT,
    META_NEXT_INO,
    META_STATS,
    ROOT,
    Entry,
    Owner,
    encode_etag,
    file_version,
    pack_dir,
    pack_file,
    permissions_of,
    unpack_entry,
)
from cachefs.meta.snapshot import Snapshot, SnapshotError, SnapshotStats
from cachefs.store.base import ObjectInfo

_BATCH_ENTRIES = 50_000  # entries per write transaction
# LMDB's map size is address space, not disk: the file grows only as pages are written.
# ~200 bytes per object, so this holds a few hundred million objects.
_MAP_SIZE = 64 << 30
RESULT_CAP = 100_000  # most entries each list of a BuildResult holds
_MAX_SAMPLES = 20
_SAMPLE_CHARS = 200
_STAGED_DB = b"staged-inodes"  # exists only during a refresh build (see _inodes_for)


@dataclass(frozen=True)
class BuildResult:
    stats: SnapshotStats
    # Files and directories whose recorded mode or owner changed, same inode (for kernel cache
    # invalidation: attributes are cached too).
    changed_inos: list[int]
    # (parent ino, name) present in `previous` and gone now. Only the topmost entry of a removed
    # subtree is listed: invalidating a directory's dentry drops everything below it. A path
    # whose kind changed (file <-> directory) is listed too: it has a new inode now.
    removed: list[tuple[int, bytes]]
    overflow: bool  # True if any list hit RESULT_CAP: invalidate everything instead
    # Directories of `previous` whose list of entries changed (an entry added, removed or
    # given a new inode): the kernel may keep listings (pyfuse3.cache_listings) and must forget
    # these.
    listings_changed: list[int] = field(default_factory=list)
    # (parent ino, name) of files whose bytes (size or etag) changed: the name leads to a new
    # inode now, and the kernel must forget its dentry of the old one.
    replaced: list[tuple[int, bytes]] = field(default_factory=list)


def build_snapshot(
    objects: Iterable[ObjectInfo],
    dest: str | os.PathLike[str],
    *,
    previous: Snapshot | None = None,
) -> BuildResult:
    """Stream a listing into a new LMDB environment at ``dest`` (a directory that must not
    exist; it is created, and removed again if the build fails).

    Input order: ascending UTF-8 byte order of keys (what S3 returns) is fastest; any order
    gives the same namespace, except that among objects with the same key the first one wins.
    Reuses ``previous``'s inode numbers for paths that still exist with the same kind.
    """
    dest = os.fspath(dest)
    try:
        os.makedirs(dest)
    except FileExistsError:
        raise FileExistsError(
            errno.EEXIST, "snapshot destination already exists; build into a new directory", dest
        ) from None
    try:
        return _Builder(dest, previous).build(objects)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise


class _DirFrame:
    """A directory on the current chain: what is needed to write its record when it closes."""

    __slots__ = (
        "dirty",
        "folded_mtime",
        "ino",
        "ino_key",
        "mtime",
        "name",
        "name_bytes",
        "owner",
        "parent",
        "subdirs",
    )

    def __init__(
        self,
        ino: int,
        name: str,
        name_bytes: bytes,
        parent: int,
        *,
        mtime: int | None = None,
        subdirs: int = 0,
        folded_mtime: int | None = None,
        owner: Owner | None = None,
    ) -> None:
        self.ino = ino
        self.ino_key = INO.pack(ino)
        self.name = name
        self.name_bytes = name_bytes
        self.parent = parent
        self.mtime = mtime  # newest direct child so far; None while it has no children
        self.subdirs = subdirs
        # A child was dropped (a file replaced by a directory), or a reopened subdirectory's
        # mtime went down: the running max may be too high, recompute it from LMDB on close.
        self.dirty = False
        # The mtime the parent already folded in, for a directory reopened (unsorted input).
        self.folded_mtime = folded_mtime
        self.owner = owner  # from the directory's marker, if the listing recorded one


class _Table:
    """One sub-DB being filled inside the current write transaction. Puts go through one cursor
    and use append mode while keys keep rising (no B-tree search, pages filled completely)."""

    __slots__ = ("cursor", "db", "max_key")
    cursor: lmdb.Cursor[bytes]  # set by bind(), before the first put

    def __init__(self, db: lmdb._Database) -> None:
        self.db = db
        self.max_key = b""  # >= the largest key in the DB (deletes do not lower it)

    def bind(self, txn: lmdb.Transaction[bytes]) -> None:
        self.cursor = txn.cursor(db=self.db)

    def put(self, key: bytes, value: bytes, *, overwrite: bool = True) -> bool:
        """False if ``overwrite`` is False and the key exists."""
        if key > self.max_key:
            self.max_key = key
            return self.cursor.put(key, value, append=True)
        return self.cursor.put(key, value, overwrite=overwrite)


class _Builder:
    # The write transaction: opened by _begin_write() (build() starts with it), committed and
    # replaced every _BATCH_ENTRIES writes, deleted when _finish() has committed the last one.
    _txn: lmdb.Transaction[bytes]

    def __init__(self, dest: str, previous: Snapshot | None) -> None:
        self._dest = dest
        self._started = time.perf_counter()
        self._snapshot_ns = time.time_ns()
        self._prev_txn: lmdb.Transaction[bytes] | None = None
        self._prev_next_ino = ROOT + 1
        # Inodes at or above this go to the staging DB (see _inodes_for).
        self._staged_from = MAX_INO
        # Turns an older-format previous's records into ours (None: previous is current).
        self._prev_upgrade: Callable[[bytes], bytes] | None = None
        if previous is not None:
            # previous is immutable: one read transaction serves the whole build. Its keys are
            # looked up in nearly ascending order, so cursors (which search the current page
            # first) beat fresh lookups from the root.
            self._prev_upgrade = previous._upgrade_record
            self._prev_txn = previous._live_env().begin()
            self._prev_dirents = self._prev_txn.cursor(db=previous._dirents)
            self._prev_inodes = self._prev_txn.cursor(db=previous._inodes)
            self._prev_next_ino = previous._next_ino
            self._staged_from = previous._next_ino
        self._next_ino = self._prev_next_ino

        self._env = lmdb.open(
            dest, map_size=_MAP_SIZE, max_dbs=DB_COUNT + 1, sync=False, metasync=False, lock=False
        )
        self._inodes = _Table(self._env.open_db(INODES_DB))
        self._staged = _Table(self._env.open_db(_STAGED_DB))
        self._dirents = _Table(self._env.open_db(DIRENTS_DB))
        self._meta = self._env.open_db(META_DB)
        self._pending_writes = 0

        self._stack: list[_DirFrame] = []
        self._files = 0
        self._dirs = 0
        self._bytes = 0
        self._skipped: dict[str, int] = {}
        self._samples: list[str] = []
        self._changed: list[int] = []
        self._overflow = False
        self._dropped_files = False
        # Reused directories whose recorded owner changed: a set, as unsorted input may close a
        # directory more than once (only the last close counts).
        self._changed_dirs: set[int] = set()
        self._listings_changed: set[int] = set()

    def build(self, objects: Iterable[ObjectInfo]) -> BuildResult:
        try:
            self._begin_write()
            self._txn.put(META_FORMAT, FORMAT_VERSION, db=self._meta)
            self._stack.append(_DirFrame(ROOT, "", b"", ROOT))
            self._inodes.put(INO.pack(ROOT), pack_dir(2, 0, ROOT, b"", None))
            for info in objects:
                self._add_object(info)
            return self._finish()
        except lmdb.MapFullError as err:
            raise SnapshotError(
                f"snapshot at {self._dest!r} outgrew its {_MAP_SIZE >> 30} GiB map"
            ) from err
        except lmdb.Error as err:
            raise SnapshotError(f"building snapshot at {self._dest!r} failed: {err}") from err
        finally:
            if self._prev_txn is not None:
                self._prev_txn.abort()
            self._env.close()  # also aborts a write transaction left open by an error

    # --- one object -----------------------------------------------------------------------

    def _add_object(self, info: ObjectInfo) -> None:
        key = info.key
        owner = None
        if info.mode is not None:
            reason = unservable_reason(info.mode)
            if reason is not None:
                self._skip(reason, key)
                return
            if info.uid is None or info.gid is None:
                raise SnapshotError(
                    f"building snapshot at {self._dest!r}: object {_sample(key)} has a mode "
                    "but no owner (a listing that records one records both)"
                )
            owner = Owner(info.mode & 0o7777, info.uid, info.gid)
        if not key and info.size == 0:
            # The dataset prefix's own directory marker: that is the root.
            self._stack[0].owner = owner
            return
        split = split_key(key)
        if split.reason is not None:
            self._skip(split.reason, key)
        elif not split.is_marker:
            parts = split.parts
            parent = self._enter_dirs(parts, len(parts) - 1)
            self._add_file(parent, split.raw, info, owner)
        elif info.size:
            self._skip(EMPTY_SEGMENT, key)  # "a/" with content: a file with an empty name
        else:
            self._enter_dirs(split.parts, len(split.parts)).owner = owner

    def _enter_dirs(self, parts: list[str], depth: int) -> _DirFrame:
        """Make the stack the chain root, parts[0], ..., parts[depth-1]; return its top."""
        stack = self._stack
        common = 1  # stack[i] is the directory parts[i-1]
        limit = min(len(stack), depth + 1)
        while common < limit and stack[common].name == parts[common - 1]:
            common += 1
        while len(stack) > common:
            self._close_top()
        while len(stack) <= depth:
            stack.append(self._open_child_dir(stack[-1], parts[len(stack) - 1]))
        return stack[-1]

    def _add_file(
        self, parent: _DirFrame, raw_key: bytes, info: ObjectInfo, owner: Owner | None
    ) -> None:
        etag = encode_etag(info.etag)
        try:
            record = pack_file(info.size, info.mtime_ns, parent.ino, etag, raw_key, owner)
        except struct.error as err:
            raise SnapshotError(
                f"building snapshot at {self._dest!r}: object {_sample(info.key)} has an invalid "
                f"size {info.size!r}, mtime {info.mtime_ns!r}, etag length {len(etag)} or "
                f"owner {owner!r}: {err}"
            ) from None
        name = raw_key[raw_key.rfind(b"/") + 1 :]
        ino, prev_record = self._inode_for(parent, name, KIND_FILE)
        if prev_record is not None:
            _kind, prev_size, prev_etag = file_version(prev_record)
            if prev_size != info.size or prev_etag != etag:
                # New bytes, new inode: the old one's pages stay with whoever holds it open.
                # (Its parent's listing changes too: _finish adds the parents of `replaced`.)
                ino, prev_record = self._new_ino(), None
        ino_key = INO.pack(ino)
        if not self._dirents.put(parent.ino_key + name, ino_key, overwrite=False):
            self._skip(CONFLICT, info.key)  # a directory or an earlier object has this path
            return
        self._inodes_for(ino).put(ino_key, record)
        if parent.mtime is None or info.mtime_ns > parent.mtime:
            parent.mtime = info.mtime_ns
        self._files += 1
        self._bytes += info.size
        if prev_record is not None and permissions_of(prev_record) != permissions_of(record):
            self._note_changed(ino)
        self._count_write()

    def _skip(self, reason: str, key: str) -> None:
        self._skipped[reason] = self._skipped.get(reason, 0) + 1
        if len(self._samples) < _MAX_SAMPLES:
            self._samples.append(_sample(key))

    def _note_changed(self, ino: int) -> None:
        if len(self._changed) < RESULT_CAP:
            self._changed.append(ino)
        else:
            self._overflow = True

    # --- directories ----------------------------------------------------------------------

    def _open_child_dir(self, parent: _DirFrame, name: str) -> _DirFrame:
        name_bytes = name.encode("utf-8")
        dirent_key = parent.ino_key + name_bytes
        existing = self._txn.get(dirent_key, db=self._dirents.db)
        if existing is not None:
            entry = self._read_entry(INO.unpack(existing)[0])
            if entry.is_dir:
                return self._reopen(entry, name)
            self._drop_file(parent, entry.ino, entry.size, entry.key)
        ino, _prev_record = self._inode_for(parent, name_bytes, KIND_DIR)
        ino_key = INO.pack(ino)
        self._dirents.put(dirent_key, ino_key)
        # A placeholder now, in inode order (append mode); the real record is written on close.
        self._inodes_for(ino).put(ino_key, pack_dir(2, 0, parent.ino, name_bytes, None))
        parent.subdirs += 1
        self._dirs += 1
        self._count_write()
        return _DirFrame(ino, name, name_bytes, parent.ino)

    def _reopen(self, entry: Entry, name: str) -> _DirFrame:
        """A directory the (unsorted) listing left earlier and now enters again."""
        ino_key = INO.pack(entry.ino)
        cursor = self._txn.cursor(db=self._dirents.db)
        has_children = cursor.set_range(ino_key) and cursor.key()[:8] == ino_key
        return _DirFrame(
            entry.ino,
            name,
            name.encode("utf-8"),
            entry.parent,
            mtime=entry.mtime_ns if has_children else None,
            subdirs=entry.nlink - 2,
            folded_mtime=entry.mtime_ns,
            owner=entry.owner,
        )

    def _drop_file(self, parent: _DirFrame, ino: int, size: int, key: str) -> None:
        """A directory needs this file's path: the directory wins. Its dirent is overwritten
        by the caller; its mtime may still be in the parent's running max."""
        self._txn.delete(INO.pack(ino), db=self._inodes_for(ino).db)
        self._files -= 1
        self._bytes -= size
        self._skip(CONFLICT, key)
        parent.dirty = True
        self._dropped_files = True

    def _close_top(self) -> None:
        frame = self._stack.pop()
        mtime = self._write_dir(frame)
        parent = self._stack[-1]
        if frame.folded_mtime is not None and mtime < frame.folded_mtime:
            parent.dirty = True
        if parent.mtime is None or mtime > parent.mtime:
            parent.mtime = mtime

    def _write_dir(self, frame: _DirFrame) -> int:
        """Write the directory's final record; return its mtime."""
        if frame.dirty:
            frame.mtime = self._newest_child_mtime(frame.ino_key)
        mtime = self._snapshot_ns if frame.mtime is None else frame.mtime
        try:
            record = pack_dir(2 + frame.subdirs, mtime, frame.parent, frame.name_bytes, frame.owner)
        except struct.error as err:
            raise SnapshotError(
                f"building snapshot at {self._dest!r}: directory {frame.name!a} has an invalid "
                f"owner {frame.owner!r}: {err}"
            ) from None
        self._inodes_for(frame.ino).put(frame.ino_key, record)
        if frame.ino < self._prev_next_ino and self._prev_txn is not None:
            # A reused inode: the same directory in previous. A changed owner or mode must
            # reach the kernel, which caches attributes.
            prev_record = self._prev_record(frame.ino_key)
            if permissions_of(prev_record) != permissions_of(record):
                self._changed_dirs.add(frame.ino)
            else:
                self._changed_dirs.discard(frame.ino)
        return mtime

    def _newest_child_mtime(self, ino_key: bytes) -> int | None:
        newest = None
        cursor = self._txn.cursor(db=self._dirents.db)
        if not cursor.set_range(ino_key):
            return None
        for dirent_key, child_key in cursor.iternext():
            if dirent_key[:8] != ino_key:
                break
            mtime = self._read_entry(INO.unpack(child_key)[0]).mtime_ns
            if newest is None or mtime > newest:
                newest = mtime
        return newest

    # --- inodes and writes ----------------------------------------------------------------

    def _inode_for(self, parent: _DirFrame, name: bytes, kind: int) -> tuple[int, bytes | None]:
        """The previous snapshot's inode (and record) for this path if it had the same kind,
        else a new inode."""
        # New directories get inodes >= _prev_next_ino; only older ones can have old children.
        if self._prev_txn is not None and parent.ino < self._prev_next_ino:
            prev_key = self._prev_dirents.get(parent.ino_key + name)
            if prev_key is not None:
                prev_record = self._prev_record(prev_key)
                if prev_record[0] == kind:
                    return INO.unpack(prev_key)[0], prev_record
            self._listings_changed.add(parent.ino)  # a new entry in a directory of previous
        return self._new_ino(), None

    def _new_ino(self) -> int:
        ino = self._next_ino
        if ino >= MAX_INO:
            raise SnapshotError(f"snapshot at {self._dest!r}: inode numbers exhausted")
        self._next_ino = ino + 1
        return ino

    def _prev_record(self, ino_key: bytes) -> bytes:
        """The previous snapshot's record of an inode it has, in the current format."""
        record = self._prev_inodes.get(ino_key)
        if record is None:
            raise SnapshotError(
                f"the previous snapshot of {self._dest!r} is damaged: inode "
                f"{INO.unpack(ino_key)[0]} has a directory entry but no record"
            )
        return record if self._prev_upgrade is None else self._prev_upgrade(record)

    def _inodes_for(self, ino: int) -> _Table:
        """Where the record of ``ino`` is written during the build.

        In a refresh, reused inodes (below previous.next_ino) and new ones (above) arrive
        interleaved. Written to one DB, every reused inode after the first new one would be an
        insert in front of the last key: no append mode, and each full page split in half for
        good (a measured 70 % larger file). So new inodes are staged in their own DB and moved
        over, in append mode, when the build ends."""
        return self._staged if ino >= self._staged_from else self._inodes

    def _read_entry(self, ino: int) -> Entry:
        """An entry this build wrote (its directory entry points at it)."""
        record = self._txn.get(INO.pack(ino), db=self._inodes_for(ino).db)
        if record is None:
            raise SnapshotError(f"building snapshot at {self._dest!r}: inode {ino} was not written")
        return unpack_entry(ino, record)

    def _begin_write(self) -> None:
        self._txn = self._env.begin(write=True)
        for table in (self._inodes, self._staged, self._dirents):
            table.bind(self._txn)
        self._pending_writes = 0

    def _count_write(self) -> None:
        self._pending_writes += 1
        if self._pending_writes >= _BATCH_ENTRIES:
            self._txn.commit()
            self._begin_write()

    # --- the end --------------------------------------------------------------------------

    def _finish(self) -> BuildResult:
        while len(self._stack) > 1:
            self._close_top()
        self._write_dir(self._stack[0])
        self._txn.commit()
        self._move_staged()
        del self._txn

        changed = self._surviving_changed()
        removed, replaced = self._find_removed()
        stats = SnapshotStats(
            files=self._files,
            dirs=self._dirs,
            bytes=self._bytes,
            skipped=dict(sorted(self._skipped.items())),
            skipped_samples=self._samples,
            built_at=self._snapshot_ns / 1e9,
            build_seconds=time.perf_counter() - self._started,
        )
        self._env.sync(True)
        self._env.close()
        _mark_complete(self._dest, stats, self._next_ino)
        listings = self._listings_changed | {parent for parent, _name in removed + replaced}
        overflow = self._overflow or len(listings) > RESULT_CAP
        return BuildResult(
            stats, changed, removed, overflow, sorted(listings)[:RESULT_CAP], replaced
        )

    def _move_staged(self) -> None:
        """Append the staged records (all above every reused inode) to ``inodes``, a batch per
        transaction, then drop the staging DB."""
        start = b""
        while True:
            self._begin_write()
            batch = []
            reader = self._txn.cursor(db=self._staged.db)
            if reader.set_range(start):
                for item in reader.iternext():
                    batch.append(item)
                    if len(batch) == _BATCH_ENTRIES:
                        break
            if not batch:
                self._txn.drop(self._staged.db, delete=True)
                self._txn.commit()
                return
            _consumed, added = self._inodes.cursor.putmulti(batch, append=True)
            if added != len(batch):  # append mode refuses, silently, a key that is not last
                raise SnapshotError(f"snapshot at {self._dest!r}: staged inodes out of order")
            self._txn.commit()
            start = batch[-1][0] + b"\0"  # the next key after the last one moved

    def _surviving_changed(self) -> list[int]:
        """Changed inodes minus files a directory replaced later (unsorted input only)."""
        for ino in sorted(self._changed_dirs):
            self._note_changed(ino)
        if not self._dropped_files:
            return self._changed
        with self._env.begin(db=self._inodes.db) as txn:
            return [ino for ino in self._changed if txn.get(INO.pack(ino)) is not None]

    def _find_removed(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]]]:
        """(removed, replaced): walk the previous snapshot's dirents in key order and check each
        against the new ones. A name that leads to another inode now is *replaced* if it is a
        file in both (its bytes changed), else removed. The entries of a directory that is
        itself gone are skipped in one seek."""
        removed: list[tuple[int, bytes]] = []
        replaced: list[tuple[int, bytes]] = []
        if self._prev_txn is None:
            return removed, replaced
        old = self._prev_dirents
        with self._env.begin() as txn:
            new_inodes = txn.cursor(db=self._inodes.db)
            new_dirents = txn.cursor(db=self._dirents.db)
            found = old.first()
            while found:
                parent_key = old.key()[:8]
                parent = INO.unpack(parent_key)[0]
                if new_inodes.get(parent_key) is None:
                    found = old.set_range(INO.pack(parent + 1))  # reported by its own parent
                    continue
                found = False
                for dirent_key, child_key in old.iternext():
                    if dirent_key[:8] != parent_key:
                        found = True  # the cursor stays on the next directory's first entry
                        break
                    new_child_key = new_dirents.get(dirent_key)
                    if new_child_key == child_key:
                        continue
                    new_record = None if new_child_key is None else new_inodes.get(new_child_key)
                    both_files = (
                        new_record is not None
                        and new_record[0] == KIND_FILE
                        and self._prev_record(child_key)[0] == KIND_FILE
                    )
                    listed = replaced if both_files else removed
                    if len(listed) == RESULT_CAP:
                        self._overflow = True
                        return removed, replaced
                    listed.append((parent, dirent_key[8:]))
        return removed, replaced


def _mark_complete(dest: str, stats: SnapshotStats, next_ino: int) -> None:
    """The last write of a build, durable on its own (sync=True), with the directory entry of
    the data file it completes."""
    env = lmdb.open(dest, map_size=_MAP_SIZE, max_dbs=DB_COUNT, lock=False)
    try:
        meta = env.open_db(META_DB)
        with env.begin(write=True, db=meta) as txn:
            txn.put(META_STATS, stats.to_json())
            txn.put(META_NEXT_INO, INO.pack(next_ino))
            txn.put(META_COMPLETE, b"1")
    finally:
        env.close()
    directory = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _sample(key: str) -> str:
    if len(key) <= _SAMPLE_CHARS:
        return ascii(key)
    return f"{key[:_SAMPLE_CHARS]!a}... ({len(key)} characters)"
