"""End-to-end read path: a real `cachefs up` worker process, a real FUSE mount, a real S3 HTTP
endpoint (moto server) behind the fault proxy that counts and breaks requests."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.damage import flip_byte
from tests.worker_process import GENEROUS_STORE_BUDGET, drop_page_cache, start_s3_world

BLOCK = 64 * 1024


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def make_objects(seed: int = 7) -> dict[str, bytes]:
    rng = random.Random(seed)
    sizes = {
        "empty.bin": 0,
        "one.bin": 1,
        "block-minus-1.bin": BLOCK - 1,
        "block.bin": BLOCK,
        "block-plus-1.bin": BLOCK + 1,
        "many/blocks.bin": 7 * BLOCK + 123,
        "train/n01/a.jpg": 110_000,
        "train/n01/b.jpg": 95_000,
        "train/n02/c.jpg": 130_000,
        "train/n02/deeper/d.jpg": 10,
    }
    return {key: rng.randbytes(size) for key, size in sizes.items()}


@pytest.fixture
def s3_world(moto_s3, fault_proxy, tmp_path):
    world = start_s3_world(moto_s3, fault_proxy, str(tmp_path), make_objects(), block_size=BLOCK)
    yield world
    world.worker.cleanup()


def test_every_file_is_byte_exact_and_second_reads_hit_the_cache(s3_world):
    worker, proxy = s3_world.worker, s3_world.proxy
    for key, data in s3_world.objects.items():
        assert sha(read_file(worker.path("ds", key))) == sha(data), key
    gets_after_first_pass = proxy.count("GET")
    assert gets_after_first_pass > 0
    drop_page_cache()
    for key, data in s3_world.objects.items():
        assert read_file(worker.path("ds", key)) == data, key
    assert proxy.count("GET") == gets_after_first_pass, "second pass must not touch the store"
    status = worker.dataset_status("ds")
    assert status["cached_bytes"] == sum(len(d) for d in s3_world.objects.values())


def test_reads_spanning_block_boundaries(s3_world):
    data = s3_world.objects["many/blocks.bin"]
    with open(s3_world.worker.path("ds", "many/blocks.bin"), "rb", buffering=0) as f:
        for boundary in range(BLOCK, len(data), BLOCK):
            for start, length in (
                (boundary - 1, 2),
                (boundary - 100, 300),
                (boundary - BLOCK, 2 * BLOCK),
            ):
                assert os.pread(f.fileno(), length, start) == data[start : start + length]
        assert os.pread(f.fileno(), 10, len(data) - 5) == data[-5:]
        assert os.pread(f.fileno(), 10, len(data) + 100) == b""


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(offset=st.integers(0, 7 * BLOCK + 200), length=st.integers(0, 3 * BLOCK))
def test_random_ranges_match_the_source(s3_world, offset, length):
    data = s3_world.objects["many/blocks.bin"]
    fd = os.open(s3_world.worker.path("ds", "many/blocks.bin"), os.O_RDONLY)
    try:
        assert os.pread(fd, length, offset) == data[offset : offset + length]
    finally:
        os.close(fd)


def test_listing_of_every_directory_equals_the_source(s3_world):
    root = s3_world.worker.path("ds")
    seen_files = set()
    expected_dirs: dict[str, set[str]] = {}
    for key in s3_world.objects:
        parts = key.split("/")
        for depth in range(len(parts)):
            parent = "/".join(parts[:depth])
            expected_dirs.setdefault(parent, set()).add(parts[depth])
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        rel = "" if rel == "." else rel
        assert set(dirnames) | set(filenames) == expected_dirs[rel], rel
        for name in filenames:
            seen_files.add(os.path.join(rel, name) if rel else name)
    assert seen_files == set(s3_world.objects)
    for key, data in s3_world.objects.items():
        st_ = os.stat(os.path.join(root, key))
        assert st_.st_size == len(data)
    assert sorted(os.listdir(s3_world.worker.mount)) == ["ds"]


def _expect_errno(code: int, func, *args) -> None:
    with pytest.raises(OSError) as info:
        func(*args)
    assert info.value.errno == code, (func, args, info.value)


def test_every_write_path_is_read_only_and_missing_paths_are_enoent(s3_world):
    w = s3_world.worker
    existing = w.path("ds", "one.bin")
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_APPEND, os.O_RDWR | os.O_TRUNC):
        _expect_errno(errno.EROFS, os.open, existing, flags)
    _expect_errno(errno.EROFS, os.open, w.path("ds", "new.bin"), os.O_WRONLY | os.O_CREAT, 0o644)
    _expect_errno(errno.EROFS, os.mkdir, w.path("ds", "newdir"))
    _expect_errno(errno.EROFS, os.mkdir, w.path("newdataset"))
    _expect_errno(errno.EROFS, os.unlink, existing)
    _expect_errno(errno.EROFS, os.rmdir, w.path("ds", "train", "n02", "deeper"))
    _expect_errno(errno.EROFS, os.rename, existing, w.path("ds", "renamed.bin"))
    _expect_errno(errno.EROFS, os.symlink, "one.bin", w.path("ds", "link"))
    _expect_errno(errno.EROFS, os.link, existing, w.path("ds", "hardlink"))
    _expect_errno(errno.EROFS, os.chmod, existing, 0o777)
    _expect_errno(errno.EROFS, os.truncate, existing, 0)
    _expect_errno(errno.EROFS, os.utime, existing, (1, 1))
    _expect_errno(errno.EROFS, os.setxattr, existing, "user.x", b"1")
    _expect_errno(errno.ENOENT, os.stat, w.path("ds", "nope.bin"))
    _expect_errno(errno.ENOENT, os.stat, w.path("ds", "train", "n99"))
    _expect_errno(errno.ENOENT, os.stat, w.path("no-such-dataset"))
    _expect_errno(errno.ENOENT, open, w.path("ds", "train", "missing.jpg"), "rb")
    _expect_errno(errno.ENOTDIR, os.listdir, existing)
    assert read_file(existing) == s3_world.objects["one.bin"]  # nothing was changed


def test_store_down_metadata_and_cached_reads_still_work_uncached_fails_fast(s3_world):
    w, proxy = s3_world.worker, s3_world.proxy
    cached_key, uncached_key = "train/n01/a.jpg", "train/n02/c.jpg"
    assert read_file(w.path("ds", cached_key)) == s3_world.objects[cached_key]
    proxy.stop()
    drop_page_cache()
    found = {
        os.path.relpath(os.path.join(d, f), w.path("ds"))
        for d, _, fs in os.walk(w.path("ds"))
        for f in fs
    }
    assert found == set(s3_world.objects)
    assert os.stat(w.path("ds", uncached_key)).st_size == len(s3_world.objects[uncached_key])
    assert read_file(w.path("ds", cached_key)) == s3_world.objects[cached_key]
    began = time.monotonic()
    _expect_errno(errno.EIO, read_file, w.path("ds", uncached_key))
    elapsed = time.monotonic() - began
    # The store refuses connections at once, so the read ends by its tries (10 per block, with
    # jittered backoff: about 21 s at most each), inside the dataset's budget (120 s, from
    # GENEROUS_STORE_BUDGET); this bounds a hang, it does not measure performance.
    assert elapsed < GENEROUS_STORE_BUDGET["timeout_s"], elapsed
    proxy.start()
    assert read_file(w.path("ds", uncached_key)) == s3_world.objects[uncached_key]


def test_restart_comes_back_warm_with_zero_store_gets(s3_world):
    w, proxy = s3_world.worker, s3_world.proxy
    for key in s3_world.objects:
        read_file(w.path("ds", key))
    w.restart()
    proxy.reset_counts()
    for key, data in s3_world.objects.items():
        assert read_file(w.path("ds", key)) == data
    assert proxy.count("GET") == 0
    assert w.status()["reads"]["misses"] == 0


def test_corrupt_block_is_detected_refetched_and_never_served(s3_world):
    w, proxy = s3_world.worker, s3_world.proxy
    key = "train/n01/b.jpg"
    data = s3_world.objects[key]
    assert read_file(w.path("ds", key)) == data
    blocks = w.client.resolve("ds", key)["blocks"]
    assert len(blocks) == 2 and all(b["file"] for b in blocks)
    for block in blocks:
        flip_byte(block["file"], 0)
    # Live worker: whole-block reads are always verified.
    drop_page_cache()
    gets = proxy.count("GET")
    assert read_file(w.path("ds", key)) == data
    assert proxy.count("GET") == gets + 2
    assert w.status()["cache"]["corrupt"] == 2
    # After a restart: the first read of each block in the new process is verified too.
    big = "many/blocks.bin"
    read_file(w.path("ds", big))
    target = w.client.resolve("ds", big)["blocks"][3]["file"]
    w.stop()
    flip_byte(target, 0)
    w.start()
    with open(w.path("ds", big), "rb", buffering=0) as f:
        assert (
            os.pread(f.fileno(), 100, 3 * BLOCK + 10)
            == s3_world.objects[big][3 * BLOCK + 10 : 3 * BLOCK + 110]
        )
    assert w.status()["cache"]["corrupt"] == 1


def test_concurrent_readers_of_one_uncached_block_cause_one_get(s3_world):
    w, proxy = s3_world.worker, s3_world.proxy
    key = "block.bin"  # exactly one block
    data = s3_world.objects[key]
    proxy.reset_counts()
    proxy.delay_next(1, 0.5, method="GET")  # hold the first GET so the others pile up
    results: list[bytes] = []
    barrier = threading.Barrier(8)

    def reader(offset: int) -> None:
        fd = os.open(w.path("ds", key), os.O_RDONLY)
        try:
            barrier.wait()
            results.append(os.pread(fd, 4096, offset) == data[offset : offset + 4096])
        finally:
            os.close(fd)

    threads = [threading.Thread(target=reader, args=(i * 8192,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [True] * 8
    assert proxy.count("GET", path_contains=key) == 1


def test_failed_gets_are_retried_and_503_forever_is_eio(s3_world):
    w, proxy = s3_world.worker, s3_world.proxy
    key = "train/n02/c.jpg"
    proxy.fail_next(2, status=503, method="GET")
    assert read_file(w.path("ds", key)) == s3_world.objects[key]
    other = "train/n02/deeper/d.jpg"
    proxy.fail_matching(other, status=503)
    _expect_errno(errno.EIO, read_file, w.path("ds", other))
    proxy.clear_faults()
    assert read_file(w.path("ds", other)) == s3_world.objects[other]


def test_cold_reads_have_their_gets_in_the_loop_thread_byte_exact(s3_world):
    """Every file read cold at once (a thread per file): each block is one GET, sent by the
    worker's GET loop thread (cachefs/store/get_thread.py; the status counts it), and every
    byte is the source's. (A try the loop leaves undone goes to the ordinary read: the 503
    test above.)"""
    w, proxy = s3_world.worker, s3_world.proxy
    proxy.reset_counts()
    keys = sorted(s3_world.objects)
    results: dict[str, bool] = {}

    def reader(mine: list[str]) -> None:
        for key in mine:
            results[key] = read_file(w.path("ds", key)) == s3_world.objects[key]

    threads = [threading.Thread(target=reader, args=(keys[i::16],)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == {key: True for key in keys}
    blocks = sum(-(-len(data) // BLOCK) for data in s3_world.objects.values())
    assert proxy.count("GET", path_contains=f"/{s3_world.bucket}/") == blocks
    assert w.status()["store"]["gets_in_loop"] == blocks
    # Admitted: a second pass, page cache dropped, reads the cache only.
    drop_page_cache()
    for key in keys:
        assert read_file(w.path("ds", key)) == s3_world.objects[key]
    assert proxy.count("GET", path_contains=f"/{s3_world.bucket}/") == blocks
