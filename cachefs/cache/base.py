"""SEAM B — the block-cache interface and block identity.

A *block* is ``[i*B, min((i+1)*B, size))`` of one object version. Its key is 26 bytes:

    source_id (8, big-endian) | shard (2, big-endian) | xxh3_128(object key, etag, i) (16)

so that all blocks of one dataset source are contiguous in the LMDB index (cheap per-dataset
accounting and removal) and, within a source, all blocks of one shard are contiguous (the unit of
placement in the distributed cache). A changed etag gives new keys, so old bytes can never be
served for a new object version.

Implementations are *blocking* and thread-safe: the FUSE core calls RAM-tier ``read`` (and
``locate`` when that finds nothing) inline on the trio loop (they are microseconds), everything
else from worker threads.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import xxhash

from cachefs.protocol import SHARDS

KEY_LEN = 26


def source_id_of(uri: str, endpoint: str | None = None) -> int:
    """Stable 64-bit id of a data source (same source → same cached blocks across re-adds)."""
    return xxhash.xxh3_64_intdigest(f"{uri.rstrip('/')}\0{endpoint or ''}".encode())


def _key_bytes(object_key: str) -> bytes:
    return object_key.encode("utf-8", "surrogateescape")


def key_hash_of(object_key: str) -> int:
    """xxh3_64 of an object key: its shard is this modulo SHARDS."""
    return xxhash.xxh3_64_intdigest(_key_bytes(object_key))


def shard_of(object_key: str) -> int:
    return key_hash_of(object_key) % SHARDS


@dataclass(frozen=True, slots=True)
class BlockKey:
    raw: bytes  # KEY_LEN bytes, see module docstring

    @classmethod
    def make(cls, source_id: int, object_key: str, etag: str, index: int) -> BlockKey:
        kb = _key_bytes(object_key)
        digest = xxhash.xxh3_128_digest(
            len(kb).to_bytes(4, "big")
            + kb
            + b"\0"
            + etag.encode()
            + b"\0"
            + index.to_bytes(8, "big")
        )
        return cls(source_id.to_bytes(8, "big") + shard_of(object_key).to_bytes(2, "big") + digest)

    @property
    def source_id(self) -> int:
        return int.from_bytes(self.raw[:8], "big")

    @property
    def shard(self) -> int:
        return int.from_bytes(self.raw[8:10], "big")

    @property
    def hex(self) -> str:
        return self.raw.hex()


def checksum(data: bytes | memoryview) -> int:
    """The block checksum kept in the index (xxh3_64)."""
    return xxhash.xxh3_64_intdigest(data)


class BlockFile(NamedTuple):
    """A cached block's file as a same-node short-circuit reader needs it: the file, and the
    size and xxh3_64 recorded when the block was admitted, which the reader checks before it
    trusts the bytes (the file may be evicted, or replaced by a new admission, after the
    answer)."""

    path: str
    size: int
    checksum: int


@dataclass(frozen=True, slots=True)
class TierUsage:
    name: str  # "ram" | "ssd"
    path: str
    capacity: int  # bytes; never exceeded
    used: int  # bytes of admitted blocks
    reserve: int  # bytes that eviction never removes
    reserved_used: int  # bytes of blocks currently flagged as reserved
    blocks: int


@dataclass(frozen=True, slots=True)
class CacheCounters:
    admitted: int  # blocks admitted since start
    refused: int  # admissions refused (avoid-eviction full, or too large)
    evicted: int  # blocks evicted by the lru policy
    corrupt: int  # blocks dropped because the checksum/size check failed
    missing: int  # index entries whose file had vanished (dropped)


class BlockCache(Protocol):
    def locate(self, key: BlockKey) -> str | None:
        """Tier name holding the block ("ram"/"ssd"), or None. Index lookup only, no file I/O."""
        ...

    def read(
        self, key: BlockKey, offset: int = 0, length: int = -1, *, tier: str | None = None
    ) -> bytes | None:
        """Bytes ``[offset, offset+length)`` of a cached block (length -1 = to the end), or None
        if the block is not cached. A block that fails verification (size, or xxh3 checksum —
        always checked when the whole block is read, and on the first read of each block in this
        process) is dropped, counted as corrupt, and None is returned: never wrong bytes.

        ``tier``: read the block only if that tier holds it; a block in another tier is None,
        without file I/O. One index lookup for what would otherwise take two, ``locate`` and
        ``read``: how the loop thread reads RAM-tier blocks inline."""
        ...

    def put(self, key: BlockKey, data: bytes) -> str | None:
        """Admit a block. Returns the tier it went to, or None if the admission policy refused it
        (avoid-eviction and full, or larger than any tier). Capacity is never exceeded, even
        transiently, and concurrent puts of one key store it once."""
        ...

    def contains(self, key: BlockKey) -> bool: ...

    def evict(self, key: BlockKey) -> int:
        """Remove one block (ignores the reserve: explicit removal). Returns bytes freed."""
        ...

    def evict_source(self, source_id: int) -> int:
        """Remove every block of one source (dataset removal). Returns bytes freed."""
        ...

    def free_blocks(self, source_id: int, shards: Collection[int] | None = None) -> int:
        """Evict every non-reserved block of one source (of ``shards`` only, if given), from
        all tiers; the reserve stays. Counted as evictions. Returns bytes freed."""
        ...

    def block_path(self, key: BlockKey) -> str | None:
        """Path of the block's file for same-node short-circuit readers, or None."""
        ...

    def block_file(self, key: BlockKey) -> BlockFile | None:
        """The block's file with its admitted size and checksum, or None if not cached."""
        ...

    def usage(self) -> list[TierUsage]: ...

    def counters(self) -> CacheCounters: ...

    def cached_bytes(self, source_id: int) -> int:
        """Bytes of one source currently cached (all tiers)."""
        ...

    def cached_bytes_by_shard(self, source_id: int) -> dict[int, int]:
        """Bytes of one source cached, per shard that has any (what heartbeats report)."""
        ...

    def close(self) -> None:
        """Flush the index (so a restarted worker comes back warm) and release resources."""
        ...
