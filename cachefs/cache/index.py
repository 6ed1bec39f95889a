"""The LMDB block index of the tiered cache.

One environment, three sub-databases:

``blocks``  BlockKey.raw → Entry (tier id, flags, size, footprint, whole-block xxh3_64,
            last-access stamp, file id, then the xxh3_64 of each chunk of the block).
``lru``     tier id | class | stamp | BlockKey.raw → empty. Sorted so that the least recently used
            evictable block of a tier is the first key after ``(tier id, EVICTABLE)``: eviction
            is a cursor seek, not a scan. Reserved blocks sit under ``(tier id, RESERVED)`` so
            eviction never has to step over them, while ``(tier id)`` alone still lists the whole
            tier (used to drop a tier whose directory was wiped).
``meta``    format version, clean-shutdown flag, access clock, tier registry (name → tier id and
            instance id), and running totals per tier and per source. The totals are updated in
            the same transaction as the entries they sum, so they can never drift from them, and
            opening a large cache does not need a scan to answer ``usage()``.

Every change to entries goes through ``IndexWriter``, which keeps the ``lru`` records and the
totals in step and records the change as a ``TotalsDelta`` for the in-memory counters.

Format 1 (before chunk checksums and footprints) is still opened: its entries read as entries
whose footprint is their size (what the totals counted for them) and that have no chunk
checksums. ``TieredBlockCache`` upgrades such an index at open (``opening.upgrade_legacy_entries``).
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import lmdb

log = logging.getLogger(__name__)

FORMAT_VERSION = b"2"
LEGACY_FORMAT_VERSION = b"1"

# tier id, flags, size, footprint, xxh3_64, last-access stamp, file id; chunk checksums follow
_ENTRY = struct.Struct(">BBQQQQQ")
_LEGACY_ENTRY = struct.Struct(">BBQQQQ")  # format 1: no footprint, no chunk checksums
_FLAG_RESERVED = 1
_RESERVED_CLASS = 0
_EVICTABLE_CLASS = 1
_U64 = struct.Struct(">Q")
_LRU_KEY_PREFIX_LEN = 2 + _U64.size  # tier id, class, stamp; then BlockKey.raw
_TIER_TOTALS = struct.Struct(">QQQ")  # used bytes, reserved bytes, blocks
_TIER_RECORD = struct.Struct(">B16s")  # tier id, instance id

# What an index damaged by a power loss (or written by another format) raises at open. Other
# errors, such as a permission problem, are raised: deleting the index would not fix them.
_UNREADABLE_INDEX = (
    lmdb.InvalidError,
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.VersionMismatchError,
)

_META_VERSION = b"version"
_META_CLEAN = b"clean"
_META_CLOCK = b"clock"
_META_TIER = b"tier/"  # + tier name
_META_TIER_TOTALS = b"tier-totals/"  # + tier id (1 byte)
_META_SOURCE_BYTES = b"source-bytes/"  # + source id (8 bytes)


class Entry(NamedTuple):
    tier_id: int
    reserved: bool
    size: int  # bytes of the block
    footprint: int  # bytes of its tier's capacity it takes: size rounded up (tier.py)
    checksum: int  # xxh3_64 of the whole block (short-circuit readers check it)
    stamp: int  # last access, from the cache's access clock
    file_id: int  # unique per admission, part of the file name (see tier.py)
    # xxh3_64 of each CHUNK_SIZE chunk (cache/base.py chunk_checksums); empty only for an entry
    # from format 1, until its first read computes them from the verified whole block.
    chunk_checksums: bytes = b""

    def pack(self) -> bytes:
        flags = _FLAG_RESERVED if self.reserved else 0
        header = _ENTRY.pack(
            self.tier_id,
            flags,
            self.size,
            self.footprint,
            self.checksum,
            self.stamp,
            self.file_id,
        )
        return header + self.chunk_checksums

    @classmethod
    def unpack(cls, value: bytes) -> Entry:
        if len(value) == _LEGACY_ENTRY.size:  # never a format 2 length: that is 42 + 8n
            tier_id, flags, size, checksum, stamp, file_id = _LEGACY_ENTRY.unpack(value)
            return cls(tier_id, bool(flags & _FLAG_RESERVED), size, size, checksum, stamp, file_id)
        tier_id, flags, size, footprint, checksum, stamp, file_id = _ENTRY.unpack_from(value)
        reserved = bool(flags & _FLAG_RESERVED)
        chunks = bytes(value[_ENTRY.size :])
        return cls(tier_id, reserved, size, footprint, checksum, stamp, file_id, chunks)

    @staticmethod
    def is_legacy(value: bytes) -> bool:
        """Whether a packed entry is in format 1."""
        return len(value) == _LEGACY_ENTRY.size

    def lru_key(self, raw: bytes) -> bytes:
        block_class = _RESERVED_CLASS if self.reserved else _EVICTABLE_CLASS
        return bytes((self.tier_id, block_class)) + _U64.pack(self.stamp) + raw


class TierTotals(NamedTuple):
    used: int
    reserved_used: int
    blocks: int


class TierRecord(NamedTuple):
    tier_id: int
    instance_id: str


@dataclass
class TotalsDelta:
    """How one transaction changed the per-tier and per-source totals."""

    tiers: dict[int, list[int]] = field(default_factory=dict)  # id → [bytes, reserved, blocks]
    sources: dict[int, int] = field(default_factory=dict)  # source id → bytes
    shards: dict[bytes, int] = field(default_factory=dict)  # source id | shard (10 bytes) → bytes

    def record(self, raw: bytes, entry: Entry, sign: int) -> None:
        # A tier counts the room its blocks take; a source and a shard the bytes they hold.
        tier = self.tiers.setdefault(entry.tier_id, [0, 0, 0])
        tier[0] += sign * entry.footprint
        tier[1] += sign * entry.footprint if entry.reserved else 0
        tier[2] += sign
        source_id = int.from_bytes(raw[:8], "big")
        self.sources[source_id] = self.sources.get(source_id, 0) + sign * entry.size
        shard_prefix = raw[:10]
        self.shards[shard_prefix] = self.shards.get(shard_prefix, 0) + sign * entry.size


class IndexWriter:
    """The operations of one write transaction (used only by the thread that opened it)."""

    def __init__(self, index: BlockIndex, txn: lmdb.Transaction[bytes]) -> None:
        self._index = index
        self._txn = txn
        self.delta = TotalsDelta()
        self._max_stamp = 0

    def get(self, raw: bytes) -> Entry | None:
        value = self._txn.get(raw, db=self._index.blocks_db)
        return None if value is None else Entry.unpack(value)

    def insert(self, raw: bytes, entry: Entry) -> None:
        self._txn.put(raw, entry.pack(), db=self._index.blocks_db)
        self._txn.put(entry.lru_key(raw), b"", db=self._index.lru_db)
        self.delta.record(raw, entry, +1)
        self._max_stamp = max(self._max_stamp, entry.stamp, entry.file_id)

    def remove(self, raw: bytes, entry: Entry) -> None:
        self._txn.delete(raw, db=self._index.blocks_db)
        self._txn.delete(entry.lru_key(raw), db=self._index.lru_db)
        self.delta.record(raw, entry, -1)

    def restamp(self, raw: bytes, stamp: int) -> None:
        """Record an access at ``stamp`` (ignored if the block is gone or has a newer stamp)."""
        entry = self.get(raw)
        if entry is None or entry.stamp >= stamp:
            return
        self._txn.delete(entry.lru_key(raw), db=self._index.lru_db)
        restamped = entry._replace(stamp=stamp)
        self._txn.put(raw, restamped.pack(), db=self._index.blocks_db)
        self._txn.put(restamped.lru_key(raw), b"", db=self._index.lru_db)
        self._max_stamp = max(self._max_stamp, stamp)

    def add_chunk_checksums(self, raw: bytes, file_id: int, chunk_checksums: bytes) -> None:
        """Give a format 1 entry the chunk checksums computed from its verified bytes (ignored
        if the block is gone, was admitted again meanwhile, or has them already)."""
        entry = self.get(raw)
        if entry is None or entry.file_id != file_id or entry.chunk_checksums:
            return
        upgraded = entry._replace(chunk_checksums=chunk_checksums)
        self._txn.put(raw, upgraded.pack(), db=self._index.blocks_db)

    def legacy_entries(self) -> Iterator[tuple[bytes, Entry]]:
        """Every entry still in format 1."""
        for raw, value in self._txn.cursor(db=self._index.blocks_db):
            if Entry.is_legacy(value):
                yield raw, Entry.unpack(value)

    def mark_format_current(self) -> None:
        """Record that every entry is in the current format (``FORMAT_VERSION``)."""
        self._txn.put(_META_VERSION, FORMAT_VERSION, db=self._index.meta_db)

    def tier_totals(self, tier_id: int) -> TierTotals:
        """The tier's totals as of this point of the transaction."""
        used, reserved_used, blocks = self._persisted_tier_totals(tier_id)
        delta = self.delta.tiers.get(tier_id, (0, 0, 0))
        return TierTotals(used + delta[0], reserved_used + delta[1], blocks + delta[2])

    def oldest_evictable(
        self, tier_id: int, nbytes: int, source_id: int | None = None
    ) -> list[tuple[bytes, Entry]]:
        """The least recently used non-reserved blocks of a tier, oldest first, until their
        footprints add up to ``nbytes`` (or the tier has no more). With ``source_id``, only
        blocks of that source are chosen; the walk then skips other sources' blocks."""
        prefix = bytes((tier_id, _EVICTABLE_CLASS))
        source_prefix = None if source_id is None else source_id.to_bytes(8, "big")
        chosen: list[tuple[bytes, Entry]] = []
        freed = 0
        for lru_key, _empty in _scan_prefix(self._txn.cursor(db=self._index.lru_db), prefix):
            if freed >= nbytes:
                break
            raw = lru_key[_LRU_KEY_PREFIX_LEN:]
            if source_prefix is not None and not raw.startswith(source_prefix):
                continue
            entry = self.get(raw)
            if entry is not None:
                chosen.append((raw, entry))
                freed += entry.footprint
        return chosen

    def entries_of_tier(self, tier_id: int) -> list[tuple[bytes, Entry]]:
        cursor = self._txn.cursor(db=self._index.lru_db)
        raws = [
            lru_key[_LRU_KEY_PREFIX_LEN:] for lru_key, _ in _scan_prefix(cursor, bytes((tier_id,)))
        ]
        return [(raw, entry) for raw in raws if (entry := self.get(raw)) is not None]

    def entries_of_source(self, source_id: int, limit: int) -> list[tuple[bytes, Entry]]:
        cursor = self._txn.cursor(db=self._index.blocks_db)
        records = _scan_prefix(cursor, source_id.to_bytes(8, "big"))
        return [(raw, Entry.unpack(value)) for raw, value in itertools.islice(records, limit)]

    def evictable_by_prefix(
        self, prefix: bytes, limit: int, after: bytes | None = None
    ) -> tuple[list[tuple[bytes, Entry]], bytes | None]:
        """The non-reserved entries among the next ``limit`` entries whose key starts with
        ``prefix`` (after the key ``after``, if given), in key order. Returns them and the last
        key looked at, to resume from — None once the prefix is exhausted. Bounded by entries
        looked at, reserved ones included: a prefix full of reserved blocks neither holds one
        transaction long nor is walked again for every batch."""
        start = prefix if after is None else after + b"\0"  # keys have one length
        chosen: list[tuple[bytes, Entry]] = []
        last = None
        records = _scan_from(self._txn.cursor(db=self._index.blocks_db), start, prefix)
        for looked, (raw, value) in enumerate(records):
            if looked == limit:
                return chosen, last
            last = raw
            entry = Entry.unpack(value)
            if not entry.reserved:
                chosen.append((raw, entry))
        return chosen, None

    def register_tier(self, name: str, record: TierRecord) -> None:
        value = _TIER_RECORD.pack(record.tier_id, bytes.fromhex(record.instance_id))
        self._txn.put(_META_TIER + name.encode(), value, db=self._index.meta_db)

    def unregister_tier(self, name: str) -> None:
        self._txn.delete(_META_TIER + name.encode(), db=self._index.meta_db)

    def persist(self) -> None:
        """Write the accumulated totals and the access clock (called just before commit)."""
        meta = self._index.meta_db
        for tier_id, (used, reserved_used, blocks) in self.delta.tiers.items():
            old = self._persisted_tier_totals(tier_id)
            new = (old[0] + used, old[1] + reserved_used, old[2] + blocks)
            _put_or_delete(
                self._txn, meta, _META_TIER_TOTALS + bytes((tier_id,)), new, _TIER_TOTALS
            )
        for source_id, nbytes in self.delta.sources.items():
            key = _META_SOURCE_BYTES + source_id.to_bytes(8, "big")
            old_value = self._txn.get(key, db=meta)
            old_bytes: int = 0 if old_value is None else _U64.unpack(old_value)[0]
            _put_or_delete(self._txn, meta, key, (old_bytes + nbytes,), _U64)
        if self._max_stamp > self._index.read_clock(self._txn):
            self._txn.put(_META_CLOCK, _U64.pack(self._max_stamp), db=meta)

    def _persisted_tier_totals(self, tier_id: int) -> TierTotals:
        return _read_tier_totals(self._txn, self._index.meta_db, tier_id)


