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

from collections.abc import Callable, Collection, Sequence
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


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The whole-block checksum kept in the index (xxh3_64): what same-node short-circuit
    readers check (:class:`BlockFile`). The cache itself checks :func:`chunk_checksums`."""
    return xxhash.xxh3_64_intdigest(data)


#: Bytes per checksummed chunk of a block. Every read of a cached block verifies each chunk it
#: touches, so a chunk the size of one FUSE read (128 KiB, the kernel's usual max_read) keeps
#: what an aligned read hashes to what it returns. The index stores checksums of chunks of this
#: size: changing it needs a new index format (``index.py``); peers send theirs with each block.
CHUNK_SIZE = 128 << 10
#: Bytes of one chunk checksum (an xxh3_64 digest, big-endian).
CHUNK_CHECKSUM_LEN = 8


def chunk_count(size: int, chunk_size: int = CHUNK_SIZE) -> int:
    """Chunks of a ``size``-byte block: the last one may be shorter; an empty block has one."""
    return max(1, -(-size // chunk_size))


def chunk_checksums(data: bytes | bytearray | memoryview, chunk_size: int = CHUNK_SIZE) -> bytes:
    """The xxh3_64 of every ``chunk_size`` chunk of a whole block, as concatenated 8-byte
    big-endian digests (:data:`CHUNK_CHECKSUM_LEN` bytes per chunk)."""
    view = memoryview(data)
    if len(view) <= chunk_size:
        return xxhash.xxh3_64_digest(view)
    return b"".join(
        xxhash.xxh3_64_digest(view[start : start + chunk_size])
        for start in range(0, len(view), chunk_size)
    )


def block_checksums(data: bytes | bytearray | memoryview) -> tuple[int, bytes]:
    """(:func:`checksum`, :func:`chunk_checksums`) of a whole block. A block of one chunk is
    hashed once: its only chunk checksum is the whole block's xxh3_64 (big-endian)."""
    if len(data) <= CHUNK_SIZE:
        digest = xxhash.xxh3_64_digest(data)
        return int.from_bytes(digest, "big"), digest
    return checksum(data), chunk_checksums(data)


def first_bad_chunk(
    data: bytes | memoryview, checksums: bytes, first_chunk: int = 0, chunk_size: int = CHUNK_SIZE
) -> int | None:
    """The index (in its block) of the first chunk of ``data`` whose xxh3_64 is not the one in
    ``checksums`` (a block's :func:`chunk_checksums`), or None if every chunk matches.

    ``data`` is chunks ``first_chunk, first_chunk + 1, ...`` of the block: it starts on a chunk
    boundary and holds whole chunks, except that the block's last chunk may be shorter."""
    at = first_chunk * CHUNK_CHECKSUM_LEN
    if len(data) <= chunk_size:  # one chunk: what an aligned read of CHUNK_SIZE touches
        expected = checksums[at : at + CHUNK_CHECKSUM_LEN]
        return None if xxhash.xxh3_64_digest(data) == expected else first_chunk
    view = memoryview(data)
    for start in range(0, len(view), chunk_size):
        expected = checksums[at : at + CHUNK_CHECKSUM_LEN]
        if xxhash.xxh3_64_digest(view[start : start + chunk_size]) != expected:
            return first_chunk + start // chunk_size
        at += CHUNK_CHECKSUM_LEN
    return None


class CheckedBlock(NamedTuple):
    """A whole block with its :func:`chunk_checksums`: for a cached block, those recorded when it
    was admitted (which its bytes were just verified against), so that whoever receives the
    block from this node checks it against what was admitted, not against what was read."""

    data: bytes
    chunk_checksums: bytes

    @classmethod
    def of(cls, data: bytes) -> CheckedBlock:
        """A block that is not cached (just fetched): its checksums are computed from the
        fetched bytes, as its admission computes them."""
        return cls(data, chunk_checksums(data))


class OpenBlock(NamedTuple):
    """A whole cached block as an open file of its own, just verified, for sending without
    copying it through Python (``os.sendfile``): the descriptor (the receiver closes it), the
    block's size and the chunk checksums recorded at its admission (what the peer that asked
    checks the bytes it receives against, as for a :class:`CheckedBlock`)."""

    fd: int
    size: int
    chunk_checksums: bytes


class BlockFile(NamedTuple):
    """A cached block's file as a same-node short-circuit reader needs it: the file, and the
    size and xxh3_64 recorded when the block was admitted, which the reader checks before it
    trusts the bytes (the file may be evicted, or replaced by a new admission, after the
    answer)."""

    path: str
    size: int
    checksum: int


