"""The native READ fast path (the patched pyfuse3 answers READs of RAM-tier blocks in C;
cachefs/fs/native_reads.py keeps its table coherent). Real worker processes and real mounts;
every byte compared with the source.

Each test runs twice: with the fast path, and with ``--fuse-fast-read off``, which is the read
path a stock pyfuse3 gives (every READ in Python). On a stock pyfuse3 only the "off" runs run:
the suite passes there too (``scripts/stock_pyfuse3_check.sh``).
"""

from __future__ import annotations

import os
import random
import resource
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest

from cachefs.fs.fuse_ops import FAST_READ_SUPPORTED
from tests.damage import flip_byte
from tests.e2e.fs.test_no_open import fuse_op_count
from tests.e2e.test_worker import mount_readahead_kib
from tests.waiting import WAIT_S, wait_for
from tests.worker_process import REPO_ROOT, WorkerProcess

#: Two and a half checksum chunks: a block's last chunk is short, and block and chunk
#: boundaries differ.
BLOCK = 320 << 10
SIZES = [0, 1, 4095, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 12_345]


def drop_pages_keep_dentries() -> None:
    """`echo 1 > drop_caches`: file pages go, dentries stay (as after a training job's listing)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def drop_file_pages(path: str) -> None:
    """Drop one file's cached pages (its next read sends READs), leaving every other file's."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_whole(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def native_stats(worker: WorkerProcess) -> dict:
    return worker.status()["fuse_fast_read"] or {}


