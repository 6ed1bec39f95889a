"""FUSE passthrough (``--fuse-passthrough on``, the patched pyfuse3's native path: the
"passthrough" section of third_party/pyfuse3/cachefs_fast_read.c). When the kernel grants it
at FUSE_INIT, every OPEN and RELEASE is answered in C: a file whose one block is in the RAM
tier's native table, and passes its checksums, gets a kernel backing file (the kernel reads the
tier's block file itself, and no READ of it reaches the worker); any other file an ordinary
open (READs served by the native path or Python).

Real worker processes and real mounts; every byte compared with the source. What is checked:
cached single-block files are opened with passthrough and read by the kernel alone; empty and
multi-block files still read right through ordinary opens; a file held open across a refresh
or an eviction still reads right bytes, and a new open of it reads what the snapshot serves
now; a corrupted block file is never handed to the kernel; 16 readers through page drops and a
refresh get only right bytes; write opens are refused; and every backing file and open record
is gone once the readers have closed their files (RELEASE is asynchronous: waited for).

Needs the patched pyfuse3 (scripts/setup.sh) and a kernel that grants passthrough (Linux >=
6.9 with CONFIG_FUSE_PASSTHROUGH); each test skips itself when the kernel does not.
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import threading

import pytest

from cachefs.fs.fuse_ops import FAST_READ_SUPPORTED
from tests.damage import flip_byte
from tests.e2e.fs.test_native_reads import (
    BLOCK,
    cli_status_text,
    drop_pages_keep_dentries,
    make_source,
    native_stats,
    own_tmpfs,  # noqa: F401 (a fixture the eviction test uses)
    read_whole,
    tmpfs_used,
    worker_fds,
)
from tests.e2e.fs.test_no_open import fuse_op_count
from tests.waiting import WAIT_S, wait_for
from tests.worker_process import WorkerProcess

pytestmark = pytest.mark.skipif(
    not FAST_READ_SUPPORTED,
    reason="stock pyfuse3 has no native path, hence no passthrough: run scripts/setup.sh",
)

PASSTHROUGH = ("--fuse-passthrough", "on")
NOT_GRANTED = (
    "kernel did not grant FUSE passthrough (needs Linux >= 6.9 with CONFIG_FUSE_PASSTHROUGH)"
)


def require_passthrough(worker: WorkerProcess) -> None:
    """Call once the mount has served a request (INIT is answered by then)."""
    if native_stats(worker).get("passthrough") != 1:
        pytest.skip(NOT_GRANTED)


def wait_all_released(worker: WorkerProcess) -> None:
    """RELEASE comes after close() returns: wait until every OPEN has had its RELEASE, and the
    only backing files left are those the table's blocks keep for their next opens."""

    def released() -> bool:
        stats = native_stats(worker)
        return stats["opened"] == 0 and stats["backing_files"] == stats["kept_backings"]

    wait_for(released, "every RELEASE answered and no backing file left but the kept ones")
    stats = native_stats(worker)
    assert stats["kept_backings"] <= stats["blocks"]


