"""The Python side of the native READ fast path: what may enter its table, and when it leaves.

The patched pyfuse3 (third_party/pyfuse3/build.py, ``cachefs_fast_read.c``) answers a READ in C
when every block it touches is in a table of (inode, block index) → block file, length, chunk
checksums; anything else falls through to the Python handler. This module decides which blocks
enter that table, and keeps it coherent with the cache and the snapshots:

* **In**: a block enters only when the RAM tier holds it with its chunk checksums (it was
  admitted and verified), under the inode of the snapshot served now. :class:`FileSystem`
  registers the blocks of a file when the kernel looks the file up (its READs follow; a training
  job lists, then reads), and after a Python READ the blocks it touched and the next ones; a
  read-ahead marker (cachefs/fs/blocks.py) only once a READ of it came to Python. A
  registration made after an ``await`` names the snapshot generation it started in and is
  dropped if a refresh or a dataset change came in between.
* **Out, before the space goes**: the cache calls the table's ``forget_file`` before it
  removes any block file (eviction, ``dataset rm``, cleanup, hand-off trims, promotion: every
  removal goes through ``Tier.remove_block``); a snapshot swap or a dataset removal forgets the
  dataset's inodes before the new state is served. The C side holds its mutex from lookup to
  close() of every READ, so when a forget returns no READ has the file open any more.
* **Checked**: the C READ checks every chunk it reads against the checksums; a file
  that is gone, short or corrupt is dropped from the table and the READ goes to Python, which
  drops the block from the cache and fetches it again. A chunk checked once is spliced by later
  READs while the file's inode and ctime stay put (any write moves the ctime); a block
  registered with the state the cache's own write left the file in (``Tier.written_state``:
  the checksums were computed from the bytes written) counts as checked in that state, so the
  first READ after a cold read splices too (a preload fetcher's file is read and checked
  first: its checksums came with it).
* **Bounded**: at most min(4096, a quarter of the fd limit) block files are open at once
  (least recently read closed first), and the table keeps at most :data:`NATIVE_READ_BLOCKS`
  blocks (the oldest registration goes first), whose files' block arrays hold at most 4 slots
  per block in all (8 bytes each).

The same table answers LOOKUPs the kernel repeats (the replies :class:`FuseOperations` gave)
and OPENDIR/READDIRPLUS of directories: :class:`ListingPacker` turns a directory's whole listing
(``FileSystem.packed_listing``, asked for by the binding before it hands either request to
Python) into the records the C side keeps (at most :data:`NATIVE_LISTING_BYTES` of them, the
least recently used dropped first), forgotten with the dataset's inodes like its blocks.

Only no-open mode uses it: there every READ of an inode reads the snapshot served now, which is
what the table holds. With open handles a file opened before a refresh keeps its old version,
which a table keyed by inode could not tell apart. With ``--fuse-passthrough`` the binding
answers OPEN and RELEASE itself (handles are 0, so READs still name the inode) and hands the
kernel the block file of a table entry that is its file's only block; the rules for that, and
why a forget still comes first, are in the "passthrough" section of ``cachefs_fast_read.c``.
"""

from __future__ import annotations

import os
import struct
from typing import Protocol

from cachefs.cache.base import CHUNK_SIZE, BlockCache
from cachefs.fs.blocks import BlockReader, DataSource, FileVersion
from cachefs.peer.wire import file_identity

#: Most blocks the native table keeps (~200 bytes each with its path and checksums).
NATIVE_READ_BLOCKS = 1 << 18
#: Most LOOKUP replies the binding remembers (~200 bytes each; see fuse_ops.FuseOperations).
NATIVE_LOOKUP_NAMES = 1 << 18
#: Files one preload job or fill prepares for the native path (FileSystem.prepare_reads): half
#: the LOOKUP replies, so a larger dataset's files, which the table could not keep anyway (it
#: drops the least recently registered), do not push out the replies the running jobs use.
PREPARED_FILES_MAX = NATIVE_LOOKUP_NAMES // 2
#: ... and blocks, for the same reason (a file registers up to BLOCKS_PER_LOOKUP of them); past
#: this the files get their LOOKUP replies only.
PREPARED_BLOCKS_MAX = NATIVE_READ_BLOCKS // 2
#: Blocks of a file registered when it is looked up (its first blocks) ...
BLOCKS_PER_LOOKUP = 64
#: ... and after a Python READ: the blocks it touched and up to this many after them.
BLOCKS_AHEAD_OF_READ = 16
#: Memory the C side's directory listings may take in all (~80 bytes per entry: ~800k entries).
NATIVE_LISTING_BYTES = 64 << 20
#: A directory with more entries than this is not packed: Python lists it page by page, as
#: without the table. Packing runs on the FUSE loop (~5 us per entry: ~0.3 s at this bound,
#: once per directory and snapshot) and the C side keeps at most a quarter of
#: NATIVE_LISTING_BYTES for one directory (~200k entries).
MAX_LISTING_ENTRIES = 65_536
#: One child in a packed listing (cachefs_fast_read.h, cfr_register_listing): inode, the offset
#: the kernel resumes after it, size, mtime_ns, mode, nlink, uid, gid, name length; then the name.
LISTING_RECORD = struct.Struct("<QQQqIIIIH")
#: The tier whose blocks the C side reads (a pread from tmpfs: microseconds, fine to do while
#: holding the FUSE loop; an SSD read is not).
NATIVE_TIER = "ram"


