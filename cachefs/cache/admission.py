"""How blocks get into the TieredBlockCache: room claimed, the file written, the index entry.

:class:`Admission` is the admission half of :class:`~cachefs.cache.tiered.TieredBlockCache`
(which owns the state it declares below, and the reads, removal and bookkeeping). Two ways in:

- :meth:`Admission.put`: the caller hands the bytes; the block file is written here.
- :meth:`Admission.reserve`, then :meth:`Admission.admit_written` (or
  :meth:`Admission.abandon`): another process — a preload fetcher — writes the file into the
  reservation and hands back the checksums of the bytes it wrote, so a block's bytes never
  pass through the worker process (cachefs/cluster/pipeline.py).

Either way, capacity is never exceeded, even transiently: room is claimed in memory
(``pending``) before the file is written, and turned into ``used`` when the entry is committed;
one thread at a time stores a given key (``_in_flight``), and a second admission of a cached key
changes nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import NamedTuple

from cachefs.cache.base import BlockKey, Reservation, block_checksums
from cachefs.cache.index import BlockIndex, Entry, IndexWriter, TotalsDelta
from cachefs.cache.stamps import AccessStamps
from cachefs.cache.tier import Tier, unlink_if_present
from cachefs.errors import CachefsError

log = logging.getLogger("cachefs.cache.tiered")


class CacheClosed(CachefsError):
    """The cache was used after close()."""


# Eviction makes room and then claims it; a concurrent put may take the room in between.
_MAKE_ROOM_ATTEMPTS = 3


class _Placed(NamedTuple):
    """A block whose file is in place in its tier, about to be indexed."""

    raw: bytes
    tier: Tier
    size: int
    footprint: int
    checksum: int
    chunk_sums: bytes
    file_id: int


class Admission:
    """The admission methods of TieredBlockCache (see the module docstring)."""

    # The cache's state (set up by TieredBlockCache.__init__; counters and ``pending`` change
    # only under ``_lock``).
    _lock: threading.Lock
    _nothing_in_flight: threading.Condition
    _in_flight: dict[bytes, threading.Event | None]  # an event once another thread waits
    _closed: bool
    _index_dir: str
    _index: BlockIndex
    _stamps: AccessStamps
    _tiers: list[Tier]
    _tier_by_id: dict[int, Tier]
    _tier_by_name: dict[str, Tier]
    _evict_when_full: bool
    _admitted: int
    _refused: int

    # What admission uses of the rest of the cache (tiered.py).
    def locate(self, key: BlockKey) -> str | None:
        raise NotImplementedError

    def _check_open(self) -> None:
        raise NotImplementedError

    def _evict_oldest(self, tier: Tier, nbytes: int, source_id: int | None = None) -> int:
        raise NotImplementedError

    def _apply(self, delta: TotalsDelta) -> None:
        raise NotImplementedError

    def put(self, key: BlockKey, data: bytes) -> str | None:
        raw = key.raw
        other_writer = self._claim(raw)
        if other_writer is not None:  # the same block is being stored by another thread
            other_writer.wait()
            return self.locate(key)
        try:
            value = self._index.get(raw)
            if value is not None:  # already cached: a put is idempotent
                return self._tier_by_id[value[0]].name
            tier = self._room_for(len(data))
            if tier is None:
                return None
            footprint = tier.footprint(len(data))
            # From the bytes being admitted, not from the file: every later read is checked
            # against what was handed to put().
            block_checksum, chunk_sums = block_checksums(data)
            file_id = self._stamps.next()
            try:
                tier.write_block(raw, file_id, data)
            except OSError as exc:
                self._give_back(tier, footprint)
                log.warning("cache tier %r: could not write block %s: %s",
                            tier.name, raw.hex(), exc)  # fmt: skip
                return None
            self._commit([_Placed(raw, tier, len(data), footprint, block_checksum, chunk_sums,
                                  file_id)])  # fmt: skip
            return tier.name
        finally:
            self._release_claim(raw)

    def _claim(self, raw: bytes) -> threading.Event | None:
        """Become the one thread storing or moving ``raw`` (returns None), or get the event
        the thread that already is sets when it is done. The event is made only when a second
        thread asks: almost every claim has none waiting, and an Event (a Condition and its
        lock) per admitted block was a visible part of the preload's admission CPU."""
        with self._lock:
            if self._closed:
                raise CacheClosed(f"block cache {self._index_dir} is closed")
            if raw not in self._in_flight:
                self._in_flight[raw] = None
                return None
            other_writer = self._in_flight[raw]
            if other_writer is None:
                other_writer = self._in_flight[raw] = threading.Event()
            return other_writer

    def _release_claim(self, raw: bytes) -> None:
        with self._lock:
            waiting = self._in_flight.pop(raw)
            if waiting is not None:
                waiting.set()
            if not self._in_flight:
                self._nothing_in_flight.notify_all()

    def _room_for(self, size: int) -> Tier | None:
        """Claim the footprint of a ``size``-byte block in a tier, as the admission policy says
        (evicting under lru); None (counted as refused) if there is no room."""
        tier = self._claim_free_room(self._tiers, size)
        if tier is None and self._evict_when_full:
            tier = self._make_room(size)
        if tier is None:
            with self._lock:
                self._refused += 1
        return tier

    def _give_back(self, tier: Tier, footprint: int) -> None:
        with self._lock:
            tier.pending -= footprint

    def _commit(self, placed: Sequence[_Placed]) -> None:
        """Index blocks whose files are in place, in one transaction, turning their claimed
        room into used room; on failure their files go and their room is given back."""
        try:
            with self._index.write() as writer:
                self._stamps.write(writer)
                for block in placed:
                    entry = Entry(
                        tier_id=block.tier.tier_id,
                        reserved=self._reserved_on_admission(writer, block.tier, block.footprint),
                        size=block.size,
                        footprint=block.footprint,
                        checksum=block.checksum,
                        stamp=self._stamps.next(),
                        file_id=block.file_id,
                        chunk_checksums=block.chunk_sums,
                    )
                    writer.insert(block.raw, entry)
        except BaseException:
            for block in placed:
                block.tier.remove_block(block.raw, block.file_id)
                self._give_back(block.tier, block.footprint)
            raise
        with self._lock:
            for block in placed:
                block.tier.pending -= block.footprint
            self._apply(writer.delta)
            self._admitted += len(placed)

    # --- admission of blocks written by another process ------------------------------------------

    def reserve(self, key: BlockKey, size: int) -> Reservation | None:
        self._check_open()
        tier = self._room_for(size)
        if tier is None:
            return None
        raw = key.raw
        return Reservation(raw, tier.name, tier.tmp_path(raw), size, tier.footprint(size))

    def admit_written(
        self, reservation: Reservation, block_checksum: int, chunk_sums: bytes
    ) -> str | None:
        return self.admit_written_many([(reservation, block_checksum, chunk_sums)])[0]

    def admit_written_many(
        self, written: Sequence[tuple[Reservation, int, bytes]]
    ) -> list[str | None]:
        """:meth:`admit_written` for several blocks (reservation, checksum, chunk checksums),
        their index entries committed in one transaction: the tier each went to, or None."""
        results: list[str | None] = [None] * len(written)
        claimed: dict[bytes, int] = {}  # key -> its place in ``written``: stored by this call
        duplicates: list[tuple[int, bytes]] = []  # a key twice in the batch: the first stands
        # Keys another thread is storing: waited for once this call's own claims are released
        # (waiting while holding them could deadlock with a batch that waits for one of ours).
        stored_elsewhere: list[tuple[int, bytes, threading.Event]] = []
        placed: list[_Placed] = []
        try:
            for place, (reservation, block_checksum, chunk_sums) in enumerate(written):
                raw, tier = reservation.raw, self._tier_by_name[reservation.tier]
                if raw in claimed:
                    self.abandon(reservation)
                    duplicates.append((place, raw))
                    continue
                other_writer = self._claim(raw)
                if other_writer is not None:  # the same block is being stored by another thread
                    self.abandon(reservation)
                    stored_elsewhere.append((place, raw, other_writer))
                    continue
                claimed[raw] = place
                value = self._index.get(raw)
                if value is not None:  # cached meanwhile: the first admission stands
                    self.abandon(reservation)
                    results[place] = self._tier_by_id[value[0]].name
                    continue
                try:  # what the writer left must be the whole block, nothing else
                    if os.lstat(reservation.path).st_size != reservation.size:
                        raise OSError(f"{reservation.path} is not a {reservation.size}-byte file")
                    file_id = self._stamps.next()
                    tier.place_block(reservation.path, raw, file_id)
                except OSError as exc:
                    self.abandon(reservation)
                    log.warning("cache tier %r: written block %s not admitted: %s",
                                tier.name, raw.hex(), exc)  # fmt: skip
                    continue
                size, footprint = reservation.size, reservation.footprint
                placed.append(
                    _Placed(raw, tier, size, footprint, block_checksum, chunk_sums, file_id)
                )
            if placed:
                self._commit(placed)
                for block in placed:
                    results[claimed[block.raw]] = block.tier.name
            for place, raw in duplicates:
                results[place] = results[claimed[raw]]
        finally:
            for raw in claimed:
                self._release_claim(raw)
        for place, raw, other_writer in stored_elsewhere:
            other_writer.wait()
            results[place] = self.locate(BlockKey(raw))
        return results

    def abandon(self, reservation: Reservation) -> None:
        unlink_if_present(reservation.path)
        self._give_back(self._tier_by_name[reservation.tier], reservation.footprint)

    @staticmethod
    def _reserved_on_admission(writer: IndexWriter, tier: Tier, footprint: int) -> bool:
        """The first ``reserve`` bytes admitted to a tier are flagged reserved (never evicted)."""
        reserved_used = writer.tier_totals(tier.tier_id).reserved_used
        return tier.reserve > 0 and reserved_used + footprint <= tier.reserve

    def _claim_free_room(self, tiers: list[Tier], size: int) -> Tier | None:
        """Claim the footprint of a ``size``-byte block in the first of ``tiers`` that has it
        free (give it back as ``tier.footprint(size)``)."""
        with self._lock:
            for tier in tiers:
                footprint = tier.footprint(size)
                if tier.free() >= footprint:
                    tier.pending += footprint
                    return tier
        return None

    def _make_room(self, size: int) -> Tier | None:
        """lru policy: evict from the first tier where evicting can make room, and claim it."""
        for tier in self._tiers:
            footprint = tier.footprint(size)
            for _attempt in range(_MAKE_ROOM_ATTEMPTS):
                with self._lock:
                    if tier.free() >= footprint:
                        tier.pending += footprint
                        return tier
                    shortfall = footprint - tier.free()
                    # Even evicting every non-reserved block would not free enough.
                    if tier.capacity - tier.reserved_used - tier.pending < footprint:
                        break
                if self._evict_oldest(tier, shortfall) == 0:
                    break
        return None
