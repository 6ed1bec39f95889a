"""TieredBlockCache: the node's block cache over RAM (tmpfs) and SSD tier directories.

Where things live:
- block bytes: one file per block in the tier that admitted it (``tier.py``);
- which tier holds a block, its size, checksums and LRU position: the LMDB index (``index.py``);
- byte accounting: in-memory counters per tier and per source, loaded at open from totals that
  the index keeps in step with its entries, and changed only under ``self._lock``.

Capacity is never exceeded, even transiently: a put first claims room in memory (``pending``),
then writes the file, then commits the index entry and turns the claim into ``used``; removals
unlink the file before giving the room back. Admission — ``put``, and blocks another process
writes into a reservation — is the :class:`~cachefs.cache.admission.Admission` half of the
class, in ``admission.py``. Room is counted in footprints (sizes rounded up to
the tier filesystem's allocation unit, ``tier.py``), so ``du`` of a RAM tier stays within it.

Integrity: at admission the xxh3_64 of every ``CHUNK_SIZE`` chunk of a block (and of the whole
block, for short-circuit readers) is computed from the bytes being admitted and stored in the
block's index entry. Every read then reads the chunks its range touches (whole chunks) and
checks each against its stored checksum, on every tier and every time: a block file damaged or
changed in place on disk at any moment is never served. A block that fails (or whose file has
the wrong size) is dropped and counted as ``corrupt``, and the read returns None, so the caller
fetches the block again.

Locks: no LMDB call is made while holding ``self._lock`` (nor the access stamps' own lock,
``stamps.py``), so they can never deadlock with LMDB's own writer lock.

Reads keep the descriptors of recently read block files open (a bounded table per tier,
``open_files.py``): a block read in many FUSE requests is opened twice, not once per request.
Removing a block closes its descriptor, so the tmpfs memory of evicted blocks is freed.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from collections.abc import Callable, Collection

from cachefs.cache.admission import Admission, CacheClosed
from cachefs.cache.base import (
    CHUNK_SIZE,
    BlockFile,
    BlockKey,
    CacheCounters,
    CheckedBlock,
    ChunkedBlockFile,
    OpenBlock,
    TierUsage,
    checksum,
    chunk_checksums,
    first_bad_chunk,
)
from cachefs.cache.index import BlockIndex, Entry, TotalsDelta
from cachefs.cache.opening import (
    ADMISSION_AVOID_EVICTION,
    ADMISSION_LRU,
    attach_tiers,
    sweep_orphans,
    upgrade_legacy_entries,
    validate,
)
from cachefs.cache.stamps import AccessStamps
from cachefs.cache.tier import Tier, TierConfig
from cachefs.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_INDEX_MAP_SIZE = 8 << 30  # address space, not disk: LMDB grows the file as needed
# evict_source removes in batches so that one huge dataset does not hold the write lock long.
_REMOVE_BATCH = 4096


class _Unread(enum.Enum):
    """Why _read_entry returned no bytes."""

    VANISHED = "the file was not there"
    CORRUPT = "the file failed the size or checksum check"


_VANISHED, _CORRUPT = _Unread.VANISHED, _Unread.CORRUPT


class TieredBlockCache(Admission):
    """A BlockCache (see ``base.py``) over a list of tiers, in admission preference order.

    ``admission="avoid-eviction"`` admits into the first tier with room and refuses when all
    are full; ``"lru"`` evicts least recently used, non-reserved blocks to make room.
    ``promote=True`` moves a block read from a later tier into an earlier one that has room.
    """

    def __init__(
        self,
        index_dir: str,
        tiers: list[TierConfig],
        *,
        admission: str = ADMISSION_AVOID_EVICTION,
        promote: bool = False,
        index_map_size: int = DEFAULT_INDEX_MAP_SIZE,
    ) -> None:
        validate(tiers, admission)
        self._index_dir = index_dir
        self._evict_when_full = admission == ADMISSION_LRU
        self._promote = promote
        self._lock = threading.Lock()
        self._nothing_in_flight = threading.Condition(self._lock)
        # Keys being stored or moved right now → event set when done (one writer per key).
        self._in_flight: dict[bytes, threading.Event | None] = {}
        self._closed = False
        self._admitted = self._refused = self._evicted = self._corrupt = self._missing = 0
        self._thread_buffers = threading.local()  # open_verified's check buffers

        self._index = BlockIndex(index_dir, index_map_size)
        try:
            was_clean = self._index.start_session()
            self._tiers, new_tiers = attach_tiers(self._index, tiers)
            self._tier_by_id = {tier.tier_id: tier for tier in self._tiers}
            self._tier_by_name = {tier.name: tier for tier in self._tiers}
            upgraded = self._index.legacy_format and upgrade_legacy_entries(
                self._index, self._tier_by_id
            )
            sweep_orphans(self._index, self._tiers if not was_clean else new_tiers)
            self._load_totals()
            # The LRU clock, and reads' access stamps on their way to the index (stamps.py).
            self._stamps = AccessStamps(self._index)
            if upgraded:
                self._fit_to_capacity()
        except BaseException:
            self._index.close()  # not marked clean: the next open sweeps again
            raise
        self._stamps.start()

    # --- opening --------------------------------------------------------------------------------

    def _fit_to_capacity(self) -> None:
        """Evict least recently used blocks from tiers whose blocks take more room than their
        capacity: after an upgrade that started counting footprints instead of sizes."""
        for tier in self._tiers:
            excess = tier.used - tier.capacity
            if excess > 0:
                freed = self._evict_oldest(tier, excess)
                log.warning(
                    "cache tier %r: its blocks took %d bytes more than its capacity once counted "
                    "as the filesystem allocates them; evicted %d bytes",
                    tier.name,
                    excess,
                    freed,
                )

    def _load_totals(self) -> None:
        for tier in self._tiers:
            tier.used, tier.reserved_used, tier.blocks = self._index.tier_totals(tier.tier_id)
        self._source_bytes = self._index.source_bytes()
        self._shard_bytes = self._index.shard_bytes()

    # --- hot path: called inline on the trio loop -----------------------------------------------

    def locate(self, key: BlockKey) -> str | None:
        self._check_open()
        value = self._index.get(key.raw)
        return None if value is None else self._tier_by_id[value[0]].name

    def contains(self, key: BlockKey) -> bool:
        return self.locate(key) is not None

    def read(
        self, key: BlockKey, offset: int = 0, length: int = -1, *, tier: str | None = None
    ) -> bytes | None:
        if offset < 0 or length < -1:
            raise ValueError(
                f"block {key.hex}: bad read range offset={offset} length={length} "
                "(offset must be >= 0, length >= 0 or -1 for 'to the end')"
            )
        found = self._read(key.raw, offset, length, tier)
        return None if found is None else found[0]

    def read_with_checksums(self, key: BlockKey, *, tier: str | None = None) -> CheckedBlock | None:
        found = self._read(key.raw, 0, -1, tier)
        if found is None:
            return None
        data, entry = found
        # An entry from index format 1 has none stored yet: they are computed from bytes that
        # were just verified against its whole-block checksum, stored at admission.
        return CheckedBlock(data, entry.chunk_checksums or chunk_checksums(data))

    def open_verified(
        self, key: BlockKey, *, tier: str | None = None
    ) -> OpenBlock | CheckedBlock | None:
        # The bytes are checked in a buffer this thread reuses, and sent from the page cache by
        # whoever receives the descriptor: the check stays, the copy into a Python object and
        # the copy back out of it go. Entries that still lack chunk checksums (index format 1)
        # and blocks a read would promote take the ordinary path, which handles both.
        self._check_open()
        raw = key.raw
        value = self._index.get(raw)
        if value is None or (tier is not None and value[0] != self._tier_id_of(tier)):
            return None
        entry = Entry.unpack(value)
        block_tier = self._tier_by_id[entry.tier_id]
        promotable = self._promote and block_tier is not self._tiers[0]
        if not entry.chunk_checksums or promotable:
            return self.read_with_checksums(key, tier=tier)
        self._stamps.touch(raw)
        open_files = block_tier.open_files
        try:
            fd, stat, kept = open_files.open(raw, entry.file_id)
        except FileNotFoundError:
            return self.read_with_checksums(key, tier=tier)  # vanished: its checks drop it
        try:
            view = self._check_buffer(entry.size)
            intact = (
                stat.st_size == entry.size
                and os.preadv(fd, [view], 0) == entry.size
                and first_bad_chunk(view, entry.chunk_checksums) is None
            )
            own_fd = os.dup(fd) if intact else -1  # the cache may close its own at any time
        finally:
            open_files.release(fd, kept)
        if not intact:
            self._drop(raw, entry, corrupt=True)
            return None
        return OpenBlock(own_fd, entry.size, entry.chunk_checksums)

    def _check_buffer(self, size: int) -> memoryview:
        """``size`` bytes of a buffer this thread reuses for :meth:`open_verified`'s check."""
        buffer = getattr(self._thread_buffers, "buffer", None)
        if buffer is None or len(buffer) < size:
            buffer = self._thread_buffers.buffer = bytearray(size)
        return memoryview(buffer)[:size]

    def _read(
        self, raw: bytes, offset: int, length: int, tier: str | None
    ) -> tuple[bytes, Entry] | None:
        """The verified bytes of a read and the entry they were read by, or None."""
        self._check_open()
        only_tier_id = None if tier is None else self._tier_id_of(tier)
        value = self._index.get(raw)
        # A file can vanish between the index lookup and open() because the block was evicted
        # (then the entry is gone too) or promoted (then the entry points at its new file).
        for _attempt in range(2):
            if value is None or (only_tier_id is not None and value[0] != only_tier_id):
                return None
            entry = Entry.unpack(value)
            result = self._read_entry(raw, entry, offset, length)
            if result is _CORRUPT:
                self._drop(raw, entry, corrupt=True)
                return None
            if not isinstance(result, _Unread):
                return result, entry
            value = self._index.get(raw)
            if value is not None and Entry.unpack(value).file_id == entry.file_id:
                self._drop(raw, entry, corrupt=False)  # the index still points at that file
                return None
        return None

    def _tier_id_of(self, name: str) -> int:
        """The id of the tier named ``name``; -1 (no block's tier) if there is none."""
        tier = self._tier_by_name.get(name)
        return -1 if tier is None else tier.tier_id

    def _read_entry(self, raw: bytes, entry: Entry, offset: int, length: int) -> bytes | _Unread:
        """Bytes ``[offset, offset+length)`` of the block ``entry`` describes, after checking
        every chunk they touch; or _VANISHED, or _CORRUPT."""
        tier = self._tier_by_id[entry.tier_id]
        self._stamps.touch(raw)
        open_files = tier.open_files
        try:
            fd, stat, kept = open_files.open(raw, entry.file_id)
        except FileNotFoundError:
            return _VANISHED
        size = entry.size
        end = size if length < 0 else min(size, offset + length)
        promotable = self._promote and tier is not self._tiers[0]
        chunked = bool(entry.chunk_checksums)
        try:
            if stat.st_size != size:
                return _CORRUPT
            if promotable or not chunked:  # the whole block: to copy it, or to check it whole
                start, stop = 0, size
            elif offset >= end:
                return b""  # touches no chunk
            else:  # the chunks the range touches, whole
                start = offset - offset % CHUNK_SIZE
                stop = min(size, end + (-end % CHUNK_SIZE))
            span = _pread_exact(fd, stop - start, start)
        finally:
            open_files.release(fd, kept)
        if span is None:
            return _CORRUPT
        if chunked:
            if first_bad_chunk(span, entry.chunk_checksums, start // CHUNK_SIZE) is not None:
                return _CORRUPT
        elif checksum(span) == entry.checksum:  # an entry from index format 1
            self._stamps.add_chunk_checksums(raw, entry.file_id, chunk_checksums(span))
        else:
            return _CORRUPT
        if promotable:
            self._promote_block(raw, entry, tier, span)
        if offset >= end:
            return b""
        return span if (start, stop) == (offset, end) else span[offset - start : end - start]

    # --- removal --------------------------------------------------------------------------------

    def evict_lru(self, tier_name: str, nbytes: int, *, source_id: int | None = None) -> int:
        """Evict least recently used, non-reserved blocks of one tier (optionally of one source
        only) until ``nbytes`` of its room are freed or none are left; the last block may
        overshoot. Returns the room freed (footprints). For cleanup policies; counted as
        evictions."""
        self._check_open()
        tier = self._tier_by_name.get(tier_name)
        if tier is None:
            raise ConfigError(
                f"cache tier {tier_name!r} does not exist (tiers: {', '.join(self._tier_by_name)})"
            )
        return self._evict_oldest(tier, nbytes, source_id)

    def _evict_oldest(self, tier: Tier, nbytes: int, source_id: int | None = None) -> int:
        """Evict until ``nbytes`` of the tier's room are freed; returns the room freed."""
        with self._index.write() as writer:
            self._stamps.write(writer)  # so the order reflects every read so far
            victims = writer.oldest_evictable(tier.tier_id, nbytes, source_id)
            for raw, entry in victims:
                writer.remove(raw, entry)
        self._finish_removal(victims, writer.delta, evicted=True)
        return sum(entry.footprint for _raw, entry in victims)

    def evict(self, key: BlockKey) -> int:
        self._check_open()
        raw = key.raw
        with self._index.write() as writer:
            entry = writer.get(raw)
            if entry is None:
                return 0
            writer.remove(raw, entry)
        return self._finish_removal([(raw, entry)], writer.delta)

    def evict_source(self, source_id: int) -> int:
        self._check_open()
        freed = 0
        while True:  # ends when a batch finds nothing left: every pass removes what it finds
            with self._index.write() as writer:
                batch = writer.entries_of_source(source_id, _REMOVE_BATCH)
                for raw, entry in batch:
                    writer.remove(raw, entry)
            if not batch:
                return freed
            freed += self._finish_removal(batch, writer.delta)

    def free_blocks(self, source_id: int, shards: Collection[int] | None = None) -> int:
        """Evict every non-reserved block of one source — of the given shards only, if any —
        from all tiers (cleanup: a copy freed, a node trimmed to the shards it owns). Reserved
        blocks stay. Counted as evictions. Returns the bytes freed."""
        self._check_open()
        source = source_id.to_bytes(8, "big")
        if shards is None:
            prefixes = [source]
        else:
            # Only shards with cached bytes: a trim names most of the 1024 shards, usually
            # holding nothing of this source here.
            held = self.cached_bytes_by_shard(source_id)
            prefixes = [
                source + shard.to_bytes(2, "big") for shard in sorted(set(shards) & held.keys())
            ]
        freed = 0
        for prefix in prefixes:
            after = None
            while True:  # batches, so that one huge dataset does not hold the write lock long
                with self._index.write() as writer:
                    batch, after = writer.evictable_by_prefix(prefix, _REMOVE_BATCH, after)
                    for raw, entry in batch:
                        writer.remove(raw, entry)
                if batch:
                    freed += self._finish_removal(batch, writer.delta, evicted=True)
                if after is None:
                    break
        return freed

    def _drop(self, raw: bytes, bad: Entry, *, corrupt: bool) -> None:
        """Drop a block that failed verification or whose file vanished — unless its entry now
        describes another file (then another thread already removed or moved it)."""
        with self._index.write() as writer:
            entry = writer.get(raw)  # current: its access stamp may have changed since
            if entry is None or entry.file_id != bad.file_id:
                return
            writer.remove(raw, entry)
        self._finish_removal([(raw, entry)], writer.delta)
        tier_name = self._tier_by_id[entry.tier_id].name
        with self._lock:
            if corrupt:
                self._corrupt += 1
            else:
                self._missing += 1
        log.warning(
            "cache tier %r: dropped block %s: %s",
            tier_name,
            raw.hex(),
            "size or checksum mismatch" if corrupt else "its file is missing",
        )

    def _finish_removal(
        self, removed: list[tuple[bytes, Entry]], delta: TotalsDelta, *, evicted: bool = False
    ) -> int:
        """After the index commit: delete the files, then give their room back. Returns the
        bytes of the blocks removed (their sizes)."""
        for raw, entry in removed:
            self._tier_by_id[entry.tier_id].remove_block(raw, entry.file_id)
        with self._lock:
            self._apply(delta)
            if evicted:
                self._evicted += len(removed)
        return sum(entry.size for _raw, entry in removed)

    # --- promotion ------------------------------------------------------------------------------

    def _promote_block(self, raw: bytes, entry: Entry, source: Tier, data: bytes) -> None:
        """Move a verified block into an earlier tier with free room (never evicting for it).
        Best effort: the read that asked for it has its bytes whatever happens here."""
        try:
            if self._claim(raw) is not None:
                return  # being stored or moved by another thread already
        except CacheClosed:
            return
        try:
            earlier = self._tiers[: self._tiers.index(source)]
            target = self._claim_free_room(earlier, entry.size)
            if target is None:
                return
            footprint = target.footprint(entry.size)
            file_id = self._stamps.next()
            try:
                target.write_block(raw, file_id, data)
                delta = self._commit_move(raw, entry, target, file_id)
            except BaseException as exc:
                target.remove_block(raw, file_id)
                with self._lock:
                    target.pending -= footprint
                if not isinstance(exc, OSError):
                    raise
                log.warning(
                    "cache tier %r: could not promote block %s: %s", target.name, raw.hex(), exc
                )
                return
            if delta is None:
                target.remove_block(raw, file_id)
            else:
                source.remove_block(raw, entry.file_id)
            with self._lock:
                target.pending -= footprint
                if delta is not None:
                    self._apply(delta)
        finally:
            self._release_claim(raw)

    def _commit_move(
        self, raw: bytes, entry: Entry, target: Tier, file_id: int
    ) -> TotalsDelta | None:
        """Point the index at the block's new file in ``target``. None if the entry no longer
        describes the file that was copied (the block was removed meanwhile)."""
        with self._index.write() as writer:
            current = writer.get(raw)  # its access stamp may have changed since the read
            if current is None or current.file_id != entry.file_id:
                return None
            writer.remove(raw, current)
            footprint = target.footprint(current.size)
            moved = current._replace(
                tier_id=target.tier_id,
                reserved=self._reserved_on_admission(writer, target, footprint),
                footprint=footprint,
                stamp=self._stamps.next(),
                file_id=file_id,
            )
            writer.insert(raw, moved)
        return writer.delta

    # --- bookkeeping ----------------------------------------------------------------------------

    def _apply(self, delta: TotalsDelta) -> None:
        """Apply a committed transaction's totals to the in-memory counters (under the lock)."""
        for tier_id, (nbytes, reserved_bytes, blocks) in delta.tiers.items():
            tier = self._tier_by_id[tier_id]
            tier.used += nbytes
            tier.reserved_used += reserved_bytes
            tier.blocks += blocks
        for source_id, nbytes in delta.sources.items():
            total = self._source_bytes.get(source_id, 0) + nbytes
            if total:
                self._source_bytes[source_id] = total
            else:
                self._source_bytes.pop(source_id, None)
        for shard_prefix, nbytes in delta.shards.items():
            total = self._shard_bytes.get(shard_prefix, 0) + nbytes
            if total:
                self._shard_bytes[shard_prefix] = total
            else:
                self._shard_bytes.pop(shard_prefix, None)

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosed(f"block cache {self._index_dir} is closed")

    # --- introspection and lifecycle ------------------------------------------------------------

    def block_path(self, key: BlockKey) -> str | None:
        """Path of the block's file (see :meth:`block_file`)."""
        found = self.block_file(key)
        return None if found is None else found.path

    def block_file(self, key: BlockKey) -> BlockFile | None:
        """The block's file with the size and checksum it was admitted with, for short-circuit
        readers (who verify both: the file may be removed or replaced after this answer). A
        reader reads the file directly, so this counts as an access for the LRU order."""
        self._check_open()
        raw = key.raw
        value = self._index.get(raw)
        if value is None:
            return None
        self._stamps.touch(raw)
        entry = Entry.unpack(value)
        path = self._tier_by_id[entry.tier_id].block_path(raw, entry.file_id)
        return BlockFile(path, entry.size, entry.checksum)

    def chunked_block_file(self, key: BlockKey, *, tier: str) -> ChunkedBlockFile | None:
        self._check_open()
        raw = key.raw
        value = self._index.get(raw)
        if value is None or value[0] != self._tier_id_of(tier):
            return None
        entry = Entry.unpack(value)
        if not entry.chunk_checksums:  # an entry from index format 1: its first read adds them
            return None
        block_tier = self._tier_by_id[entry.tier_id]
        path = block_tier.block_path(raw, entry.file_id)
        return ChunkedBlockFile(
            path, entry.size, entry.file_id, entry.chunk_checksums,
            block_tier.written_state(entry.file_id),
        )  # fmt: skip

    def on_remove(self, hook: Callable[[int], None] | None) -> None:
        for tier in self._tiers:
            tier.before_remove = hook

    def usage(self) -> list[TierUsage]:
        with self._lock:
            return [
                TierUsage(
                    name=tier.name,
                    path=tier.root,
                    capacity=tier.capacity,
                    used=tier.used,
                    reserve=tier.reserve,
                    reserved_used=tier.reserved_used,
                    blocks=tier.blocks,
                )
                for tier in self._tiers
            ]

    def counters(self) -> CacheCounters:
        with self._lock:
            return CacheCounters(
                admitted=self._admitted,
                refused=self._refused,
                evicted=self._evicted,
                corrupt=self._corrupt,
                missing=self._missing,
            )

    def cached_bytes(self, source_id: int) -> int:
        with self._lock:
            return self._source_bytes.get(source_id, 0)

    def cached_bytes_by_shard(self, source_id: int) -> dict[int, int]:
        """Bytes of one source cached here, per shard (shards with none are left out)."""
        prefix = source_id.to_bytes(8, "big")
        with self._lock:
            return {
                int.from_bytes(key[8:10], "big"): nbytes
                for key, nbytes in self._shard_bytes.items()
                if key[:8] == prefix
            }

    def flush(self) -> None:
        """Write pending access stamps and sync the index to disk (call periodically)."""
        self._check_open()
        self._stamps.flush()
        self._index.sync()

    def close(self) -> None:
        """Wait for puts in flight, write access stamps, mark the index clean and close it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._in_flight:
                self._nothing_in_flight.wait()
        self._stamps.stop()
        self._index.end_session()
        for tier in self._tiers:
            tier.open_files.close()

    def __enter__(self) -> TieredBlockCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _pread_exact(fd: int, size: int, offset: int) -> bytes | None:
    """``size`` bytes at ``offset``, or None if the file ends first (it was truncated)."""
    data = os.pread(fd, size, offset)
    while len(data) < size:
        more = os.pread(fd, size - len(data), offset + len(data))
        if not more:
            return None
        data += more
    return data