class ChunkedBlockFile(NamedTuple):
    """A cached block's file as the native READ path needs it (cachefs/fs/native_reads.py): the
    file, its admitted size, the chunk checksums to check every chunk it serves against, the id
    that names this admission of the block (what :meth:`BlockCache.on_remove` passes), and,
    if still known, the file's (st_ino, st_ctime_ns) right after the cache wrote it from the
    bytes it computed the checksums from (``Tier.written_state``; None for a file another
    process wrote): while the file is in that state it holds those bytes."""

    path: str
    size: int
    file_id: int
    chunk_checksums: bytes
    written_state: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class TierUsage:
    name: str  # "ram" | "ssd"
    path: str
    capacity: int  # bytes; never exceeded
    used: int  # bytes of capacity taken by admitted blocks: sizes rounded up as ``du`` counts them
    reserve: int  # bytes that eviction never removes
    reserved_used: int  # of ``used``: blocks currently flagged as reserved
    blocks: int


@dataclass(frozen=True, slots=True)
class CacheCounters:
    admitted: int  # blocks admitted since start
    refused: int  # admissions refused (avoid-eviction full, or too large)
    evicted: int  # blocks evicted by the lru policy
    corrupt: int  # blocks dropped because the checksum/size check failed
    missing: int  # index entries whose file had vanished (dropped)


@dataclass(frozen=True, slots=True)
class Reservation:
    """Room claimed in a tier for one block that another process writes (the preload's fetcher
    processes): it writes the block's bytes to ``path`` — a new file, mode 0600 — and computes
    their checksums; the cache then admits that file (``admit_written``) or gives the room back
    (``abandon``). Until one of them, the room counts as taken."""

    raw: bytes  # the block's key
    tier: str
    path: str  # in the tier's tmp directory: renamed into place on admission
    size: int
    footprint: int


class BlockCache(Protocol):
    def locate(self, key: BlockKey) -> str | None:
        """Tier name holding the block ("ram"/"ssd"), or None. Index lookup only, no file I/O."""
        ...

    def read(
        self, key: BlockKey, offset: int = 0, length: int = -1, *, tier: str | None = None
    ) -> bytes | None:
        """Bytes ``[offset, offset+length)`` of a cached block (length -1 = to the end), or None
        if the block is not cached. Every read verifies the block's size and the xxh3_64 of each
        :data:`CHUNK_SIZE` chunk it touches against those recorded at admission, on every tier,
        every time. A block that fails is dropped, counted as corrupt, and None is returned (the
        caller fetches it again): never wrong bytes.

        ``tier``: read the block only if that tier holds it; a block in another tier is None,
        without file I/O. One index lookup for what would otherwise take two, ``locate`` and
        ``read``: how the loop thread reads RAM-tier blocks inline."""
        ...

    def read_with_checksums(self, key: BlockKey, *, tier: str | None = None) -> CheckedBlock | None:
        """The whole block, verified as :meth:`read` does, with the chunk checksums recorded at
        its admission (what a peer that asked for the block checks it against)."""
        ...

    def open_verified(
        self, key: BlockKey, *, tier: str | None = None
    ) -> OpenBlock | CheckedBlock | None:
        """The whole block, verified as :meth:`read` does, as an :class:`OpenBlock` (a
        descriptor of its own, to send from) where it can be, else as :meth:`read_with_checksums`
        gives it; None if it is not cached (or was dropped as corrupt)."""
        ...

    def put(self, key: BlockKey, data: bytes) -> str | None:
        """Admit a block. Returns the tier it went to, or None if the admission policy refused it
        (avoid-eviction and full, or larger than any tier). Capacity is never exceeded, even
        transiently, and concurrent puts of one key store it once."""
        ...

    def reserve(self, key: BlockKey, size: int) -> Reservation | None:
        """Claim room for a ``size``-byte block to be written to ``Reservation.path`` by someone
        else; None if the admission policy refuses it (as :meth:`put` would)."""
        ...

    def admit_written(
        self, reservation: Reservation, block_checksum: int, chunk_sums: bytes
    ) -> str | None:
        """Admit the block file written for ``reservation``, with the checksums of the bytes
        written (:func:`checksum`, :func:`chunk_checksums`): the tier it went to, or None if its
        file is missing or has the wrong size (the room is given back). Idempotent like put."""
        ...

    def admit_written_many(
        self, written: Sequence[tuple[Reservation, int, bytes]]
    ) -> list[str | None]:
        """:meth:`admit_written` for several blocks (reservation, checksum, chunk checksums),
        indexed in one transaction: the tier each went to, or None."""
        ...

    def abandon(self, reservation: Reservation) -> None:
        """Give the room of ``reservation`` back and remove its file if one was written."""
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

    def chunked_block_file(self, key: BlockKey, *, tier: str) -> ChunkedBlockFile | None:
        """The block's file with its chunk checksums if ``tier`` holds it (one index lookup, no
        file I/O, not an access for the LRU order), else None."""
        ...

    def on_remove(self, hook: Callable[[int], None] | None) -> None:
        """Call ``hook(file_id)`` before any block file is removed (evicted, dropped, moved by a
        promotion), from whichever thread removes it: a native reader holding the block's path
        forgets it there, so that the file's space is released when it is unlinked."""
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
