"""The native kernels (tf_dataset/native) against their Python reference and TensorFlow's own
TFRecord reader, on plain files: block files and a "mount" directory in tmp_path (the kernels
read paths; what serves them does not matter to them). No worker needed."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import xxhash

tf = pytest.importorskip("tensorflow")  # a guard only: CI installs the [tf] extra

from tf_dataset import native  # noqa: E402
from tf_dataset.reader import read_chunk  # noqa: E402

BLOCK = 1000


@pytest.fixture(scope="module")
def ops():
    return native.load()  # built by scripts/setup.sh; a missing build fails here, loudly


class Chunk:
    """A chunk of files laid out as the kernel takes it: the files under ``root`` (the
    "mount"), and their blocks as separate files with their xxh3_64."""

    def __init__(self, root, contents: list[bytes], local: list[bool]):
        self.root = str(root)
        self.contents = contents
        self.names, self.splits, self.files, self.lengths, self.sums = [], [0], [], [], []
        for number, (data, here) in enumerate(zip(contents, local, strict=True)):
            name = f"dir/f{number}.bin"
            os.makedirs(os.path.join(self.root, "dir"), exist_ok=True)
            with open(os.path.join(self.root, name), "wb") as f:
                f.write(data)
            self.names.append(name)
            if here:
                for start in range(0, len(data), BLOCK):
                    part = data[start : start + BLOCK]
                    block = os.path.join(self.root, f"block-{number}-{start}")
                    with open(block, "wb") as f:
                        f.write(part + b"bytes past the length are never read")
                    self.files.append(block)
                    self.lengths.append(len(part))
                    self.sums.append(xxhash.xxh3_64_intdigest(part))
            self.splits.append(len(self.files))
        self.local = local

    def args(self):
        return (
            self.root.encode(),
            np.array([name.encode() for name in self.names], dtype=object),
            np.array(self.local, dtype=bool),
            np.array(self.splits, dtype=np.int64),
            np.array([file.encode() for file in self.files], dtype=object),
            np.array(self.lengths, dtype=np.int64),
            np.array(self.sums, dtype=np.uint64).view(np.int64),
        )

    def native(self, ops):
        contents, fell_back = ops.cachefs_read_files(*self.args())
        return list(contents.numpy()), list(fell_back.numpy())

    def python(self):
        return read_chunk(*self.args())


def sample_contents(seed: int = 3) -> list[bytes]:
    rng = random.Random(seed)
    sizes = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 17, 70_000]
    return [rng.randbytes(size) for size in sizes]


def test_both_engines_read_cached_and_uncached_files_byte_exact(ops, tmp_path):
    contents = sample_contents()
    chunk = Chunk(tmp_path, contents, [True, False] * 3 + [True])
    for got, fell_back in (chunk.native(ops), chunk.python()):
        assert got == contents
        assert not any(fell_back)


def test_both_engines_fall_back_to_the_mount_for_each_kind_of_bad_block(ops, tmp_path):
    contents = sample_contents()
    chunk = Chunk(tmp_path, contents, [True] * len(contents))
    first_block = {name: chunk.files[chunk.splits[i]] for i, name in enumerate(chunk.names)}
    os.unlink(first_block["dir/f1.bin"])  # evicted
    os.truncate(first_block["dir/f2.bin"], 10)  # short
    with open(chunk.files[chunk.splits[5] + 3], "r+b") as f:  # a later block, one bit off
        f.write(b"\x01")
    chunk.sums[chunk.splits[6]] ^= 1 << 63  # the checksum's top bit: signed int64 handling
    expected_fallbacks = [False, True, True, False, False, True, True]
    for got, fell_back in (chunk.native(ops), chunk.python()):
        assert got == contents  # the mount copy of each file, whole
        assert list(fell_back) == expected_fallbacks


def test_a_missing_file_under_the_mount_is_an_error_in_both_engines(ops, tmp_path):
    chunk = Chunk(tmp_path, [b"x"], [False])
    os.unlink(os.path.join(chunk.root, chunk.names[0]))
    with pytest.raises(tf.errors.NotFoundError, match="No such file"):
        chunk.native(ops)
    with pytest.raises(FileNotFoundError):
        chunk.python()


def test_a_nul_byte_never_opens_the_file_before_it(ops, tmp_path):
    """open() would stop at a NUL: "dir/f0.bin\\0x" would read dir/f0.bin, another file."""
    chunk = Chunk(tmp_path, [b"not yours"], [True])
    root, names, local, splits, files, lengths, sums = chunk.args()
    hostile_names = np.array([names[0] + b"\0x"], dtype=object)
    with pytest.raises(tf.errors.InvalidArgumentError, match="NUL"):
        ops.cachefs_read_files(root, hostile_names, np.array([False]), splits, files, lengths, sums)
    with pytest.raises(ValueError, match="null"):
        read_chunk(root, hostile_names, [False], splits, files, lengths, sums)
    # A block file name with a NUL is a failed block: the file is read through the mount.
    hostile_files = np.array([files[0] + b"\0x"], dtype=object)
    contents, fell_back = ops.cachefs_read_files(
        root, names, local, splits, hostile_files, lengths, sums
    )
    assert list(contents.numpy()) == [b"not yours"] and list(fell_back.numpy()) == [True]


def test_the_kernel_refuses_inconsistent_arguments(ops, tmp_path):
    chunk = Chunk(tmp_path, [b"abc", b"defg"], [True, True])
    root, names, local, splits, files, lengths, sums = chunk.args()
    bad = [
        (root, names, local[:1], splits, files, lengths, sums),  # local shorter than names
        (root, names, local, splits[:2], files, lengths, sums),  # one split short
        (root, names, local, np.array([0, 2, 1]), files, lengths, sums),  # decreasing
        (root, names, local, np.array([1, 1, 2]), files, lengths, sums),  # not from 0
        (root, names, local, splits, files, lengths[:1], sums),  # columns of two lengths
        (root, names, local, splits, files, np.array([3, -1]), sums),  # a negative length
    ]
    for args in bad:
        with pytest.raises(tf.errors.InvalidArgumentError):
            ops.cachefs_read_files(*args)


def write_tfrecords(path, records: list[bytes]) -> bytes:
    with tf.io.TFRecordWriter(str(path)) as writer:
        for record in records:
            writer.write(record)
    with open(path, "rb") as f:
        return f.read()


def blocks_of(tmp_path, data: bytes, size: int):
    files, lengths, sums = [], [], []
    for start in range(0, len(data), size):
        part = data[start : start + size]
        block = tmp_path / f"shard-block-{start}"
        block.write_bytes(part)
        files.append(str(block).encode())
        lengths.append(len(part))
        sums.append(xxhash.xxh3_64_intdigest(part))
    return (
        np.array(files, dtype=object),
        np.array(lengths, dtype=np.int64),
        np.array(sums, dtype=np.uint64).view(np.int64),
    )


def records_by_blocks(ops, files, lengths, sums, shard: str):
    """Step the block kernel over a shard as the pipeline does, carrying the incomplete record
    on. Returns the records given and the number of the first block that failed (or None)."""
    carry, offset, given = b"", 0, []
    for number in range(len(files)):
        last = number == len(files) - 1
        records, carry, offset, ok = ops.cachefs_read_tf_record_block(
            carry, offset, files[number], lengths[number], sums[number], last, shard
        )
        if not bool(ok):
            assert records.shape == (0,)
            return given, number
        given += list(records.numpy())
    return given, None


@pytest.mark.parametrize("block_size", [7, 1000, 1 << 20])
def test_tfrecords_from_blocks_are_the_records_tensorflow_reads(ops, tmp_path, block_size):
    rng = random.Random(block_size)
    records = [rng.randbytes(rng.choice([0, 1, 11, 999, 5000])) for _ in range(60)]
    shard = tmp_path / "shard.tfrecord"
    data = write_tfrecords(shard, records)
    got, failed = records_by_blocks(ops, *blocks_of(tmp_path, data, block_size), str(shard))
    assert failed is None
    tensorflow_reads = list(tf.data.TFRecordDataset(str(shard)).as_numpy_iterator())
    assert got == records == tensorflow_reads


def test_a_bad_block_gives_no_records_and_keeps_the_carry(ops, tmp_path):
    records = [bytes([n]) * 300 for n in range(30)]
    data = write_tfrecords(tmp_path / "s.tfrecord", records)
    files, lengths, sums = blocks_of(tmp_path, data, 512)
    os.truncate(files[2], 3)
    got, failed = records_by_blocks(ops, files, lengths, sums, "s")
    assert failed == 2
    assert got == records[: len(got)] and len(got) == (2 * 512) // (300 + 16)  # whole ones only
    # The failed step hands back the carry and offset it was given, unchanged.
    carry, offset = b"partial", 1234
    out, next_carry, next_offset, ok = ops.cachefs_read_tf_record_block(
        carry, offset, files[2], lengths[2], sums[2], False, "s"
    )
    assert (bool(ok), next_carry.numpy(), int(next_offset), out.shape) == (
        False,
        carry,
        offset,
        (0,),
    )


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda data: data[:4] + bytes([data[4] ^ 1]) + data[5:], "length checksum"),
        (lambda data: data[:20] + bytes([data[20] ^ 1]) + data[21:], "data checksum"),
        (lambda data: data[:-2], "truncated record"),
    ],
)
def test_a_corrupt_shard_is_data_loss_as_with_tensorflows_reader(ops, tmp_path, damage, message):
    """The blocks verify (their checksums are of the damaged bytes): the shard itself is bad, and
    both readers say so the same way."""
    shard = tmp_path / "bad.tfrecord"
    data = damage(write_tfrecords(shard, [b"x" * 40, b"y" * 40]))
    shard.write_bytes(data)
    with pytest.raises(tf.errors.DataLossError, match=message):
        records_by_blocks(ops, *blocks_of(tmp_path, data, 16), "bad.tfrecord")
    with pytest.raises(tf.errors.DataLossError):
        list(tf.data.TFRecordDataset(str(shard)).as_numpy_iterator())


def test_the_block_kernel_refuses_bad_arguments(ops, tmp_path):
    data = write_tfrecords(tmp_path / "s.tfrecord", [b"r"])
    files, lengths, sums = blocks_of(tmp_path, data, 1 << 20)
    with pytest.raises(tf.errors.InvalidArgumentError, match="scalar"):
        ops.cachefs_read_tf_record_block(b"", 0, files, lengths, sums, True, "s")  # vectors
    with pytest.raises(tf.errors.InvalidArgumentError, match="negative"):
        ops.cachefs_read_tf_record_block(b"", 0, files[0], -1, sums[0], True, "s")


def test_the_library_name_follows_the_source_and_tensorflow(monkeypatch, tmp_path):
    built = native.library_path()
    assert tf.__version__ in os.path.basename(built)
    assert native.library_path("0.0.1") != built
    changed = tmp_path / "cachefs_ops.cc"
    with open(native.SOURCE, "rb") as f:
        changed.write_bytes(f.read() + b"\n// changed\n")
    monkeypatch.setattr(native, "SOURCE", str(changed))
    assert os.path.basename(native.library_path()) != os.path.basename(built)


def test_a_failed_build_says_so_and_leaves_no_library(monkeypatch, tmp_path, capsys):
    target = tmp_path / "_cachefs_ops-test.so"
    monkeypatch.setattr(native, "library_path", lambda: str(target))
    for compiler in ("/nonexistent/g++", "false"):  # not there; there but failing
        monkeypatch.setenv("CXX", compiler)
        assert native.main(["--force"]) == 1
        assert "build failed" in capsys.readouterr().err
        assert list(tmp_path.iterdir()) == [], "a partial library was left behind"
    native.load.cache_clear()  # the real library again for the other tests
