"""The large-files workload: shard plans, chunk bytes, writing/uploading and verified reads."""

from __future__ import annotations

import os

import pytest
import xxhash

from bench.read_bench import BenchmarkFailure
from bench.suite import large
from bench.suite.large import CHUNK, DirReader, S3Reader, Shard, ShardDigests
from tests.damage import flip_byte

MiB = 1 << 20
MIN_SIZE = 2 * MiB
MAX_SIZE = 5 * MiB + 8192  # not a whole number of chunks: the last chunk of a shard is short
STRIDE = 2 * MiB  # below the shard sizes, so strided reads make several requests


@pytest.fixture(scope="module")
def shards() -> list[Shard]:
    return large.plan_shards(3, min_size=MIN_SIZE, max_size=MAX_SIZE, seed=1)


@pytest.fixture(scope="module")
def digests(shards) -> ShardDigests:
    return large.shard_digests(shards, seed=1)


@pytest.fixture
def local_root(tmp_path, shards) -> str:
    large.write_local(str(tmp_path), shards, seed=1)
    return str(tmp_path)


def shard_bytes(shard: Shard, seed: int = 1) -> bytes:
    return b"".join(large.shard_chunks(shard, seed))


def expected_reads(shards, pattern: str, io_size: int, stride: int = STRIDE) -> tuple[int, int]:
    """(bytes, requests) of a pattern, from the shard sizes alone."""
    if pattern == "sequential":
        return sum(s.size for s in shards), sum(-(-s.size // io_size) for s in shards)
    offsets = [(s, offset) for s in shards for offset in range(0, s.size, stride)]
    return sum(min(io_size, s.size - offset) for s, offset in offsets), len(offsets)


def test_plan_is_deterministic_and_spans_min_to_max():
    plan = large.plan_shards(6, min_size=MIN_SIZE, max_size=MAX_SIZE, seed=3)
    assert plan == large.plan_shards(6, min_size=MIN_SIZE, max_size=MAX_SIZE, seed=3)
    assert [s.index for s in plan] == list(range(6))
    assert plan[0].path == "shards/train-00000-of-00006.tfrecord"
    assert plan[-1].path == "shards/train-00005-of-00006.tfrecord"
    assert plan[0].size == MIN_SIZE and plan[-1].size == MAX_SIZE
    middle = [s.size for s in plan[1:-1]]
    assert all(MIN_SIZE <= size <= MAX_SIZE and size % 4096 == 0 for size in middle)
    assert len(set(middle)) > 1  # spread, not one size
    other_seed = large.plan_shards(6, min_size=MIN_SIZE, max_size=MAX_SIZE, seed=4)
    assert [s.size for s in other_seed[1:-1]] != middle
    assert large.plan_shards(1, min_size=MIN_SIZE, max_size=MAX_SIZE) == [
        Shard(0, "shards/train-00000-of-00001.tfrecord", MIN_SIZE)
    ]
    with pytest.raises(ValueError):
        large.plan_shards(2, min_size=MAX_SIZE, max_size=MIN_SIZE)


def test_plan_defaults_to_tfrecord_sized_shards():
    plan = large.plan_shards(8)
    assert plan[0].path == "shards/train-00000-of-00008.tfrecord"
    assert (plan[0].size, plan[-1].size) == (64 * MiB, 256 * MiB)
    assert all(64 * MiB <= s.size <= 256 * MiB for s in plan)


def test_chunks_are_deterministic_and_the_last_one_is_short():
    shard = Shard(2, "shards/x", 3 * MiB + 100)
    first = large.shard_chunk(shard, 0, seed=5)
    assert len(first) == CHUNK and first == large.shard_chunk(shard, 0, seed=5)
    assert first != large.shard_chunk(shard, 0, seed=6)
    assert first != large.shard_chunk(shard, 1, seed=5)
    assert first != large.shard_chunk(Shard(3, "shards/x", shard.size), 0, seed=5)
    assert len(large.shard_chunk(shard, 3, seed=5)) == 100
    with pytest.raises(IndexError):
        large.shard_chunk(shard, 4, seed=5)


def test_write_local_writes_the_chunks_once(tmp_path, shards):
    root = str(tmp_path)
    assert large.write_local(root, shards, seed=1) == sum(s.size for s in shards)
    for shard in shards:
        with open(os.path.join(root, shard.path), "rb") as file:
            assert file.read() == shard_bytes(shard)
    assert sorted(os.listdir(os.path.join(root, "shards"))) == sorted(
        os.path.basename(s.path) for s in shards
    )  # no .partial left behind
    assert large.write_local(root, shards, seed=1) == 0  # complete shards are kept


def test_pieces_of_chunks_are_digested_from_the_generated_bytes(shards, digests):
    shard = shards[-1]  # its last chunk is 8192 bytes
    data = shard_bytes(shard)
    reads = [(MiB - 10, 30), (5 * MiB, 8192), (5 * MiB + 100, 50)]
    digests.cover(shard, reads)
    for start, end in [(MiB - 10, MiB), (MiB, MiB + 20), (5 * MiB + 100, 5 * MiB + 150)]:
        assert digests.expected(shard, start, end) == xxhash.xxh3_64_intdigest(data[start:end])
    assert digests.expected(shard, 5 * MiB, 5 * MiB + 8192) == xxhash.xxh3_64_intdigest(
        data[5 * MiB :]
    )  # the whole (short) last chunk: from the chunk digests
    assert list(large.chunk_pieces(MiB - 10, 3 * MiB + 5)) == [
        (MiB - 10, MiB), (MiB, 2 * MiB), (2 * MiB, 3 * MiB), (3 * MiB, 3 * MiB + 5)
    ]  # fmt: skip


@pytest.mark.parametrize("readers", [1, 2])
@pytest.mark.parametrize(
    ("pattern", "io_size", "stride"),
    [
        ("sequential", CHUNK, STRIDE),
        ("sequential", 2 * MiB, STRIDE),
        ("sequential", 3 * MiB // 2 + 1, STRIDE),  # reads that cut chunks
        ("strided", CHUNK, STRIDE),
        ("strided", 300_000, 3 * MiB // 2),
    ],
)
def test_dir_reader_reads_exactly_the_planned_bytes(
    local_root, shards, digests, pattern, io_size, stride, readers
):
    result = large.measure(
        DirReader(local_root), shards, digests,
        pattern=pattern, readers=readers, io_size=io_size, stride=stride,
    )  # fmt: skip
    expected_bytes, expected_requests = expected_reads(shards, pattern, io_size, stride)
    assert (result["bytes"], result["requests"]) == (expected_bytes, expected_requests)
    assert (result["pattern"], result["readers"], result["io_size"]) == (pattern, readers, io_size)
    assert result["seconds"] > 0
    assert result["mb_per_s"] == pytest.approx(expected_bytes / result["seconds"] / 1e6)


@pytest.mark.parametrize("pattern", ["sequential", "strided"])
def test_a_flipped_byte_on_disk_fails_naming_shard_and_offset(local_root, shards, digests, pattern):
    damaged = shards[1]
    flip_byte(os.path.join(local_root, damaged.path), 2 * MiB + 12345)  # both patterns read it
    with pytest.raises(BenchmarkFailure, match=rf"{damaged.path}.* offset {2 * MiB}\b"):
        large.measure(
            DirReader(local_root), shards, digests, pattern=pattern, readers=2, stride=STRIDE
        )


def test_a_flipped_byte_in_a_piece_of_a_chunk_fails(local_root, shards, digests):
    damaged = shards[0]
    flip_byte(os.path.join(local_root, damaged.path), MiB + 5)
    io_size = MiB + 1000  # the second read starts 1000 bytes into the chunk at 1 MiB
    with pytest.raises(BenchmarkFailure, match=rf"{damaged.path}: wrong bytes in the 1000 bytes "
                       rf"at offset {MiB}\b"):  # fmt: skip
        large.measure(
            DirReader(local_root), shards, digests,
            pattern="sequential", readers=1, io_size=io_size,
        )  # fmt: skip


def test_a_truncated_shard_fails(local_root, shards, digests):
    os.truncate(os.path.join(local_root, shards[0].path), shards[0].size - 1)
    with pytest.raises(BenchmarkFailure, match=shards[0].path):
        large.measure(DirReader(local_root), shards, digests, pattern="sequential", readers=1)


def test_short_and_wrong_blocks_are_caught():
    shard = Shard(0, "shards/s", 2 * MiB + 10)
    blocks = [large.shard_chunk(shard, index) for index in range(3)]
    digests = large.shard_digests([shard])
    large.verify_block(shard, 2 * MiB, blocks[2], CHUNK, digests)  # the short last chunk is fine
    with pytest.raises(BenchmarkFailure, match=r"short read at offset 0: 2097151 of 2097152 bytes"):
        large.verify_block(shard, 0, (blocks[0] + blocks[1])[:-1], 2 * MiB, digests)
    with pytest.raises(BenchmarkFailure, match=r"wrong bytes .* offset 1048576"):
        large.verify_block(shard, 0, blocks[0] + blocks[0], 2 * MiB, digests)


def test_s3_upload_and_ranged_reads(moto_s3, shards, digests, monkeypatch):
    monkeypatch.setattr(large, "PART_SIZE", 5 * MiB)  # moto's smallest part: the big shard has 2
    client = moto_s3.client()
    bucket = moto_s3.make_bucket()
    assert large.upload_s3(client, bucket, "large/", shards, seed=1) == sum(s.size for s in shards)
    for shard in shards:
        stored = client.get_object(Bucket=bucket, Key=f"large/{shard.path}")
        assert stored["Body"].read() == shard_bytes(shard)
    assert client.head_object(Bucket=bucket, Key=f"large/{shards[-1].path}")["ETag"].endswith(
        '-2"'
    )  # a multipart object of two parts
    reader = S3Reader(client, bucket, "large/")
    for pattern, io_size in (
        ("sequential", 2 * MiB),
        ("sequential", 3_000_000),
        ("strided", CHUNK),
    ):
        result = large.measure(
            reader, shards, digests, pattern=pattern, readers=2, io_size=io_size, stride=STRIDE
        )
        assert (result["bytes"], result["requests"]) == expected_reads(shards, pattern, io_size)


def test_s3_reader_fails_on_other_bytes(moto_s3, shards, digests):
    client = moto_s3.client()
    bucket = moto_s3.make_bucket()
    large.upload_s3(client, bucket, "large/", shards, seed=2)  # not the digests' seed
    with pytest.raises(BenchmarkFailure, match=r"wrong bytes .* offset 0\b"):
        large.measure(S3Reader(client, bucket, "large/"), shards, digests,
                      pattern="strided", readers=2, stride=STRIDE)  # fmt: skip


@pytest.mark.parametrize(
    "arguments",
    [
        {"io_size": 0},
        {"stride": -MiB},
        {"pattern": "random"},
        {"readers": 0},
    ],
)
def test_bad_arguments_are_refused(tmp_path, shards, digests, arguments):
    options = {"pattern": "sequential", "readers": 1, **arguments}
    with pytest.raises(ValueError):
        large.measure(DirReader(str(tmp_path)), shards, digests, **options)
