"""The filesystem core: a read-only namespace of datasets over snapshots and the block reader.

No pyfuse3 here (import-linter enforces it): this module speaks plain Python values and raises
``cachefs.errors`` exceptions; ``fuse_ops`` is the only place that knows about the kernel.

Inode numbers. The mount root is inode 1. Each dataset gets a *slot* (a small integer that the
registry never reuses), and a snapshot inode ``local`` of that dataset is exposed as
``slot << 48 | local``. The snapshot keeps ``local`` stable across refreshes, so the kernel's
dentry/attribute caches stay valid for unchanged paths; a removed and re-added dataset gets a new
slot, so stale kernel entries of the old one can never resolve to the new one.

Permissions. Every attribute carries an owner and mode that the kernel enforces (the mount uses
``default_permissions``): the source's own, without write bits, where its snapshot recorded
them (``file://``), else the mount's :class:`MountPermissions` (see cachefs/fs/permissions.py).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

from cachefs.cache.base import CheckedBlock, OpenBlock
from cachefs.errors import BadFileHandle, IsADirectory, NotADirectory, PathNotFound, ReadOnly
from cachefs.fs.blocks import BlockReader, DataSource, FileVersion
from cachefs.fs.native_peer_reads import NativePeerReads
from cachefs.fs.native_reads import (
    BLOCKS_AHEAD_OF_READ,
    BLOCKS_PER_LOOKUP,
    ListingPacker,
    NativeReads,
)
from cachefs.fs.permissions import MountPermissions, shown_mode
from cachefs.meta import ROOT as SNAPSHOT_ROOT
from cachefs.meta import Entry, Snapshot
from cachefs.peer.base import BlockRequest, NativeAnswers, NotCached

MOUNT_ROOT = 1
SLOT_SHIFT = 48
LOCAL_MASK = (1 << SLOT_SHIFT) - 1
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
#: Files whose version no-open reads remember (see FileSystem._versions); ~300 bytes each.
VERSIONS_KEPT = 8192
#: Files a refresh removed or replaced whose old entries stay readable (see FileSystem._retired).
RETIRED_KEPT = 8192


class Attr(NamedTuple):
    """What getattr returns; the adapter turns it into the kernel's struct. A NamedTuple, not
    a frozen dataclass: one is made per entry of every directory listing, and a tuple is made
    several times faster (a 1.28 M-entry walk makes 1.28 M of them)."""

    ino: int
    mode: int  # file type and permission bits
    size: int
    mtime_ns: int
    nlink: int
    uid: int
    gid: int


class MountedDataset:
    """A dataset as served under the mount: its current snapshot and where its bytes live."""

    __slots__ = ("name", "slot", "snapshot", "source")

    def __init__(self, name: str, slot: int, snapshot: Snapshot, source: DataSource):
        self.name = name
        self.slot = slot
        self.snapshot = snapshot
        self.source = source


class _OpenFile:
    __slots__ = ("dataset", "source", "version")

    def __init__(self, dataset: MountedDataset, version: FileVersion):
        self.dataset = dataset
        self.source = dataset.source  # kept: reads of an open file survive a refresh
        self.version = version


class FileSystem:
    def __init__(self, reader: BlockReader, permissions: MountPermissions | None = None):
        self.reader = reader
        # The native READ table (no-open mode with the patched pyfuse3), kept coherent here:
        # see cachefs/fs/native_reads.py. None: every READ is served in Python.
        self.native: NativeReads | None = None
        # ... and, in a cluster, READs of other workers' small files sent to them from C
        # (cachefs/fs/native_peer_reads.py). None: those are served in Python.
        self.native_peers: NativePeerReads | None = None
        # Bumped whenever a snapshot or the set of datasets changes: a registration prepared
        # before an await goes ahead only if no change came in between.
        self._generation = 0
        self.permissions = perms = permissions or MountPermissions()
        # The attributes' (mode, uid, gid) of entries whose source recorded no owner.
        self._default_file = (stat.S_IFREG | perms.file_mode, perms.uid, perms.gid)
        self._default_dir = (stat.S_IFDIR | perms.dir_mode, perms.uid, perms.gid)
        self._by_name: dict[bytes, MountedDataset] = {}
        self._by_slot: dict[int, MountedDataset] = {}
        self._open: dict[int, _OpenFile] = {}
        self._next_fh = 1
        self._root_mtime_ns = time.time_ns()
        # No-open mode: global inode -> (source, version) of files recently looked up or read,
        # so that a READ does not decode the snapshot entry again (the kernel sends a LOOKUP,
        # then the READs of the file). Emptied whenever a snapshot or the set of datasets
        # changes (it holds sources, and files a refresh removed), and when full (entries are
        # only worth keeping for the few moments a file is being read).
        self._versions: dict[int, tuple[DataSource, FileVersion]] = {}
        # Global inode -> snapshot entry of files the last refreshes removed, or replaced by new
        # bytes (which get a new inode, cachefs/meta/build.py). A process that holds one open
        # goes on reading its old bytes by its old inode (no-open READs, getattr), as on a local
        # filesystem after an unlink; the oldest are forgotten beyond RETIRED_KEPT.
        self._retired: dict[int, Entry] = {}
        # Where the LOOKUP replies :meth:`prepare_reads` makes go: the FUSE adapter's native
        # table (set by the adapter; it knows the kernel's reply format and timeouts).
        self.lookup_prepared: Callable[[int, bytes, Attr], None] | None = None

    # --- datasets ----------------------------------------------------------------------------

    def add_dataset(self, dataset: MountedDataset) -> None:
        if dataset.slot <= 0 or dataset.slot >= 1 << 15:
            raise ValueError(f"dataset slot {dataset.slot} out of range")
        self._by_name[dataset.name.encode()] = dataset
        self._by_slot[dataset.slot] = dataset
        self._changed(dataset.slot)
        self._root_mtime_ns = time.time_ns()

    def remove_dataset(self, name: str) -> MountedDataset | None:
        dataset = self._by_name.pop(name.encode(), None)
        if dataset is not None:
            del self._by_slot[dataset.slot]
            slot = dataset.slot
            self._retired = {
                ino: entry for ino, entry in self._retired.items() if ino >> SLOT_SHIFT != slot
            }
            self._changed(dataset.slot)
            self._root_mtime_ns = time.time_ns()
        return dataset

    def dataset(self, name: str) -> MountedDataset | None:
        return self._by_name.get(name.encode())

    def datasets(self) -> list[MountedDataset]:
        return sorted(self._by_slot.values(), key=lambda d: d.slot)

    def replace_snapshot(
        self, name: str, snapshot: Snapshot, source: DataSource, retired: Iterable[Entry] = ()
    ) -> Snapshot:
        """Atomically serve a new snapshot (the trio loop is single-threaded); return the old.
        ``retired``: the old snapshot's entries of files the new one removed or gave new bytes
        (and a new inode): processes holding them open go on reading them."""
        dataset = self._by_name[name.encode()]
        old = dataset.snapshot
        for entry in retired:
            self._retired[dataset.slot << SLOT_SHIFT | entry.ino] = entry
        while len(self._retired) > RETIRED_KEPT:
            del self._retired[next(iter(self._retired))]  # the oldest (insertion order)
        self._changed(dataset.slot)  # before the new snapshot serves a READ
        dataset.snapshot = snapshot
        dataset.source = source
        return old

    def _changed(self, slot: int) -> None:
        """A dataset's snapshot, or the set of datasets, changes: forget what reads of the old
        state remembered (the versions, the native table's entries of its inodes)."""
        self._versions.clear()
        self._generation += 1
        lo, hi = slot << SLOT_SHIFT, ((slot + 1) << SLOT_SHIFT) - 1
        if self.native_peers is not None:  # routes not yet registered (the table has the rest)
            self.native_peers.forget_inodes(lo, hi)
        if self.native is not None:
            self.native.forget_inodes(lo, hi)

    def global_ino(self, dataset: MountedDataset, local_ino: int) -> int:
        return dataset.slot << SLOT_SHIFT | local_ino

    # --- namespace ---------------------------------------------------------------------------

    def _dataset_of(self, ino: int) -> MountedDataset:
        dataset = self._by_slot.get(ino >> SLOT_SHIFT)
        if dataset is None:
            raise PathNotFound(f"inode {ino} belongs to no mounted dataset")
        return dataset

    def _attr(self, dataset: MountedDataset, entry: Entry) -> Attr:
        owner = entry.owner
        if owner is None:
            mode, uid, gid = self._default_dir if entry.is_dir else self._default_file
        else:
            file_type = stat.S_IFDIR if entry.is_dir else stat.S_IFREG
            mode, uid, gid = file_type | shown_mode(owner.mode), owner.uid, owner.gid
        return Attr(
            ino=dataset.slot << SLOT_SHIFT | entry.ino,
            mode=mode,
            size=entry.size,
            mtime_ns=entry.mtime_ns,
            nlink=entry.nlink,
            uid=uid,
            gid=gid,
        )

    def _root_attr(self) -> Attr:
        mode, uid, gid = self._default_dir
        return Attr(MOUNT_ROOT, mode, 0, self._root_mtime_ns, 2 + len(self._by_slot), uid, gid)

    def lookup(self, parent: int, name: bytes) -> Attr:
        if parent == MOUNT_ROOT:
            dataset = self._by_name.get(name)
            if dataset is None:
                raise PathNotFound(f"no dataset named {name!r}")
            entry = dataset.snapshot.getattr(SNAPSHOT_ROOT)
        else:
            dataset = self._dataset_of(parent)
            entry = dataset.snapshot.lookup(parent & LOCAL_MASK, name)
        if entry is None:
            raise PathNotFound(f"{name!r} not found")
        if not entry.is_dir:  # its READs follow (no-open mode): keep what they need
            source, version = self._remember_version(dataset, entry)
            if self.native is not None:
                ino = dataset.slot << SLOT_SHIFT | entry.ino
                if not self.native.register_blocks(ino, source, version, 0, BLOCKS_PER_LOOKUP):
                    self._route_to_owner(ino, source, version)
        return self._attr(dataset, entry)

    def _route_to_owner(self, ino: int, source: DataSource, version: FileVersion) -> None:
        """A file the RAM tier does not hold: its READs go to its owner from C, if another
        worker owns it (NativePeerReads.route says which files qualify)."""
        if self.native_peers is not None:
            self.native_peers.route(ino, source, version)

    def prepare_reads(self, name: str, keys: Sequence[str], max_blocks: int) -> tuple[int, int]:
        """Do for the files ``keys`` of dataset ``name`` what a LOOKUP of each does for the
        native path, without the LOOKUP: register its leading blocks that the RAM tier holds
        (at most BLOCKS_PER_LOOKUP, and ``max_blocks`` in all) and, through
        :attr:`lookup_prepared`, the LOOKUP reply the adapter would give. A job that then
        reads them by path (dentries not cached: a fresh mount, a file list instead of a
        listing) has their LOOKUPs, and the READs of those blocks, answered in C, where each
        file otherwise costs a LOOKUP in Python (a preload calls this for the files it
        fetched and those of other nodes' shards, a fill for the files it copied). Only files
        the served snapshot has, with that key, are prepared: this is the reply a LOOKUP
        would get now, which a refresh forgets as it forgets any LOOKUP reply. Returns (files
        prepared, blocks registered); (0, 0) without the native path."""
        dataset = self.dataset(name)
        if dataset is None or self.native is None or not keys:
            return 0, 0
        slot_bits = dataset.slot << SLOT_SHIFT
        prepared = blocks = 0
        for key, entry in zip(keys, dataset.snapshot.resolve_many(keys), strict=True):
            if entry is None or entry.is_dir or entry.key != key:
                continue
            version = FileVersion(entry.key, entry.etag, entry.size)
            ino = slot_bits | entry.ino
            count = min(BLOCKS_PER_LOOKUP, max_blocks - blocks)
            registered = 0
            if count > 0:
                registered = self.native.register_blocks(ino, dataset.source, version, 0, count)
                blocks += registered
            if not registered:
                self._route_to_owner(ino, dataset.source, version)
            if self.lookup_prepared is not None:  # under the name resolved: the last part
                file_name = key.rpartition("/")[2].encode()
                attr = self._attr(dataset, entry)
                self.lookup_prepared(slot_bits | entry.parent, file_name, attr)
            prepared += 1
        return prepared, blocks

    def getattr(self, ino: int) -> Attr:
        if ino == MOUNT_ROOT:
            return self._root_attr()
        dataset = self._dataset_of(ino)
        return self._attr(dataset, self._entry(dataset, ino))

    def _entry(self, dataset: MountedDataset, ino: int) -> Entry:
        """The snapshot entry of inode ``ino`` of ``dataset``: served now, or retired by a
        refresh while a process may still hold it open."""
        entry = dataset.snapshot.getattr(ino & LOCAL_MASK)
        if entry is None:
            entry = self._retired.get(ino)
        if entry is None:
            raise PathNotFound(f"inode {ino} not in dataset {dataset.name!r}")
        return entry

    def readdir(self, ino: int, after: int) -> Iterator[tuple[bytes, Attr, int]]:
        """(name, attributes, resume token) of each entry after the one ``after`` names (0 =
        from the start). The token is what the kernel passes back as ``after`` to resume."""
        if ino == MOUNT_ROOT:
            for dataset in self.datasets():
                if dataset.slot > after:
                    root = dataset.snapshot.getattr(SNAPSHOT_ROOT)
                    assert root is not None  # every snapshot has its root directory
                    yield dataset.name.encode(), self._attr(dataset, root), dataset.slot
            return
        dataset, local = self._directory(ino)
        for child in self._listed_children(dataset, local, after):
            name, shown_ino, child_ino, size, mtime_ns, mode, nlink, uid, gid = child
            yield name, Attr(shown_ino, mode, size, mtime_ns, nlink, uid, gid), child_ino

    def _listed_children(
        self, dataset: MountedDataset, local: int, after: int
    ) -> Iterator[tuple[bytes, int, int, int, int, int, int, int, int]]:
        """What a listing shows of each child after ``after``: (name, inode as mounted, resume
        token, size, mtime_ns, mode, nlink, uid, gid). Straight from the snapshot records
        (Snapshot.readdir_fields): a listing builds no Entry, the per-entry cost of a walk over
        a million files. One rule for both listings, Python's and the native table's."""
        slot_bits = dataset.slot << SLOT_SHIFT
        default_file, default_dir = self._default_file, self._default_dir
        for child in dataset.snapshot.readdir_fields(local, after):
            name, child_ino, is_dir, size, mtime_ns, nlink, mode, uid, gid = child
            if mode is None:
                mode, uid, gid = default_dir if is_dir else default_file
            else:
                mode = (stat.S_IFDIR if is_dir else stat.S_IFREG) | shown_mode(mode)
            yield name, slot_bits | child_ino, child_ino, size, mtime_ns, mode, nlink, uid, gid

    def _directory(self, ino: int) -> tuple[MountedDataset, int]:
        """The dataset and snapshot inode of directory ``ino`` (not the mount root)."""
        dataset = self._dataset_of(ino)
        local = ino & LOCAL_MASK
        entry = dataset.snapshot.getattr(local)
        if entry is None:
            raise PathNotFound(f"inode {ino} not in dataset {dataset.name!r}")
        if not entry.is_dir:
            raise NotADirectory(f"inode {ino} is not a directory")
        return dataset, local

    def packed_listing(self, ino: int) -> tuple[bytes, int] | None:
        """The whole listing of directory ``ino`` packed for the native table (see
        :class:`ListingPacker`): what :meth:`readdir` from the start gives, without building an
        :class:`Attr` per child. None for the mount root (adding a dataset changes it without
        changing any dataset's inodes) and for a directory too large to pack."""
        if ino == MOUNT_ROOT:
            return None
        dataset, local = self._directory(ino)
        packer = ListingPacker()
        small_files = []  # one-block files: their READs may go to their owners from C
        one_block = dataset.source.block_size if self.native_peers is not None else -1
        for child in self._listed_children(dataset, local, 0):
            if not packer.add(*child):
                return None
            if 0 < child[3] <= one_block and not stat.S_ISDIR(child[5]):
                small_files.append(child[2])
        if self.native_peers is not None:  # a job lists, then reads: route them now
            for local_ino in small_files:
                entry = dataset.snapshot.getattr(local_ino)
                if entry is not None and not entry.is_dir:
                    version = FileVersion(entry.key, entry.etag, entry.size)
                    self.native_peers.route(dataset.slot << SLOT_SHIFT | local_ino,
                                            dataset.source, version)  # fmt: skip
        return packer.packed

    def check_directory(self, ino: int) -> None:
        if ino != MOUNT_ROOT and not stat.S_ISDIR(self.getattr(ino).mode):
            raise NotADirectory(f"inode {ino} is not a directory")

    # --- files -------------------------------------------------------------------------------

    def _file_entry(self, ino: int) -> tuple[MountedDataset, Entry]:
        """The dataset and snapshot entry of a regular file, or the error the kernel should get."""
        if ino == MOUNT_ROOT:
            raise IsADirectory("the mount root is a directory")
        dataset = self._dataset_of(ino)
        entry = self._entry(dataset, ino)
        if entry.is_dir:
            raise IsADirectory(f"{entry.name!r} is a directory")
        return dataset, entry

    def open(self, ino: int, flags: int) -> int:
        if flags & _WRITE_FLAGS:
            raise ReadOnly("cachefs is read-only")
        dataset, entry = self._file_entry(ino)
        fh = self._next_fh
        self._next_fh += 1
        self._open[fh] = _OpenFile(dataset, FileVersion(entry.key, entry.etag, entry.size))
        return fh

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        handle = self._open.get(fh)
        if handle is None:
            raise BadFileHandle(f"file handle {fh} is not open")
        return await self.reader.read(handle.source, handle.version, offset, size)

    async def read_inode(self, ino: int, offset: int, size: int) -> bytes:
        """Read by inode, for FUSE's no-open mode (the kernel sends no OPEN, so there is no
        handle). An inode names one version of a file for good (a refresh gives new bytes a
        new inode), so old and new bytes are never mixed, in a reader or in the page cache."""
        remembered = self._versions.get(ino)
        if remembered is None:
            dataset, entry = self._file_entry(ino)
            remembered = self._remember_version(dataset, entry)
        source, version = remembered
        generation = self._generation

        def register_read_ahead(index: int) -> None:
            # A block read ahead of this reader is in RAM now: its READs can stay in C.
            if self.native is not None and generation == self._generation:
                self.native.register_blocks(ino, source, version, index, 1)

        data = await self.reader.read(
            source, version, offset, size, read_ahead_done=register_read_ahead
        )
        if self.native is not None and generation == self._generation and data:
            # This READ came to Python: its blocks (and the next ones) may be in RAM now.
            first = offset // source.block_size
            last = (offset + len(data) - 1) // source.block_size
            if not self.native.register_blocks(
                ino, source, version, first, last - first + 1 + BLOCKS_AHEAD_OF_READ
            ):  # a block read through from its owner (or the store): the next READs from C
                self._route_to_owner(ino, source, version)
        return data

    def _remember_version(
        self, dataset: MountedDataset, entry: Entry
    ) -> tuple[DataSource, FileVersion]:
        if len(self._versions) >= VERSIONS_KEPT:
            self._versions.clear()
        remembered = dataset.source, FileVersion(entry.key, entry.etag, entry.size)
        self._versions[dataset.slot << SLOT_SHIFT | entry.ino] = remembered
        return remembered

    async def serve_peer_block(self, request: BlockRequest) -> CheckedBlock | OpenBlock:
        """A whole block another node asked this node for (the peer server's ``serve_block``),
        with its chunk checksums.
        The file must be the one our snapshot serves (same etag and size): otherwise
        LookupError → 404, and the asker reads the store itself.

        A plain request comes to the shard's owner: from the cache, else fetched and admitted
        here. A cached-only one comes from a node filling its copy from this one: from the
        cache, else NotCached → 404 — never the store."""
        source, version = self._peer_file(request)
        if request.cached_only:
            data = await self.reader.read_cached_block(source, version, request.index)
            if data is None:
                raise NotCached(request.key)
            return data
        return await self.reader.read_owned_block(source, version, request.index)

    def peer_block_if_cached(self, request: BlockRequest) -> CheckedBlock | OpenBlock | None:
        """What :meth:`serve_peer_block` would answer, at once, when the block is in the RAM
        tier (checked there, as it would be); None in every other case — another tier, not
        cached, not this snapshot's file — which :meth:`serve_peer_block` then handles."""
        try:
            dataset, entry = self._peer_entry(request)
        except LookupError:
            return None
        source, version = dataset.source, FileVersion(entry.key, entry.etag, entry.size)
        block = self.reader.ram_block_now(
            source, version, request.index, a_read=not request.cached_only
        )
        if block is not None and self.native is not None:
            # The next requests for this file's blocks are answered by the native table
            # (answer_peers_natively), as a Python READ registers what follows it.
            self.native.register_blocks(
                dataset.slot << SLOT_SHIFT | entry.ino, source, version, request.index,
                1 + BLOCKS_AHEAD_OF_READ,
            )  # fmt: skip
        return block

    def answer_peers_natively(
        self, sock_fd: int, frames: memoryview, max_answers: int
    ) -> NativeAnswers | None:
        """Answer on the peer connection ``sock_fd`` the request frames at the start of
        ``frames`` whose blocks are in the native table (the peer server's
        ``answer_natively``), as :meth:`peer_block_if_cached` and the server would: None
        without the native path. The table holds only what the snapshot served now has (its
        coherence rules, cachefs/fs/native_reads.py), so these answers need no lookup here;
        the datasets of the plain (not cached-only) requests count as read now."""
        native = self.native
        if native is None:
            return None
        consumed, answered, plain_inos, partial = native.table.answer_peers(
            sock_fd, frames, max_answers
        )
        if answered:
            self.reader.metrics.peer_served += answered
            now = time.time()
            for slot in {ino >> SLOT_SHIFT for ino in plain_inos}:
                dataset = self._by_slot.get(slot)
                if dataset is not None:
                    self.reader.last_read_at[dataset.source.dataset] = now
        return NativeAnswers(consumed, answered, partial)

    def _peer_file(self, request: BlockRequest) -> tuple[DataSource, FileVersion]:
        """The source and file version a peer's request names, if they are the ones our
        snapshot serves (same block size, etag and size); LookupError otherwise."""
        dataset, entry = self._peer_entry(request)
        return dataset.source, FileVersion(entry.key, entry.etag, entry.size)

    def _peer_entry(self, request: BlockRequest) -> tuple[MountedDataset, Entry]:
        """:meth:`_peer_file`'s dataset and snapshot entry."""
        dataset = self.dataset(request.dataset)
        if dataset is None or dataset.source.block_size != request.block_size:
            raise LookupError(request.dataset)
        entry = dataset.snapshot.resolve(request.key)
        if (
            entry is None
            or entry.is_dir
            or (entry.etag, entry.size) != (request.etag, request.size)
        ):
            raise LookupError(request.key)
        return dataset, entry

    def release(self, fh: int) -> None:
        self._open.pop(fh, None)

    def open_handles(self) -> int:
        return len(self._open)

    # --- whole filesystem --------------------------------------------------------------------

    def totals(self) -> tuple[int, int]:
        """(bytes, files) over all mounted datasets, for statfs."""
        total_bytes = total_files = 0
        for dataset in self._by_slot.values():
            stats = dataset.snapshot.stats
            total_bytes += stats.bytes
            total_files += stats.files + stats.dirs
        return total_bytes, total_files
