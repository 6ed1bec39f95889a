"""The "large files" workload: TFRecord-like shards read sequentially and strided.

Every shard is a run of 1 MiB chunks whose bytes follow from ``(seed, shard index, chunk
index)``, so the same plan gives the same bytes on tmpfs, in the store and through any mount,
and a reader can check every MiB it reads against one xxh3 digest per chunk
(:func:`shard_digests`). :func:`measure` times reader threads over a :class:`DirReader` (a
directory: tmpfs or a FUSE mount) or an :class:`S3Reader` (ranged GETs) and fails rather than
report a number that came from wrong or missing bytes. Reads of any size at any offset are
checked; those that cut chunks are checked against digests of the pieces they cover, made from
the generator before the clock starts.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import xxhash

from bench.read_bench import BenchmarkFailure

MiB = 1 << 20
#: The unit of generation and verification: one xxh3 digest per chunk.
CHUNK = MiB
#: Multipart part size of :func:`upload_s3`; one part is all that is ever held in memory.
PART_SIZE = 16 << 20
#: Shard sizes between the smallest and the largest are rounded to this.
SIZE_ALIGN = 4096

PATTERNS = ("sequential", "strided")


@dataclass(frozen=True)
class Shard:
    index: int
    path: str  # relative: under a DirReader's root, or after an S3Reader's prefix
    size: int


def plan_shards(
    count: int, *, min_size: int = 64 * MiB, max_size: int = 256 * MiB, seed: int = 0
) -> list[Shard]:
    """``count`` shards whose sizes span [min_size, max_size]: the first is ``min_size``, the
    last ``max_size`` (when count > 1), the others drawn from ``seed`` in between, rounded to
    4 KiB. The same arguments always give the same plan."""
    if count < 1 or not 0 < min_size <= max_size:
        raise ValueError(f"bad shard plan: {count} shards of {min_size}..{max_size} bytes")
    rng = random.Random(f"large-plan/{seed}")
    sizes = [min_size]
    for _ in range(count - 2):
        drawn = round(rng.uniform(min_size, max_size) / SIZE_ALIGN) * SIZE_ALIGN
        sizes.append(min(max(drawn, min_size), max_size))
    if count > 1:
        sizes.append(max_size)
    return [
        Shard(index, f"shards/train-{index:05d}-of-{count:05d}.tfrecord", size)
        for index, size in enumerate(sizes)
    ]


def chunk_count(shard: Shard) -> int:
    return -(-shard.size // CHUNK)


def shard_chunk(shard: Shard, chunk_index: int, seed: int = 0) -> bytes:
    """The bytes of one chunk (the last one of a shard is short). numpy's PCG64 makes them at
    several hundred MB/s, about twice ``random.randbytes``, so generating 1 GB stays cheap."""
    start = chunk_index * CHUNK
    if not 0 <= start < shard.size:
        raise IndexError(f"{shard.path} has no chunk {chunk_index}")
    generator = np.random.Generator(np.random.PCG64([seed, shard.index, chunk_index]))
    return generator.bytes(min(CHUNK, shard.size - start))


def shard_chunks(shard: Shard, seed: int = 0) -> Iterator[bytes]:
    for chunk_index in range(chunk_count(shard)):
        yield shard_chunk(shard, chunk_index, seed)


class ShardDigests:
    """What every read of a plan's shards is checked against: the xxh3_64 of every chunk, and
    of the pieces of chunks that reads not aligned to chunks cover (made on demand by
    :meth:`cover`, before the clock runs, from the seed the plan's bytes came from)."""

    def __init__(self, shards: Iterable[Shard], seed: int = 0):
        self.seed = seed
        self.chunks = {
            shard.path: [xxhash.xxh3_64_intdigest(chunk) for chunk in shard_chunks(shard, seed)]
            for shard in shards
        }
        self._pieces: dict[tuple[str, int, int], int] = {}

    def cover(self, shard: Shard, reads: Iterable[tuple[int, int]]) -> None:
        """Digest every piece of a chunk that one of ``reads`` ((offset, length) pairs) covers
        only in part. Generating a chunk is far slower than reading it, so this must not happen
        while a read is timed; each needed chunk is generated once."""
        wanted: dict[int, set[tuple[int, int]]] = defaultdict(set)
        for offset, length in reads:
            for start, end in chunk_pieces(offset, offset + length):
                if not _is_whole_chunk(shard, start, end) and (
                    (shard.path, start, end) not in self._pieces
                ):
                    wanted[start // CHUNK].add((start, end))
        for chunk_index, pieces in wanted.items():
            chunk, base = shard_chunk(shard, chunk_index, self.seed), chunk_index * CHUNK
            for start, end in pieces:
                digest = xxhash.xxh3_64_intdigest(chunk[start - base : end - base])
                self._pieces[(shard.path, start, end)] = digest

    def expected(self, shard: Shard, start: int, end: int) -> int:
        """The digest of ``shard``'s bytes [start, end), which lie within one chunk: the whole
        chunk, or a piece :meth:`cover` has digested."""
        if _is_whole_chunk(shard, start, end):
            return self.chunks[shard.path][start // CHUNK]
        return self._pieces[(shard.path, start, end)]


def shard_digests(shards: Iterable[Shard], seed: int = 0) -> ShardDigests:
    """The digests of every chunk of ``shards`` (once per plan: it generates every byte)."""
    return ShardDigests(shards, seed)


def chunk_pieces(start: int, end: int) -> Iterator[tuple[int, int]]:
    """[start, end) split where chunks begin."""
    while start < end:
        piece_end = min((start // CHUNK + 1) * CHUNK, end)
        yield start, piece_end
        start = piece_end


def _is_whole_chunk(shard: Shard, start: int, end: int) -> bool:
    return start % CHUNK == 0 and end == min(start + CHUNK, shard.size)


# --- writing ---------------------------------------------------------------------------------


def write_local(root: str, shards: Iterable[Shard], seed: int = 0) -> int:
    """Write the shards under ``root``; return the bytes written. A shard already there with
    its planned size is kept (use a fresh root after changing the seed); each one is written
    through a ``.partial`` file, so an interrupted run never leaves a short shard behind."""
    written = 0
    for shard in shards:
        path = os.path.join(root, shard.path)
        try:
            if os.stat(path).st_size == shard.size:
                continue
        except FileNotFoundError:
            pass
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.partial"
        with open(temporary, "wb") as out:
            for chunk in shard_chunks(shard, seed):
                out.write(chunk)
        os.replace(temporary, path)
        written += shard.size
    return written


def upload_s3(client, bucket: str, prefix: str, shards: Sequence[Shard], seed: int = 0) -> int:
    """Upload every shard as ``prefix + path`` by multipart upload (16 MiB parts, so a 256 MB
    shard is never held in memory); return the bytes sent. The bucket must exist."""
    for shard in shards:
        _upload_shard(client, bucket, prefix + shard.path, shard, seed)
    return sum(shard.size for shard in shards)


def _upload_shard(client, bucket: str, key: str, shard: Shard, seed: int) -> None:
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    try:
        parts = []
        for number, body in enumerate(_parts(shard, seed), start=1):
            answer = client.upload_part(
                Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
            )
            parts.append({"PartNumber": number, "ETag": answer["ETag"]})
        client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
        )
    except BaseException:
        client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        raise


def _parts(shard: Shard, seed: int) -> Iterator[bytes]:
    chunks_per_part = PART_SIZE // CHUNK
    for first in range(0, chunk_count(shard), chunks_per_part):
        last = min(first + chunks_per_part, chunk_count(shard))
        yield b"".join(shard_chunk(shard, index, seed) for index in range(first, last))


# --- reading ---------------------------------------------------------------------------------
#
# A reader yields (offset, bytes) for each read it makes, one at a time, so that measure()
# checks each block before the next read and the number of reads is the number of requests.

Block = bytes | memoryview


class Reader(Protocol):
    """Where :func:`measure` reads shards from."""

    def sequential(self, shard: Shard, io_size: int) -> Iterator[tuple[int, Block]]:
        """The whole shard in order, ``io_size`` bytes a read."""
        ...

    def at_offsets(
        self, shard: Shard, offsets: Iterable[int], io_size: int
    ) -> Iterator[tuple[int, Block]]:
        """One read of ``io_size`` bytes (fewer at the end of the shard) at each offset."""
        ...


class DirReader:
    """Shards under a directory: tmpfs, or a FUSE mount of the same data."""

    def __init__(self, root: str):
        self.root = root

    def sequential(self, shard: Shard, io_size: int) -> Iterator[tuple[int, memoryview]]:
        """The whole shard in order by plain ``readinto`` calls on one open file, as
        TFRecordDataset reads, so that the kernel's readahead does what it does for training."""
        buffer = bytearray(io_size)
        with open(os.path.join(self.root, shard.path), "rb") as file:
            self._check_size(shard, os.fstat(file.fileno()).st_size)
            # Each read is checked to be whole before the next one, so the offsets hold.
            for offset in range(0, shard.size, io_size):
                got = file.readinto(buffer)
                yield offset, memoryview(buffer)[:got]

    def at_offsets(
        self, shard: Shard, offsets: Iterable[int], io_size: int
    ) -> Iterator[tuple[int, bytes]]:
        """One ``pread`` of ``io_size`` at each offset, all on one open descriptor."""
        fd = os.open(os.path.join(self.root, shard.path), os.O_RDONLY)
        try:
            self._check_size(shard, os.fstat(fd).st_size)
            for offset in offsets:
                yield offset, os.pread(fd, io_size, offset)
        finally:
            os.close(fd)

    @staticmethod
    def _check_size(shard: Shard, size: int) -> None:
        if size != shard.size:
            raise BenchmarkFailure(f"{shard.path}: {size} bytes on disk, {shard.size} planned")


class S3Reader:
    """Shards as objects ``prefix + path`` in a bucket, read by ranged GETs (``client`` is a
    boto3 S3 client; give it a connection pool as large as the reader count)."""

    def __init__(self, client, bucket: str, prefix: str):
        self.client = client
        self.bucket = bucket
        self.prefix = prefix

    def sequential(self, shard: Shard, io_size: int) -> Iterator[tuple[int, bytes]]:
        """Consecutive ranged GETs of ``io_size`` over the whole shard."""
        return self.at_offsets(shard, range(0, shard.size, io_size), io_size)

    def at_offsets(
        self, shard: Shard, offsets: Iterable[int], io_size: int
    ) -> Iterator[tuple[int, bytes]]:
        for offset in offsets:
            last = min(offset + io_size, shard.size) - 1
            answer = self.client.get_object(
                Bucket=self.bucket, Key=self.prefix + shard.path, Range=f"bytes={offset}-{last}"
            )
            yield offset, answer["Body"].read()


# --- measuring -------------------------------------------------------------------------------


def planned_reads(shard: Shard, pattern: str, io_size: int, stride: int) -> list[tuple[int, int]]:
    """(offset, length) of every read a pattern makes of a shard, in order: ``sequential``
    reads it whole, ``io_size`` at a time; ``strided`` reads ``io_size`` every ``stride``
    bytes. Only the end of the shard cuts a read short."""
    step = io_size if pattern == "sequential" else stride
    return [(offset, min(io_size, shard.size - offset)) for offset in range(0, shard.size, step)]


def measure(
    reader: Reader,
    shards: Sequence[Shard],
    digests: ShardDigests,
    *,
    pattern: str,
    readers: int,
    io_size: int = CHUNK,
    stride: int = 8 * CHUNK,
) -> dict:
    """Time ``readers`` threads reading the shards (thread t takes shards t, t + readers, ...)
    in the reads :func:`planned_reads` lists. Every block read is checked against ``digests``
    (a wrong byte or a short read raises BenchmarkFailure, and stops the other threads). The
    clock runs from the moment a barrier releases all threads together until the last one
    ends. Returns pattern, readers, io_size, stride, bytes, seconds, mb_per_s and requests."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {PATTERNS}, not {pattern!r}")
    if readers < 1:
        raise ValueError(f"need at least one reader, not {readers}")
    if io_size <= 0 or stride <= 0:
        raise ValueError(f"io_size and stride must be positive, not {io_size} and {stride}")
    reads = {shard.path: planned_reads(shard, pattern, io_size, stride) for shard in shards}
    for shard in shards:
        digests.cover(shard, reads[shard.path])
    failed = threading.Event()

    def read_one(shard: Shard) -> int:
        if pattern == "sequential":
            blocks = reader.sequential(shard, io_size)
        else:
            blocks = reader.at_offsets(shard, [offset for offset, _ in reads[shard.path]], io_size)
        requests = 0
        for offset, block in blocks:
            verify_block(shard, offset, block, io_size, digests)
            requests += 1
            if failed.is_set():
                break
        return requests

    started: list[float] = []
    barrier = threading.Barrier(readers, action=lambda: started.append(time.perf_counter()))
    ends = [0.0] * readers
    requests = [0] * readers
    errors: list[BaseException] = []

    def run(thread_index: int) -> None:
        try:
            barrier.wait()
            for shard in shards[thread_index::readers]:
                if failed.is_set():
                    break
                requests[thread_index] += read_one(shard)
        except BaseException as error:  # re-raised in the calling thread below
            errors.append(error)
            failed.set()
        finally:
            ends[thread_index] = time.perf_counter()

    threads = [
        threading.Thread(target=run, args=(index,), name=f"large-reader-{index}")
        for index in range(readers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    seconds = max(ends) - started[0]
    # Every read was checked to have exactly its planned length.
    total = sum(length for shard_reads in reads.values() for _, length in shard_reads)
    return {
        "pattern": pattern,
        "readers": readers,
        "io_size": io_size,
        "stride": stride if pattern == "strided" else None,
        "bytes": total,
        "seconds": seconds,
        "mb_per_s": total / seconds / 1e6,
        "requests": sum(requests),
    }


def verify_block(
    shard: Shard, offset: int, block: Block, io_size: int, digests: ShardDigests
) -> None:
    """Check one read of ``io_size`` at ``offset``: its length (only the end of the shard may
    cut it short) and the xxh3 of every chunk, or piece of a chunk, it covers (``digests``
    must have covered the read's pieces: :meth:`ShardDigests.cover`)."""
    expected = min(io_size, shard.size - offset)
    if len(block) != expected:
        raise BenchmarkFailure(
            f"{shard.path}: short read at offset {offset}: {len(block)} of {expected} bytes"
        )
    view = memoryview(block)  # pieces without copies
    for start, end in chunk_pieces(offset, offset + expected):
        piece = view[start - offset : end - offset]
        if xxhash.xxh3_64_intdigest(piece) != digests.expected(shard, start, end):
            raise BenchmarkFailure(
                f"{shard.path}: wrong bytes in the {end - start} bytes at offset {start}"
            )