def _read_tier_totals(
    txn: lmdb.Transaction[bytes], meta_db: lmdb._Database, tier_id: int
) -> TierTotals:
    value = txn.get(_META_TIER_TOTALS + bytes((tier_id,)), db=meta_db)
    return TierTotals(0, 0, 0) if value is None else TierTotals(*_TIER_TOTALS.unpack(value))


def _scan_prefix(cursor: lmdb.Cursor[bytes], prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) of every record whose key starts with ``prefix``, in key order."""
    return _scan_from(cursor, prefix, prefix)


def _scan_from(
    cursor: lmdb.Cursor[bytes], start: bytes, prefix: bytes
) -> Iterator[tuple[bytes, bytes]]:
    """Like :func:`_scan_prefix`, from the first key at or after ``start``."""
    if not cursor.set_range(start):
        return
    for key, value in cursor.iternext():
        if not key.startswith(prefix):
            return
        yield key, value


def _put_or_delete(
    txn: lmdb.Transaction[bytes],
    db: lmdb._Database,
    key: bytes,
    values: tuple[int, ...],
    packer: struct.Struct,
) -> None:
    """Keep ``meta`` small: a total that dropped to zero is removed, not stored."""
    if any(values):
        txn.put(key, packer.pack(*values), db=db)
    else:
        txn.delete(key, db=db)


class BlockIndex:
    """The LMDB environment of the block index."""

    def __init__(self, path: str, map_size: int) -> None:
        self.path = path
        os.makedirs(path, mode=0o700, exist_ok=True)
        try:
            self._env = self._open(map_size)
        except _UNREADABLE_INDEX as exc:
            # The index only describes cached copies: rebuilding it empty loses nothing but
            # warmth. The tier files it described are swept as orphans (no clean flag).
            log.warning(
                "block cache index %s is unusable (%s); starting with an empty one", path, exc
            )
            for name in ("data.mdb", "lock.mdb"):
                try:
                    os.unlink(os.path.join(path, name))
                except FileNotFoundError:
                    pass
            self._env = self._open(map_size)

    def _open(self, map_size: int) -> lmdb.Environment:
        # sync=False, metasync=False: no fsync per commit. The index is a cache of what the tier
        # directories hold and every block is checksummed, so losing the last commits in a power
        # loss costs warmth, never correctness: blocks whose entry was lost are swept as orphans
        # (the clean flag is removed, durably, at open), entries whose file was lost or torn fail
        # verification and are dropped, and an index that cannot be opened is rebuilt empty.
        # flush() and close() call env.sync() to bound what a power loss can take.
        env = lmdb.open(
            self.path,
            map_size=map_size,
            subdir=True,
            max_dbs=3,
            sync=False,
            metasync=False,
            readahead=False,  # random lookups: kernel readahead would only pollute the page cache
            max_readers=1024,  # one reader slot per concurrent read transaction (many threads)
            mode=0o600,
        )
        try:
            self.blocks_db = env.open_db(b"blocks")
            self.lru_db = env.open_db(b"lru")
            self.meta_db = env.open_db(b"meta")
            with env.begin(write=True, db=self.meta_db) as txn:
                version = txn.get(_META_VERSION)
                if version is None:
                    txn.put(_META_VERSION, FORMAT_VERSION)
                elif version not in (FORMAT_VERSION, LEGACY_FORMAT_VERSION):
                    raise lmdb.InvalidError(
                        f"index format {version!r}, this version reads {FORMAT_VERSION!r} "
                        f"and {LEGACY_FORMAT_VERSION!r}"
                    )
                # Format 1 until TieredBlockCache has upgraded its entries (mark_format_current).
                self.legacy_format = version == LEGACY_FORMAT_VERSION
        except BaseException:
            env.close()
            raise
        return env

    def get(self, raw: bytes) -> bytes | None:
        """The packed entry of a block (hot path: one read transaction, no decoding)."""
        with self._env.begin(db=self.blocks_db) as txn:
            return txn.get(raw)

    @contextmanager
    def write(self) -> Iterator[IndexWriter]:
        """A write transaction, committed when the block ends without an exception. Its
        ``delta`` is what the caller must apply to in-memory counters after the block."""
        with self._env.begin(write=True) as txn:
            writer = IndexWriter(self, txn)
            yield writer
            writer.persist()

    def start_session(self) -> bool:
        """Return whether the previous session closed cleanly, and mark this one as running.

        The flag removal is synced at once: if it were lost in a power loss, a later start would
        trust a clean flag and skip the orphan sweep for blocks written in this session.
        """
        with self._env.begin(write=True, db=self.meta_db) as txn:
            was_clean = txn.pop(_META_CLEAN) is not None
        self._env.sync(True)
        return was_clean

    def end_session(self) -> None:
        """Mark the index clean, sync it and close the environment."""
        with self._env.begin(write=True, db=self.meta_db) as txn:
            txn.put(_META_CLEAN, b"1")
        self._env.sync(True)
        self._env.close()

    def sync(self) -> None:
        self._env.sync(True)

    def close(self) -> None:
        """Close without marking the index clean."""
        self._env.close()

    def tier_records(self) -> dict[str, TierRecord]:
        records = {}
        with self._env.begin(db=self.meta_db) as txn:
            for key, value in _scan_prefix(txn.cursor(), _META_TIER):
                tier_id, instance = _TIER_RECORD.unpack(value)
                records[key[len(_META_TIER) :].decode()] = TierRecord(tier_id, instance.hex())
        return records

    def tier_totals(self, tier_id: int) -> TierTotals:
        with self._env.begin() as txn:
            return _read_tier_totals(txn, self.meta_db, tier_id)

    def source_bytes(self) -> dict[int, int]:
        totals = {}
        with self._env.begin(db=self.meta_db) as txn:
            for key, value in _scan_prefix(txn.cursor(), _META_SOURCE_BYTES):
                source_id = int.from_bytes(key[len(_META_SOURCE_BYTES) :], "big")
                totals[source_id] = _U64.unpack(value)[0]
        return totals

    def shard_bytes(self) -> dict[bytes, int]:
        """Bytes per (source id | shard) prefix, from one scan of the entries (at open only:
        later changes arrive as ``TotalsDelta.shards``)."""
        totals: dict[bytes, int] = {}
        with self._env.begin(db=self.blocks_db) as txn:
            for raw, value in txn.cursor():
                totals[raw[:10]] = totals.get(raw[:10], 0) + Entry.unpack(value).size
        return totals

    def clock(self) -> int:
        with self._env.begin(db=self.meta_db) as txn:
            return self.read_clock(txn)

    def read_clock(self, txn: lmdb.Transaction[bytes]) -> int:
        value = txn.get(_META_CLOCK, db=self.meta_db)
        return 0 if value is None else _U64.unpack(value)[0]