def pread_whole(fd: int, size_hint: int) -> bytes:
    """The whole file through ``fd`` by offset, from 0 (not the fd's position)."""
    chunks, offset = [], 0
    while chunk := os.pread(fd, max(size_hint, 1 << 16), offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def test_cached_single_block_files_are_read_by_the_kernel_alone(tmp_path):
    rng = random.Random(37)
    single = {f"s/size{size}.bin": rng.randbytes(size) for size in (1, 4095, 100_000, BLOCK - 1)}
    single["s/exact.bin"] = rng.randbytes(BLOCK)
    empty = {"s/empty.bin": b""}
    multi = {"m/two.bin": rng.randbytes(BLOCK + 1), "m/four.bin": rng.randbytes(3 * BLOCK + 999)}
    files = {**single, **empty, **multi}
    make_source(tmp_path / "src", files)
    worker = WorkerProcess(str(tmp_path / "w"), extra_args=PASSTHROUGH).start()
    try:
        worker.add_dataset("ds", f"file://{tmp_path / 'src'}", block_size=BLOCK)
        for name, data in files.items():  # cold: ordinary opens, fetched, admitted to RAM
            assert read_whole(worker.path("ds", name)) == data
        require_passthrough(worker)
        drop_pages_keep_dentries()

        before, python_reads = native_stats(worker), fuse_op_count(worker, "read")
        for name, data in single.items():
            assert read_whole(worker.path("ds", name)) == data
        after = native_stats(worker)
        assert after["pt_opens"] - before["pt_opens"] == len(single)
        assert after["cached_opens"] == before["cached_opens"]
        # The kernel read them from the block files: no READ reached the worker at all.
        assert after["reads"] == before["reads"]
        assert fuse_op_count(worker, "read") == python_reads
        assert after["pt_refused"] == after["corrupt"] == after["vanished"] == 0
        # mmap maps the block file's own pages (read-only).
        with open(worker.path("ds", "s/size100000.bin"), "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        with mapped:
            assert mapped[:] == single["s/size100000.bin"]
        after = native_stats(worker)
        assert after["pt_opens"] - before["pt_opens"] == len(single) + 1
        assert after["reads"] == before["reads"]

        before = after
        for name, data in {**empty, **multi}.items():  # ordinary opens, READs served in C
            assert read_whole(worker.path("ds", name)) == data
        after = native_stats(worker)
        assert after["cached_opens"] - before["cached_opens"] == len(empty) + len(multi)
        assert after["pt_opens"] == before["pt_opens"]
        assert after["reads"] > before["reads"]
        assert fuse_op_count(worker, "read") == python_reads

        drop_pages_keep_dentries()
        for name, data in files.items():  # once more, all of them: still right
            assert read_whole(worker.path("ds", name)) == data
        wait_all_released(worker)
        stats = native_stats(worker)
        assert stats["pt_opens"] == after["pt_opens"] + len(single)
        # The blocks keep their backing files for the next opens (checked once, and again
        # when the block file changes) ...
        assert stats["kept_backings"] == len(single)
        shown = cli_status_text(worker)
        assert f"passthrough: {stats['pt_opens']} OPENs handed the block file to the kernel" in (
            shown
        )
        metrics = worker.client.metrics()
        assert f"cachefs_fuse_passthrough_opens_total {float(stats['pt_opens'])}" in metrics
        worker.client.remove_dataset("ds")
        # ... until they leave the table: removing the dataset closes every one.
        assert native_stats(worker)["backing_files"] == 0
    finally:
        worker.cleanup()


def test_a_file_held_open_across_a_refresh_new_opens_read_the_new_bytes(tmp_path):
    old, new = b"old!" * 30_000, b"NEW." * 40_000  # both single blocks
    source = tmp_path / "src"
    make_source(source, {"changing.bin": old, "stable.bin": b"s" * 70_000})
    worker = WorkerProcess(str(tmp_path / "w"), extra_args=PASSTHROUGH).start()
    try:
        worker.add_dataset("ds", f"file://{source}", block_size=BLOCK)
        path = worker.path("ds", "changing.bin")
        assert read_whole(path) == old  # cold: admitted to the RAM tier
        require_passthrough(worker)
        drop_pages_keep_dentries()
        before = native_stats(worker)["pt_opens"]
        held = os.open(path, os.O_RDONLY)
        try:
            assert native_stats(worker)["pt_opens"] == before + 1
            assert pread_whole(held, len(old)) == old

            (source / "changing.bin").write_bytes(new)
            assert worker.client.refresh_dataset("ds")["changed"] == 1
            drop_pages_keep_dentries()
            assert read_whole(path) == new  # a new open: what the snapshot serves now
            assert read_whole(worker.path("ds", "stable.bin")) == b"s" * 70_000
            # The held fd was opened before the refresh: the old version (its backing file),
            # or the new one, never a mix.
            assert pread_whole(held, len(new)) in (old, new)
        finally:
            os.close(held)
        wait_all_released(worker)
        drop_pages_keep_dentries()
        assert read_whole(path) == new  # the new version, admitted: through a backing file
        wait_all_released(worker)
    finally:
        worker.cleanup()


def test_a_corrupted_block_file_is_never_handed_to_the_kernel(tmp_path):
    data = random.Random(5).randbytes(200_000)  # one block, several checksum chunks
    make_source(tmp_path / "src", {"f.bin": data})
    worker = WorkerProcess(str(tmp_path / "w"), extra_args=PASSTHROUGH).start()
    try:
        worker.add_dataset("ds", f"file://{tmp_path / 'src'}", block_size=BLOCK)
        path = worker.path("ds", "f.bin")
        assert read_whole(path) == data
        require_passthrough(worker)
        block_file = worker.client.resolve("ds", "f.bin")["blocks"][0]["file"]
        flip_byte(block_file, 150_000)  # one byte of the block's second chunk, in place
        drop_pages_keep_dentries()
        assert read_whole(path) == data
        assert native_stats(worker)["corrupt"] == 1  # checked at OPEN, before any backing file
        assert worker.status()["cache"]["corrupt"] == 1  # dropped, then refetched
        wait_all_released(worker)
        drop_pages_keep_dentries()
        assert read_whole(path) == data  # from the block admitted again
        assert native_stats(worker)["corrupt"] == 1
        wait_all_released(worker)

        # Now the block has a backing file, kept for the next opens. A write to its block
        # file moves the file's ctime: the next OPEN checks the chunks again, before handing
        # the file to the kernel.
        drop_pages_keep_dentries()
        before = native_stats(worker)
        assert read_whole(path) == data
        assert native_stats(worker)["pt_opens"] == before["pt_opens"] + 1
        wait_all_released(worker)
        assert native_stats(worker)["kept_backings"] == 1
        block_file = worker.client.resolve("ds", "f.bin")["blocks"][0]["file"]
        flip_byte(block_file, 7)
        drop_pages_keep_dentries()
        assert read_whole(path) == data
        stats = native_stats(worker)
        assert stats["corrupt"] == 2 and stats["kept_backings"] == 0
        assert worker.status()["cache"]["corrupt"] == 2
        wait_all_released(worker)
    finally:
        worker.cleanup()


def test_checked_chunks_of_multi_block_files_are_spliced_until_their_block_file_changes(
    tmp_path,
):
    """A file of several blocks gets no backing file: its READs come to the worker. With
    passthrough asked for (granted or not), a READ of chunks that an earlier READ checked, while
    their block file is unchanged, is spliced from that file to /dev/fuse without a copy through
    the worker (the files are touched first: the state their admission wrote them in would
    count as checked already, see test_native_reads.py). A write to a block file moves its
    ctime: the next READ checks its chunks again (and finds the flipped byte)."""
    rng = random.Random(41)
    # Each file fits one READ that fits a pipe of the default pipe-max-size (1 MiB).
    files = {"m/four.bin": rng.randbytes(3 * BLOCK + 999), "m/two.bin": rng.randbytes(BLOCK + 1)}
    make_source(tmp_path / "src", files)
    worker = WorkerProcess(str(tmp_path / "w"), extra_args=PASSTHROUGH).start()
    try:
        worker.add_dataset("ds", f"file://{tmp_path / 'src'}", block_size=BLOCK)
        for name, data in files.items():  # cold: fetched in Python, admitted to the RAM tier
            assert read_whole(worker.path("ds", name)) == data
        for name in files:  # a new state of every block file: its chunks count as unchecked
            for block in worker.client.resolve("ds", name)["blocks"]:
                os.utime(block["file"])
        drop_pages_keep_dentries()
        before = native_stats(worker)
        for name, data in files.items():  # READs in C, read and checked
            assert read_whole(worker.path("ds", name)) == data
        checked = native_stats(worker)
        assert checked["reads"] > before["reads"]
        assert checked["spliced"] == before["spliced"]

        drop_pages_keep_dentries()
        python_reads = fuse_op_count(worker, "read")
        for name, data in files.items():  # the same chunks again: spliced, every one
            assert read_whole(worker.path("ds", name)) == data
        spliced = native_stats(worker)
        assert spliced["spliced"] - checked["spliced"] == spliced["reads"] - checked["reads"] > 0
        drop_pages_keep_dentries()
        for name, data in files.items():  # pieces at odd offsets: spliced, still right
            with open(worker.path("ds", name), "rb", buffering=0) as f:
                for _ in range(8):
                    offset = rng.randrange(0, len(data))
                    length = rng.randrange(1, 200_000)
                    assert os.pread(f.fileno(), length, offset) == data[offset : offset + length]
        stats = native_stats(worker)
        assert stats["spliced"] > spliced["spliced"]
        assert fuse_op_count(worker, "read") == python_reads
        assert f"{stats['spliced']} spliced)" in cli_status_text(worker)
        metrics = worker.client.metrics()
        assert f"cachefs_fuse_fast_reads_spliced_total {float(stats['spliced'])}" in metrics
        assert native_stats(worker)["corrupt"] == 0

        block_file = worker.client.resolve("ds", "m/four.bin")["blocks"][2]["file"]
        flip_byte(block_file, 1000)
        drop_pages_keep_dentries()
        assert read_whole(worker.path("ds", "m/four.bin")) == files["m/four.bin"]
        assert native_stats(worker)["corrupt"] == 1  # checked again, not spliced
        assert worker.status()["cache"]["corrupt"] == 1  # dropped by Python, then refetched
    finally:
        worker.cleanup()


def test_a_block_file_changed_under_open_files_is_checked_before_a_new_open_reads_it(tmp_path):
    """While a file is open on its block's backing file, a new open gets the same backing file
    (the kernel's rule), but only after the block file is checked again if it changed: a
    corrupt one is dropped and the new open reads through READs (right bytes); one that grew
    is never handed to the kernel (a passthrough read goes by the backing file's size)."""
    rng = random.Random(8)
    files = {"held.bin": rng.randbytes(180_000), "grown.bin": rng.randbytes(90_000)}
    make_source(tmp_path / "src", files)
    worker = WorkerProcess(str(tmp_path / "w"), extra_args=PASSTHROUGH).start()
    try:
        worker.add_dataset("ds", f"file://{tmp_path / 'src'}", block_size=BLOCK)
        for name, data in files.items():
            assert read_whole(worker.path("ds", name)) == data
        require_passthrough(worker)
        drop_pages_keep_dentries()
        for name, data in files.items():  # backing files made and kept
            assert read_whole(worker.path("ds", name)) == data
        wait_all_released(worker)
        assert native_stats(worker)["kept_backings"] == 2

        held = os.open(worker.path("ds", "held.bin"), os.O_RDONLY)
        try:
            assert pread_whole(held, 1 << 20) == files["held.bin"]
            flip_byte(worker.client.resolve("ds", "held.bin")["blocks"][0]["file"], 123_456)
            before = native_stats(worker)
            assert read_whole(worker.path("ds", "held.bin")) == files["held.bin"]
            after = native_stats(worker)
            assert after["corrupt"] == before["corrupt"] + 1  # checked again, dropped
            assert after["pt_opens"] == before["pt_opens"] + 1  # same backing, direct I/O
            assert worker.status()["cache"]["corrupt"] == 1  # the READ path refetched it
        finally:
            os.close(held)

        block_file = worker.client.resolve("ds", "grown.bin")["blocks"][0]["file"]
        with open(block_file, "ab") as f:  # a block file longer than its block
            f.write(b"extra bytes")
        drop_pages_keep_dentries()
        got = read_whole(worker.path("ds", "grown.bin"))
        assert got == files["grown.bin"]
        assert native_stats(worker)["vanished"] >= 1
        wait_all_released(worker)
    finally:
        worker.cleanup()


def test_a_file_held_open_across_its_eviction_still_reads_right_bytes(tmp_path, own_tmpfs):  # noqa: F811
    rng = random.Random(41)
    kept = rng.randbytes(200_000)
    others = {f"o/{i}.bin": rng.randbytes(200_000) for i in range(15)}  # 3 MB: a 1 MiB tier
    make_source(tmp_path / "src", {"kept.bin": kept, **others})
    worker = WorkerProcess(
        str(tmp_path / "w"),
        ram="1MiB",
        admission="lru",
        ram_dir=own_tmpfs,
        extra_args=PASSTHROUGH,
    ).start()
    try:
        worker.add_dataset("ds", f"file://{tmp_path / 'src'}", block_size=BLOCK)
        path = worker.path("ds", "kept.bin")
        assert read_whole(path) == kept
        require_passthrough(worker)
        block_file = worker.client.resolve("ds", "kept.bin")["blocks"][0]["file"]
        drop_pages_keep_dentries()
        before = native_stats(worker)["pt_opens"]
        held = os.open(path, os.O_RDONLY)
        try:
            assert native_stats(worker)["pt_opens"] == before + 1
            evicted = worker.status()["cache"]["evicted"]
            for name, data in others.items():  # cold reads: each admission evicts the oldest
                assert read_whole(worker.path("ds", name)) == data
            assert worker.status()["cache"]["evicted"] > evicted
            wait_for(lambda: not os.path.exists(block_file), "kept.bin's block file removed")
            # The removed block file lives on for the fd that reads through it.
            assert pread_whole(held, len(kept)) == kept
            drop_pages_keep_dentries()
            assert read_whole(path) == kept  # a second open: the same backing file, or READs
            assert pread_whole(held, len(kept)) == kept
        finally:
            os.close(held)
        wait_all_released(worker)
        pid = worker.status()["pid"]
        assert not [t for t in worker_fds(pid) if "(deleted)" in t and own_tmpfs in t]
        assert tmpfs_used(own_tmpfs) <= 1 << 20
        assert read_whole(path) == kept
        wait_all_released(worker)
    finally:
        worker.cleanup()


def test_sixteen_readers_through_page_drops_and_a_refresh_get_only_right_bytes(tmp_path):
    """~40 small single-block files (passthrough once cached), a few multi-block ones
    (ordinary opens), one file refreshed once while 16 readers read a bounded number of times
    each, the page cache dropped in between."""
    rng = random.Random(1717)
    versions = [b"A" * 150_000, b"B" * 170_000]  # the changing file, in turn
    small = {f"s/{i}.bin": rng.randbytes(rng.randint(1, BLOCK)) for i in range(40)}
    large = {f"l/{i}.bin": rng.randbytes(rng.randint(BLOCK + 1, 3 * BLOCK)) for i in range(4)}
    files = {**small, **large}
    make_source(tmp_path / "src", {**files, "changing.bin": versions[0]})
    worker = WorkerProcess(str(tmp_path / "w"), extra_args=PASSTHROUGH).start()
    reads_per_reader = 60
    wrong: list[str] = []
    errors: list[str] = []
    counter = threading.Lock()
    reads_done = [0]

    def reader(seed: int) -> None:
        pick = random.Random(seed)
        for _ in range(reads_per_reader):
            if pick.random() < 0.1:
                name, allowed = "changing.bin", versions
            else:
                name = pick.choice(sorted(files))
                allowed = [files[name]]
            path = worker.path("ds", name)
            try:
                got = read_whole(path)
            except OSError as exc:
                # Expected failures only: the changing file between its rewrite in the source
                # and the refresh (EIO: the snapshot's version is gone from the store).
                if name != "changing.bin":
                    errors.append(f"{path}: {exc}")
            else:
                if got not in allowed:
                    wrong.append(f"{path}: {len(got)} bytes, not the source's")
            with counter:
                reads_done[0] += 1

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(16)]
    total = len(threads) * reads_per_reader
    try:
        worker.add_dataset("ds", f"file://{tmp_path / 'src'}", block_size=BLOCK)
        assert read_whole(worker.path("ds", "changing.bin")) == versions[0]
        require_passthrough(worker)
        for thread in threads:
            thread.start()

        def churn(rounds: int) -> None:
            for _ in range(rounds):
                target = min(reads_done[0] + 40, total)
                wait_for(lambda t=target: reads_done[0] >= t, "40 more reads")
                drop_pages_keep_dentries()

        churn(6)
        (tmp_path / "src" / "changing.bin").write_bytes(versions[1])
        assert worker.client.refresh_dataset("ds")["changed"] == 1
        churn(6)
    except BaseException:
        worker.cleanup()
        raise
    finally:
        for thread in threads:
            if thread.ident is not None:  # started
                thread.join(WAIT_S)
    try:
        assert not any(thread.is_alive() for thread in threads)
        assert not wrong, wrong[:5]
        assert not errors, errors[:5]
        assert reads_done[0] == total
        wait_all_released(worker)
        stats = native_stats(worker)
        assert stats["pt_opens"] > 0
        assert stats["corrupt"] == 0
        drop_pages_keep_dentries()
        assert read_whole(worker.path("ds", "changing.bin")) == versions[1]
        for name, data in files.items():
            assert read_whole(worker.path("ds", name)) == data
        wait_all_released(worker)
    finally:
        worker.cleanup()


def test_a_write_open_is_refused_and_reads_go_on(tmp_path):
    data = b"w" * 5000
    make_source(tmp_path / "src", {"f.bin": data})
    worker = WorkerProcess(str(tmp_path / "w"), extra_args=PASSTHROUGH).start()
    try:
        worker.add_dataset("ds", f"file://{tmp_path / 'src'}", block_size=BLOCK)
        path = worker.path("ds", "f.bin")
        assert read_whole(path) == data
        require_passthrough(worker)
        for flags in (os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_TRUNC):
            with pytest.raises(OSError) as refused:
                os.close(os.open(path, flags))
            assert refused.value.errno in (errno.EROFS, errno.EACCES)
        drop_pages_keep_dentries()
        assert read_whole(path) == data
        wait_all_released(worker)
    finally:
        worker.cleanup()