class NativeReadTable(Protocol):
    """The table in the FUSE binding (the pyfuse3 patch's ``fast_read_*`` functions)."""

    def configure(self, chunk_size: int, max_blocks: int, max_names: int) -> None: ...

    def register(
        self,
        ino: int,
        index: int,
        block_size: int,
        file_size: int,
        file_id: int,
        path: bytes,
        length: int,
        chunk_checksums: bytes,
        written_ino: int = 0,
        written_ctime_ns: int = 0,
    ) -> bool: ...

    def forget_file(self, file_id: int) -> None: ...

    def register_peer_name(self, ino: int, identity: bytes) -> bool: ...

    def answer_peers(
        self, sock_fd: int, frames: memoryview, max_answers: int
    ) -> tuple[int, int, list[int], tuple[bytes, int, int, int] | None]: ...

    def configure_listings(
        self, max_bytes: int, entry_timeout: float, attr_timeout: float
    ) -> None: ...

    def register_listing(self, dir_ino: int, packed: bytes, count: int) -> bool: ...

    def forget_inodes(self, lo: int, hi: int) -> None: ...

    def clear(self) -> None: ...

    def stats(self) -> dict[str, int]: ...


class ListingPacker:
    """Packs a directory's children, in listing order, for ``register_listing``; gives up
    (``packed`` None) past :data:`MAX_LISTING_ENTRIES`."""

    def __init__(self) -> None:
        self._parts: list[bytes] | None = []

    def add(self, name: bytes, ino: int, resume_offset: int, size: int, mtime_ns: int,
            mode: int, nlink: int, uid: int, gid: int) -> bool:  # fmt: skip
        """Add one child; False once the listing is too large to pack."""
        parts = self._parts
        if parts is None:
            return False
        if len(parts) >= 2 * MAX_LISTING_ENTRIES:
            self._parts = None
            return False
        record = LISTING_RECORD.pack(
            ino, resume_offset, size, mtime_ns, mode, nlink, uid, gid, len(name)
        )
        parts.append(record)
        parts.append(name)
        return True

    @property
    def packed(self) -> tuple[bytes, int] | None:
        """The records and their count, or None if the listing was too large."""
        if self._parts is None:
            return None
        return b"".join(self._parts), len(self._parts) // 2


class NativeReads:
    """Fills and empties a :class:`NativeReadTable` from the cache's RAM tier."""

    def __init__(
        self, table: NativeReadTable, cache: BlockCache, reader: BlockReader,
        max_blocks: int = NATIVE_READ_BLOCKS,
    ) -> None:  # fmt: skip
        self.table = table
        self._cache = cache
        self._reader = reader
        table.clear()
        table.configure(CHUNK_SIZE, max_blocks, NATIVE_LOOKUP_NAMES)
        cache.on_remove(table.forget_file)

    def register_blocks(
        self, ino: int, source: DataSource, version: FileVersion, first: int, count: int
    ) -> int:
        """Register blocks ``first .. first+count-1`` of a file, up to the first one the RAM
        tier does not hold (one index lookup each: a LOOKUP of a large uncached file costs one,
        not ``count``) and never from a read-ahead marker on (``BlockReader.next_marker``: its
        first READ must reach Python, which tells the read-ahead the reader got there); returns
        how many were registered. Call only with the version the current snapshot serves."""
        block_size = source.block_size
        last = min(first + count, -(-version.size // block_size)) - 1
        marker = self._reader.next_marker(source, version, first - 1)
        if marker is not None:
            last = min(last, marker - 1)
        registered = 0
        for index in range(first, last + 1):
            key = self._reader.block_key(source, version, index)
            found = self._cache.chunked_block_file(key, tier=NATIVE_TIER)
            if found is None:
                break
            written_ino, written_ctime_ns = found.written_state or (0, 0)
            if self.table.register(
                ino, index, block_size, version.size, found.file_id, os.fsencode(found.path),
                found.size, found.chunk_checksums, written_ino, written_ctime_ns,
            ):  # fmt: skip
                registered += 1
        if registered:  # peers' requests for this version are answered from the table too
            self.table.register_peer_name(
                ino,
                file_identity(source.dataset, version.etag, version.key, version.size, block_size),
            )
        return registered

    def forget_inodes(self, lo: int, hi: int) -> None:
        """Forget the blocks of inodes in [lo, hi], and the LOOKUP replies under or naming them."""
        self.table.forget_inodes(lo, hi)

    def close(self) -> None:
        """Empty the table and detach from the cache (the worker is stopping)."""
        self._cache.on_remove(None)
        self.table.clear()

    def stats(self) -> dict[str, int]:
        return self.table.stats()
