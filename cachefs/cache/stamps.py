"""The block cache's LRU clock, and what reads record for the index between its writes.

A read must not write the index (an LMDB write transaction per read would serialise every
reader behind one lock): it only records ``key -> stamp`` here, under a lock of its own, and
the records reach the index in batches — with the next admission or eviction (which write the
index anyway), or at least every :data:`FLUSH_INTERVAL_S` from a thread. So do the chunk
checksums that reads compute for entries of index format 1 (``key -> (file id, checksums)``):
until they are written, such a block is verified whole on every read.

No LMDB call is made while the lock is held, so it can never deadlock with LMDB's writer lock.
"""

from __future__ import annotations

import logging
import threading

from cachefs.cache.index import BlockIndex, IndexWriter

log = logging.getLogger(__name__)

#: How often access stamps recorded by reads are written to the index (LRU order).
FLUSH_INTERVAL_S = 1.0


class AccessStamps:
    """The clock (from the index's last stamp on) and the records waiting for an index write.
    :meth:`start` the flushing thread once the cache has opened; :meth:`stop` it at close."""

    def __init__(self, index: BlockIndex):
        self._index = index
        self._lock = threading.Lock()
        self._clock = index.clock()
        self._touched: dict[bytes, int] = {}
        self._chunk_upgrades: dict[bytes, tuple[int, bytes]] = {}
        self._stop = threading.Event()
        self._flusher = threading.Thread(
            target=self._flush_periodically, name="cachefs-cache-stamps", daemon=True
        )

    def next(self) -> int:
        """A new stamp: later than every one given before."""
        with self._lock:
            self._clock += 1
            return self._clock

    def touch(self, raw: bytes) -> None:
        """Block ``raw`` was read now."""
        with self._lock:
            self._clock += 1
            self._touched[raw] = self._clock

    def add_chunk_checksums(self, raw: bytes, file_id: int, chunk_sums: bytes) -> None:
        """Chunk checksums computed for an entry of index format 1, for the next write."""
        with self._lock:
            self._chunk_upgrades[raw] = (file_id, chunk_sums)

    def write(self, writer: IndexWriter) -> None:
        """Hand everything recorded since the last write to ``writer`` (its transaction)."""
        with self._lock:
            touched, self._touched = self._touched, {}
            upgrades, self._chunk_upgrades = self._chunk_upgrades, {}
        for raw, stamp in touched.items():
            writer.restamp(raw, stamp)
        for raw, (file_id, chunk_sums) in upgrades.items():
            writer.add_chunk_checksums(raw, file_id, chunk_sums)

    def flush(self) -> None:
        """Write what was recorded, in a transaction of its own (none if nothing was)."""
        if self._touched or self._chunk_upgrades:
            with self._index.write() as writer:
                self.write(writer)

    def start(self) -> None:
        self._flusher.start()

    def stop(self) -> None:
        """Stop the thread (if it runs) and write what is left."""
        self._stop.set()
        if self._flusher.is_alive():
            self._flusher.join()
        self.flush()

    def _flush_periodically(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL_S):
            try:
                self.flush()
            except Exception:
                log.exception("block cache: writing access stamps failed")