def cli_status_text(worker: WorkerProcess) -> str:
    return subprocess.run(
        [sys.executable, "-m", "cachefs", "--state", worker.state, "status"],
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout


def touch_block_files(worker: WorkerProcess, dataset: str, files: dict[str, bytes]) -> None:
    """Move the ctime of every block file of ``files`` (their bytes unchanged)."""
    for name in files:
        for block in worker.client.resolve(dataset, name)["blocks"]:
            os.utime(block["file"])


def make_source(root, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


@pytest.fixture(
    params=[
        pytest.param(
            "on",
            marks=pytest.mark.skipif(
                not FAST_READ_SUPPORTED,
                reason="stock pyfuse3: run scripts/setup.sh to build the patched one",
            ),
        ),
        "off",
    ]
)
def fast_read(request):
    """``--fuse-fast-read``: "off" also runs on a stock pyfuse3 (every READ in Python)."""
    return request.param


def test_reads_of_every_size_are_byte_exact_and_answered_in_c(tmp_path, fast_read):
    rng = random.Random(16)
    files = {f"d/size{size}.bin": rng.randbytes(size) for size in SIZES}
    make_source(tmp_path / "src", files)
    worker = WorkerProcess(str(tmp_path / "w"), extra_args=("--fuse-fast-read", fast_read)).start()
    try:
        worker.add_dataset("ds", f"file://{tmp_path / 'src'}", block_size=BLOCK)
        for name, data in files.items():  # cold: fetched in Python, admitted to the RAM tier
            assert read_whole(worker.path("ds", name)) == data
        drop_pages_keep_dentries()
        python_reads, before = fuse_op_count(worker, "read"), native_stats(worker)
        for name, data in files.items():  # first READs in C, of blocks just admitted: spliced
            assert read_whole(worker.path("ds", name)) == data
        admitted = native_stats(worker)
        touch_block_files(worker, "ds", files)  # a new state: no chunk counts as checked
        drop_pages_keep_dentries()
        for name, data in files.items():  # READs in C: read and checked
            assert read_whole(worker.path("ds", name)) == data
        checked = native_stats(worker)
        drop_pages_keep_dentries()
        for name, data in files.items():  # single reads at odd offsets: partial chunks
            with open(worker.path("ds", name), "rb", buffering=0) as f:
                for _ in range(5):
                    offset = rng.randrange(0, len(data) + 2)
                    length = rng.randrange(1, 300_000)
                    assert os.pread(f.fileno(), length, offset) == data[offset : offset + length]
        after = native_stats(worker)
        if fast_read == "on":
            assert after["reads"] > before["reads"]
            assert after["corrupt"] == after["vanished"] == 0
            # A block registered with the state its admission wrote its tmpfs file in counts
            # as checked while the file keeps that state: READs of it are spliced. Once the
            # file is in another state, a chunk is read and checked by the first READ of it,
            # and READs of it are spliced again after that.
            assert admitted["spliced"] - before["spliced"] == admitted["reads"] - before["reads"]
            assert admitted["reads"] > before["reads"]
            assert checked["spliced"] == admitted["spliced"]
            assert checked["reads"] > admitted["reads"]
            assert after["spliced"] > checked["spliced"]
            # Every READ of these cached files was answered in C: none reached Python.
            assert fuse_op_count(worker, "read") == python_reads
            assert after["blocks"] == sum(-(-size // BLOCK) for size in SIZES)
            shown = cli_status_text(worker)
            assert f"native reads: {after['reads']} READs answered in C" in shown
            metrics = worker.client.metrics()
            assert f"cachefs_fuse_fast_reads_total {float(after['reads'])}" in metrics
        else:
            assert after == {}  # the status says the path is off
            assert fuse_op_count(worker, "read") > python_reads
    finally:
        worker.cleanup()


@pytest.mark.skipif(not FAST_READ_SUPPORTED, reason="stock pyfuse3: no session loop patch")
def test_requests_already_queued_are_read_without_a_wait_and_every_byte_is_right(tmp_path):
    """16 readers read 240 files cold (every READ in Python, each fetched from the source):
    while a session task is busy, requests queue on /dev/fuse, and a task back from its
    Python handler reads one at once instead of waiting through trio (a poll first: /dev/fuse
    is a blocking fd). Every byte is the source's, no read fails or hangs, and the status and the
    metrics count the requests read that way."""
    rng = random.Random(1618)
    files = {f"d/{i}.bin": rng.randbytes(rng.randint(1, 150_000)) for i in range(240)}
    make_source(tmp_path / "src", files)
    worker = WorkerProcess(str(tmp_path / "w"), extra_args=("--fuse-fast-read", "on")).start()
    try:
        worker.add_dataset("ds", f"file://{tmp_path / 'src'}", block_size=BLOCK)
        before = native_stats(worker)["unwaited"]
        names = list(files)
        wrong: list[str] = []

        def reader(share: list[str]) -> None:
            for name in share:
                if read_whole(worker.path("ds", name)) != files[name]:
                    wrong.append(name)

        threads = [threading.Thread(target=reader, args=(names[i::16],)) for i in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=WAIT_S)
        assert not any(thread.is_alive() for thread in threads)
        assert wrong == []
        unwaited = native_stats(worker)["unwaited"]
        assert unwaited > before
        assert "cachefs_fuse_loop_unwaited_requests_total" in worker.client.metrics()
    finally:
        worker.cleanup()


def test_a_corrupted_block_file_is_dropped_and_refetched_never_served(tmp_path, fast_read):
    data = random.Random(3).randbytes(2 * BLOCK + 5000)
    make_source(tmp_path / "src", {"f.bin": data})
    worker = WorkerProcess(str(tmp_path / "w"), extra_args=("--fuse-fast-read", fast_read)).start()
    try:
        worker.add_dataset("ds", f"file://{tmp_path / 'src'}", block_size=BLOCK)
        path = worker.path("ds", "f.bin")
        assert read_whole(path) == data
        block_file = worker.client.resolve("ds", "f.bin")["blocks"][1]["file"]
        flip_byte(block_file, 200_000)  # one byte of block 1's second chunk, in place
        drop_pages_keep_dentries()
        assert read_whole(path) == data
        assert worker.status()["cache"]["corrupt"] == 1  # dropped by Python, then refetched
        if fast_read == "on":
            assert native_stats(worker)["corrupt"] == 1  # C saw it first and handed it over
        drop_pages_keep_dentries()
        assert read_whole(path) == data  # from the block admitted again
    finally:
        worker.cleanup()


@pytest.mark.skipif(not FAST_READ_SUPPORTED, reason="needs the patched pyfuse3")
@pytest.mark.parametrize("ram_on_tmpfs", [True, False], ids=["ram-on-tmpfs", "ram-on-disk"])
def test_checked_chunks_of_a_tmpfs_block_file_are_spliced_until_it_changes(tmp_path, ram_on_tmpfs):
    """Without passthrough: a chunk is read and checked by the first READ of it in C (unless
    its block entered the table in the state the cache wrote it in: see the test above); after
    that, while its block file keeps its state (inode, ctime, size), READs of it are spliced
    from the file, unless the RAM tier is not on tmpfs (a disk can lose bytes under an
    unchanged ctime: every READ reads and checks there). Any write to the block file moves its
    ctime: the next READ checks again and catches a flipped byte."""
    rng = random.Random(17)
    files = {f"f{size}.bin": rng.randbytes(size) for size in (5000, BLOCK + 1, 3 * BLOCK + 7)}
    make_source(tmp_path / "src", files)
    options = ["--fuse-fast-read", "on", "--fuse-passthrough", "off"]
    if not ram_on_tmpfs:
        options += ["--ram-dir", str(tmp_path / "ram-on-disk")]  # tmp_path is not on tmpfs
    worker = WorkerProcess(str(tmp_path / "w"), extra_args=options).start()
    try:
        worker.add_dataset("ds", f"file://{tmp_path / 'src'}", block_size=BLOCK)
        for name, data in files.items():  # cold: fetched and admitted in Python
            assert read_whole(worker.path("ds", name)) == data
        python_reads = fuse_op_count(worker, "read")
        for _ in range(2):  # the chunks' READs in C (admitted just before: already checked on
            # tmpfs, read and checked on disk); the next ones...
            # Only the mount's pages go: the block files' stay cached, so that one on disk
            # could be spliced too, and is not.
            before = native_stats(worker)
            for name, data in files.items():
                drop_file_pages(worker.path("ds", name))
                assert read_whole(worker.path("ds", name)) == data
        after = native_stats(worker)
        assert fuse_op_count(worker, "read") == python_reads  # all answered in C
        if ram_on_tmpfs:  # ... are spliced, every one
            assert after["spliced"] - before["spliced"] == after["reads"] - before["reads"] > 0
        else:  # ... read and checked again
            assert after["spliced"] == 0 and after["reads"] > before["reads"]

        block_file = worker.client.resolve("ds", f"f{3 * BLOCK + 7}.bin")["blocks"][2]["file"]
        flip_byte(block_file, 1000)  # in place: same inode and size, a new ctime
        drop_pages_keep_dentries()
        for name, data in files.items():
            assert read_whole(worker.path("ds", name)) == data  # refetched, never served
        assert native_stats(worker)["corrupt"] == 1
    finally:
        worker.cleanup()


@pytest.mark.skipif(not FAST_READ_SUPPORTED, reason="needs the patched pyfuse3")
def test_every_read_of_a_large_checked_file_is_spliced_whatever_the_pipe_limit(tmp_path):
    """The kernel's largest READ is lowered to what the splice pipes hold: without
    CAP_SYS_RESOURCE a pipe holds at most fs.pipe-max-size (1 MiB by default), less than a
    1 MiB READ and its header, which would then be read and checked by every READ. The mount's
    readahead follows, so a window is one READ. With the capability the READs stay 1 MiB."""
    rng = random.Random(23)
    data = rng.randbytes((8 << 20) + 4321)  # two default-size blocks and a piece of a third
    make_source(tmp_path / "src", {"large.bin": data})
    options = ["--fuse-fast-read", "on", "--fuse-passthrough", "off"]
    worker = WorkerProcess(str(tmp_path / "w"), extra_args=options).start()
    try:
        worker.add_dataset("ds", f"file://{tmp_path / 'src'}")
        path = worker.path("ds", "large.bin")
        assert read_whole(path) == data  # cold: fetched and admitted in Python
        drop_file_pages(path)
        assert read_whole(path) == data  # first READs in C (spliced: just admitted)
        largest = native_stats(worker)["max_read"]
        assert 0 < largest <= 1 << 20
        expected_readahead_kib = min(1024, largest // 1024)
        before = native_stats(worker)
        drop_file_pages(path)
        assert read_whole(path) == data
        after = native_stats(worker)
        reads = after["reads"] - before["reads"]
        assert reads >= len(data) / largest  # no READ larger than the connection's largest
        assert after["spliced"] - before["spliced"] == reads  # and every one spliced
        assert mount_readahead_kib(os.path.realpath(worker.mount)) == expected_readahead_kib
    finally:
        worker.cleanup()
    # READs served in Python get the same limit (the binding negotiates it), and the same
    # readahead: a window is one READ there too.
    python_path = WorkerProcess(
        str(tmp_path / "w2"), extra_args=("--fuse-fast-read", "off")
    ).start()
    try:
        python_path.add_dataset("ds", f"file://{tmp_path / 'src'}")
        assert read_whole(python_path.path("ds", "large.bin")) == data
        assert mount_readahead_kib(os.path.realpath(python_path.mount)) == expected_readahead_kib
    finally:
        python_path.cleanup()


def test_a_long_file_read_in_order_is_fetched_ahead_past_the_blocks_answered_in_c(
    tmp_path, fast_read
):
    """A cold file of 64 blocks read once in order: READs of blocks fetched ahead are answered
    in C and never reach Python, yet the read-ahead keeps ahead of the reader (its marker
    blocks' READs do reach Python), so nearly every block is fetched ahead of its first READ,
    and once. The bytes are the file's. (The read-ahead before the markers took a reader the
    C path had moved past its window for a jump: 58 of the 63 blocks were fetched ahead. The
    markers themselves are checked in tests/unit/fs/test_read_ahead_registration.py: without
    them a read past the window's end is one miss per window, which this count does not
    always tell apart.)"""
    block, blocks = 1 << 20, 64
    data = random.Random(24).randbytes(blocks * block - 1234)
    make_source(tmp_path / "src", {"long.bin": data})
    worker = WorkerProcess(
        str(tmp_path / "w"), ram="128MiB", extra_args=("--fuse-fast-read", fast_read)
    ).start()
    try:
        worker.add_dataset("ds", f"file://{tmp_path / 'src'}", block_size=block)
        assert read_whole(worker.path("ds", "long.bin")) == data
        reads = worker.status()["reads"]
        # Every block but block 0 fetched ahead once (each a store read of its own); at most
        # two on demand besides (a READ that straddles into the block after the one fetched
        # when the window opens).
        assert blocks - 3 <= reads["readahead_blocks"] <= blocks - 1, reads
        if fast_read == "on":
            assert native_stats(worker)["reads"] > 0
    finally:
        worker.stop()


def test_a_refreshed_file_is_never_served_from_its_old_blocks(tmp_path, fast_read):
    source = tmp_path / "src"
    make_source(source, {"changing.bin": b"old!" * 30_000, "stable.bin": b"s" * 70_000})
    worker = WorkerProcess(str(tmp_path / "w"), extra_args=("--fuse-fast-read", fast_read)).start()
    try:
        worker.add_dataset("ds", f"file://{source}", block_size=BLOCK)
        path = worker.path("ds", "changing.bin")
        assert read_whole(path) == b"old!" * 30_000
        drop_pages_keep_dentries()
        assert read_whole(path) == b"old!" * 30_000  # now from the table, when on
        (source / "changing.bin").write_bytes(b"NEW." * 40_000)
        assert worker.client.refresh_dataset("ds")["changed"] == 1
        drop_pages_keep_dentries()
        assert read_whole(path) == b"NEW." * 40_000
        assert read_whole(worker.path("ds", "stable.bin")) == b"s" * 70_000
    finally:
        worker.cleanup()


def worker_fds(pid: int) -> list[str]:
    fd_dir = f"/proc/{pid}/fd"
    targets = []
    for name in os.listdir(fd_dir):
        try:
            targets.append(os.readlink(os.path.join(fd_dir, name)))
        except FileNotFoundError:
            pass
    return targets


@pytest.fixture
def own_tmpfs(tmp_path):
    """A tmpfs of its own for the RAM tier: its statvfs counts exactly what the tier holds,
    files open but unlinked included (a ``du`` walk racing with evictions and admissions can
    count a file twice, and never sees unlinked ones)."""
    path = tmp_path / "ram"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path)], check=True)
    yield str(path)
    subprocess.run(["umount", "-l", str(path)], check=False)


def tmpfs_used(path: str) -> int:
    stats = os.statvfs(path)
    return (stats.f_blocks - stats.f_bfree) * stats.f_frsize


class ChurnOutcome:
    """What :func:`sixteen_readers_through_churn` saw."""

    def __init__(self) -> None:
        self.wrong: list[str] = []  # reads that returned bytes the source never held
        self.errors: list[str] = []  # reads that failed where none may
        self.reads_done = 0
        self.peak_in_tier = 0  # the most the tier's tmpfs held at any check
        self.peak_fds: dict[int, int] = {}  # the most descriptors of each pid at any check

    def check(self, worker: WorkerProcess, capacity: int, pids: list[int]) -> None:
        """Every byte right, no unexpected error, the tier within its capacity, no process
        holding a removed block file open."""
        assert not self.wrong, self.wrong[:5]
        assert not self.errors, self.errors[:5]
        assert self.reads_done > 500
        assert self.peak_in_tier <= capacity
        for pid in pids:
            deleted = [t for t in worker_fds(pid) if "(deleted)" in t and worker.ram_dir in t]
            assert not deleted, (pid, deleted)
        assert worker.status()["cache"]["evicted"] > 0


def sixteen_readers_through_churn(
    tmp_path, start: Callable[..., WorkerProcess], own_tmpfs: str
) -> tuple[WorkerProcess, ChurnOutcome, int]:
    """A 4 MiB RAM tier under LRU admission and ~9 MB of files: blocks are evicted all the
    time while 16 readers read (page cache dropped in between), one file is refreshed twice,
    and a second dataset is removed. ``start(**options)`` starts the worker; returns it (the
    caller checks and cleans it up), what the readers saw and the tier's capacity."""
    rng = random.Random(1616)
    versions = [b"A" * 150_000, b"B" * 170_000, b"C" * 90_000]  # the changing file, in turn
    main = {f"m/{i}.bin": rng.randbytes(rng.randint(50_000, 200_000)) for i in range(60)}
    other = {f"o/{i}.bin": rng.randbytes(rng.randint(50_000, 120_000)) for i in range(12)}
    make_source(tmp_path / "main", {**main, "changing.bin": versions[0]})
    make_source(tmp_path / "other", other)
    capacity = 4 << 20
    worker = start(ram="4MiB", admission="lru", ram_dir=own_tmpfs)
    pids = [worker.status()["pid"], *sorted((worker.status()["fuse_processes"] or {}).get(
        "pids", []))]  # fmt: skip
    outcome = ChurnOutcome()
    try:
        worker.add_dataset("main", f"file://{tmp_path / 'main'}", block_size=BLOCK)
        worker.add_dataset("other", f"file://{tmp_path / 'other'}", block_size=BLOCK)
        stop = threading.Event()

        def reader(seed: int) -> None:
            pick = random.Random(seed)
            while not stop.is_set():
                roll = pick.random()
                if roll < 0.1:
                    name, allowed = "changing.bin", versions
                    path = worker.path("main", name)
                elif roll < 0.3:
                    name = pick.choice(sorted(other))
                    path, allowed = worker.path("other", name), [other[name]]
                else:
                    name = pick.choice(sorted(main))
                    path, allowed = worker.path("main", name), [main[name]]
                try:
                    got = read_whole(path)
                except OSError as exc:
                    # Expected failures only: the changing file between its rewrite in the
                    # source and the refresh (EIO: the snapshot's version is gone from the
                    # store), and the removed dataset (its files vanish).
                    if not (name == "changing.bin" or "other" in path):
                        outcome.errors.append(f"{path}: {exc}")
                    continue
                if got not in allowed:
                    outcome.wrong.append(f"{path}: {len(got)} bytes, not the source's")
                outcome.reads_done += 1

        threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(16)]
        try:
            for thread in threads:
                thread.start()

            def churn(rounds: int) -> None:
                for _ in range(rounds):
                    target = outcome.reads_done + 40
                    wait_for(lambda t=target: outcome.reads_done >= t or stop.is_set(),
                             "40 more reads")  # fmt: skip
                    drop_pages_keep_dentries()
                    outcome.peak_in_tier = max(outcome.peak_in_tier, tmpfs_used(own_tmpfs))
                    for pid in pids:
                        fds = len(worker_fds(pid))
                        outcome.peak_fds[pid] = max(outcome.peak_fds.get(pid, 0), fds)

            churn(5)
            for version in versions[1:]:
                (tmp_path / "main" / "changing.bin").write_bytes(version)
                assert worker.client.refresh_dataset("main")["changed"] == 1
                churn(3)
            worker.client.remove_dataset("other")
            churn(5)
        finally:
            stop.set()
            for thread in threads:
                thread.join(WAIT_S)
    except BaseException:
        worker.cleanup()
        raise
    return worker, outcome, capacity


def test_sixteen_readers_through_eviction_refresh_and_removal_get_only_right_bytes(
    tmp_path, fast_read, own_tmpfs
):
    """:func:`sixteen_readers_through_churn`: every byte a reader gets is the source's; the
    memory the tier's tmpfs holds never exceeds its capacity; the worker's descriptors stay
    bounded and none is left on a removed block file. (The same with serving processes:
    tests/e2e/fs/test_serving_processes.py.)"""

    def start(**options) -> WorkerProcess:
        return WorkerProcess(
            str(tmp_path / "w"), extra_args=("--fuse-fast-read", fast_read), **options
        ).start()

    worker, outcome, capacity = sixteen_readers_through_churn(tmp_path, start, own_tmpfs)
    try:
        pid = worker.status()["pid"]
        outcome.check(worker, capacity, [pid])
        assert outcome.peak_fds[pid] < 400  # sockets, LMDB, /dev/fuse, the bounded table
        stats = native_stats(worker)
        if fast_read == "on":
            assert stats["reads"] > 0 and stats["corrupt"] == 0
    finally:
        worker.cleanup()


@pytest.mark.skipif(FAST_READ_SUPPORTED, reason="checks what a stock pyfuse3 says")
def test_a_stock_pyfuse3_says_once_that_every_read_is_served_in_python(tmp_path):
    make_source(tmp_path / "src", {"f.bin": b"x" * 1000})
    worker = WorkerProcess(str(tmp_path / "w")).start()
    try:
        worker.add_dataset("ds", f"file://{tmp_path / 'src'}")
        assert read_whole(worker.path("ds", "f.bin")) == b"x" * 1000
        assert worker.status()["fuse_fast_read"] is None
        assert worker.log().count("every READ is served in Python") == 1
    finally:
        worker.cleanup()


@pytest.mark.skipif(not FAST_READ_SUPPORTED, reason="needs the patched pyfuse3 (scripts/setup.sh)")
def test_block_files_stay_open_between_reads_within_a_bound_and_close_before_removal(tmp_path):
    """The native path keeps block files open for their next READs, at most a quarter of the
    worker's fd limit of them (here lowered to 256 before the first READ: 64), and closes
    them before the cache removes the files (no descriptor of a removed block survives)."""
    files = {f"f{i:03d}.bin": bytes([i]) * 9000 for i in range(100)}
    make_source(tmp_path / "src", files)
    worker = WorkerProcess(str(tmp_path / "w")).start()
    try:
        pid = worker.status()["pid"]
        _soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (256, hard))
        worker.add_dataset("ds", f"file://{tmp_path / 'src'}")
        paths = {name: worker.path("ds", name) for name in files}
        for name, path in paths.items():  # first reads: Python, which fills the RAM tier
            assert read_whole(path) == files[name]
        drop_pages_keep_dentries()
        for name, path in paths.items():  # now answered in C, each opening its block file
            assert read_whole(path) == files[name]
        stats = native_stats(worker)
        assert stats["reads"] >= len(files)
        assert 0 < stats["open_files"] <= 64
        in_tier = [t for t in worker_fds(pid) if worker.ram_dir in t]
        assert len(in_tier) == stats["open_files"]

        worker.client.remove_dataset("ds")
        assert native_stats(worker)["open_files"] == 0
        assert not [t for t in worker_fds(pid) if worker.ram_dir in t]
    finally:
        worker.cleanup()
