"""What the kernel keeps so that requests never reach Python: directory listings (the pyfuse3
patch's FOPEN_CACHE_DIR, invalidated by a refresh that changes a directory), "no extended
attributes" (ENOSYS, remembered for the mount), and the first read of a listed file costing one
READ and nothing else. Real worker processes and mounts; FUSE requests counted by the worker's
own per-operation metrics and the native path's counters."""

from __future__ import annotations

import os
import subprocess

import pytest

from cachefs.fs.fuse_ops import FAST_READ_SUPPORTED
from cachefs.mountpoint import FUSE_CONNECTIONS
from tests.e2e.fs.test_native_reads import drop_pages_keep_dentries, make_source, native_stats
from tests.e2e.fs.test_no_open import fuse_op_count
from tests.worker_process import WorkerProcess, drop_page_cache

needs_patch = pytest.mark.skipif(
    not FAST_READ_SUPPORTED, reason="stock pyfuse3: run scripts/setup.sh to build the patched one"
)


@pytest.fixture
def worker(tmp_path):
    make_source(
        tmp_path / "src",
        {f"c{c}/f{i}.bin": bytes([c, i]) * 5000 for c in range(3) for i in range(20)},
    )
    worker = WorkerProcess(str(tmp_path / "w")).start()
    worker.add_dataset("ds", f"file://{tmp_path / 'src'}")
    yield worker
    worker.cleanup()


def fuse_errors(worker: WorkerProcess) -> int:
    return sum(
        int(float(line.split()[-1]))
        for line in worker.client.metrics().splitlines()
        if line.startswith("cachefs_fuse_errors_total")
    )


@needs_patch
def test_warm_listings_stay_in_the_kernel_and_a_refresh_shows_changes(worker, tmp_path):
    directory = worker.path("ds", "c1")
    assert sorted(os.listdir(directory)) == sorted(f"f{i}.bin" for i in range(20))
    assert len(os.listdir(worker.path("ds", "c2"))) == 20
    listings = fuse_op_count(worker, "readdir")
    for _ in range(3):
        assert len(os.listdir(directory)) == 20
    assert fuse_op_count(worker, "readdir") == listings  # kept by the kernel

    (tmp_path / "src" / "c1" / "new.bin").write_bytes(b"n")
    os.unlink(tmp_path / "src" / "c1" / "f0.bin")
    result = worker.client.refresh_dataset("ds")
    assert result["removed"] == 1
    names = os.listdir(directory)
    assert "new.bin" in names and "f0.bin" not in names and len(names) == 20
    with open(os.path.join(directory, "new.bin"), "rb") as f:
        assert f.read() == b"n"
    # A directory the refresh did not change keeps its cached listing.
    others = fuse_op_count(worker, "readdir")
    assert len(os.listdir(worker.path("ds", "c2"))) == 20
    assert fuse_op_count(worker, "readdir") == others


def test_extended_attributes_are_refused_once_for_the_whole_mount(worker):
    for i in range(20):
        path = worker.path("ds", "c0", f"f{i}.bin")
        with pytest.raises(OSError) as info:
            os.getxattr(path, "security.selinux")
        assert info.value.errno == 95  # EOPNOTSUPP
        with pytest.raises(OSError):
            os.listxattr(path)
    # ENOSYS answered at most once per call kind; the kernel answered the rest itself.
    assert fuse_errors(worker) <= 2


@needs_patch
def test_the_connection_lets_many_readahead_reads_be_in_flight(worker):
    """The kernel's own view of the connection (/sys/fs/fuse/connections/N, N the mount's
    device minor): the patch raised libfuse's 12 READs in flight, which 16 readers exceed
    (congested, the kernel drops its readahead and reads a page at a time)."""
    if not os.path.ismount(FUSE_CONNECTIONS):  # systemd mounts it at boot; containers may not
        subprocess.run(["mount", "-t", "fusectl", "fusectl", FUSE_CONNECTIONS], check=True)
    connection = f"{FUSE_CONNECTIONS}/{os.minor(os.stat(worker.mount).st_dev)}"
    with open(f"{connection}/max_background") as f:
        assert int(f.read()) == 256
    with open(f"{connection}/congestion_threshold") as f:
        assert int(f.read()) == 192


@needs_patch
def test_the_first_read_of_a_listed_file_is_one_read_and_nothing_else(worker):
    paths = [worker.path("ds", "c2", f"f{i}.bin") for i in range(20)]
    for path in paths:  # cached in the RAM tier; dentries and attributes in the kernel
        with open(path, "rb") as f:
            assert f.read() == bytes([2, paths.index(path)]) * 5000
    drop_pages_keep_dentries()
    ops = ("lookup", "getattr", "open", "read", "readdir")
    before = {op: fuse_op_count(worker, op) for op in ops}
    native_before = native_stats(worker)["reads"]
    for i, path in enumerate(paths):
        with open(path, "rb") as f:
            assert f.read() == bytes([2, i]) * 5000
    assert {op: fuse_op_count(worker, op) for op in ops} == before  # nothing reached Python
    assert native_stats(worker)["reads"] - native_before == len(paths)  # one READ per file


@needs_patch
def test_names_looked_up_before_are_answered_in_c_after_the_kernel_drops_its_dentries(
    worker, tmp_path
):
    """`echo 3` drops the kernel's dentries: the next open of each file sends LOOKUPs again.
    The replies cachefs gave are remembered in the binding and answered there; a refresh
    forgets the dataset's, so a removed file is gone and a changed one has its new size."""
    paths = {i: worker.path("ds", "c0", f"f{i}.bin") for i in range(20)}
    for i, path in paths.items():  # LOOKUPs answered in Python, remembered
        with open(path, "rb") as f:
            assert f.read() == bytes([0, i]) * 5000
    drop_page_cache()  # echo 3: pages, dentries and inodes
    python_lookups = fuse_op_count(worker, "lookup")
    native_before = native_stats(worker)
    for i, path in paths.items():
        with open(path, "rb") as f:
            assert f.read() == bytes([0, i]) * 5000
    native_after = native_stats(worker)
    assert native_after["lookups"] - native_before["lookups"] >= len(paths)  # + "c0"
    # Only the dataset itself, under the mount root, is looked up in Python.
    assert fuse_op_count(worker, "lookup") - python_lookups <= 1

    os.unlink(tmp_path / "src" / "c0" / "f1.bin")
    (tmp_path / "src" / "c0" / "f2.bin").write_bytes(b"longer now" * 2000)
    worker.client.refresh_dataset("ds")
    drop_page_cache()
    assert not os.path.exists(paths[1])
    assert os.stat(paths[2]).st_size == 20_000
    with open(paths[2], "rb") as f:
        assert f.read() == b"longer now" * 2000


@needs_patch
def test_no_listing_the_kernel_keeps_outlives_a_removed_dataset_or_directory(worker, tmp_path):
    """The root's listing after `dataset rm` even when the kernel had dropped the dataset's
    dentry; a directory a refresh removed, held open by a process, lists none of its old
    entries; a dataset that comes back by a refresh is listed again."""
    assert "ds" in os.listdir(worker.mount)
    held = os.open(worker.path("ds", "c1"), os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert len(os.listdir(held)) == 20  # now kept by the kernel
        for name in os.listdir(tmp_path / "src" / "c1"):
            os.unlink(tmp_path / "src" / "c1" / name)
        os.rmdir(tmp_path / "src" / "c1")
        worker.client.refresh_dataset("ds")
        try:
            assert os.listdir(held) == []
        except FileNotFoundError:
            pass  # the directory is gone: also right
        assert sorted(os.listdir(worker.path("ds"))) == ["c0", "c2"]
    finally:
        os.close(held)

    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2\n")  # dentries and inodes, not the root's cached listing (pinned)
    worker.client.remove_dataset("ds")
    assert "ds" not in os.listdir(worker.mount)


def python_listing_of(tmp_path, root: str) -> dict[str, tuple[int, int, int]]:
    """The same tree as another worker without the native path lists it (every READDIRPLUS
    in Python): the reference the native listings must equal."""
    reference = WorkerProcess(str(tmp_path / "reference"), extra_args=("--fuse-fast-read", "off"))
    reference.start()
    try:
        reference.add_dataset("ds", f"file://{tmp_path / 'src'}")
        return listing_of(reference.path("ds"))
    finally:
        reference.cleanup()


def listing_of(root: str) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``root`` as scandir + lstat see it: relative path -> mode, size, mtime."""
    seen = {}
    for directory, _dirs, files in os.walk(root):
        for name in [*_dirs, *files]:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            seen[os.path.relpath(path, root)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return seen


@needs_patch
def test_cold_listings_are_answered_in_c_with_the_same_entries_and_a_refresh_shows_changes(
    tmp_path,
):
    """A directory opened or listed from the start is registered whole in the binding (cachefs
    packs it when the binding asks), and its OPENDIR and READDIRPLUS requests are answered in
    C, every page of a directory too large for one reply resumed at the offset it gave, with
    exactly the entries and attributes the Python path gives; after `echo 3` (dentries, inodes
    and the kernel's kept listings dropped) still in C; a refresh forgets the dataset's
    listings, so an added and a removed file show."""
    files = {f"big/f{i:04d}-{'x' * (i % 40)}.bin": bytes([i % 256]) * (i % 7) for i in range(700)}
    files |= {f"small/s{i}.bin": b"s" * i for i in range(5)}
    make_source(tmp_path / "src", files)
    worker = WorkerProcess(str(tmp_path / "w")).start()
    try:
        worker.add_dataset("ds", f"file://{tmp_path / 'src'}")
        root = worker.path("ds")
        python_listings = fuse_op_count(worker, "readdir")
        first = listing_of(root)  # packed by cachefs, answered in C
        assert len(first) == len(files) + 2
        assert first["big/f0003-xxx.bin"][1] == 3
        assert fuse_op_count(worker, "readdir") == python_listings
        assert first == python_listing_of(tmp_path, root)

        drop_page_cache()
        python_listings = fuse_op_count(worker, "readdir")
        native_before = native_stats(worker)["readdirs"]
        assert listing_of(root) == first
        assert native_stats(worker)["readdirs"] - native_before >= 3  # big needs several pages
        assert fuse_op_count(worker, "readdir") - python_listings <= 1  # the dataset's root

        os.unlink(tmp_path / "src" / "big" / "f0001-x.bin")
        (tmp_path / "src" / "big" / "new.bin").write_bytes(b"n" * 11)
        worker.client.refresh_dataset("ds")
        drop_page_cache()
        after = listing_of(root)
        assert "big/f0001-x.bin" not in after
        assert after["big/new.bin"][1] == 11
        assert len(after) == len(first)
    finally:
        worker.cleanup()


@pytest.mark.parametrize("no_open", ["on", "off"])
def test_a_file_held_open_across_a_refresh_never_mixes_versions_with_a_new_open(tmp_path, no_open):
    """A reader holds changing.bin open (version A) while a refresh replaces it with version B,
    and goes on reading after it; then another process opens the file. The changed file has a
    new inode, so the two never share the kernel's page cache: the old reader gets A (every
    block of A is cached) and the new one B, whole, in both FUSE open modes."""
    if no_open == "on" and not FAST_READ_SUPPORTED:
        pytest.skip("no-open mode needs the patched pyfuse3 (scripts/setup.sh)")
    block = 256 << 10
    version_a, version_b = b"A" * (4 * block), b"B" * (3 * block + 1234)
    make_source(tmp_path / "src", {"changing.bin": version_a})
    worker = WorkerProcess(str(tmp_path / "w"), extra_args=("--fuse-no-open", no_open)).start()
    try:
        worker.add_dataset("ds", f"file://{tmp_path / 'src'}", block_size=block)
        path = worker.path("ds", "changing.bin")
        with open(path, "rb", buffering=0) as whole:
            assert whole.read() == version_a  # every block of A is in the cache now
        old_ino = os.stat(path).st_ino
        drop_pages_keep_dentries()
        with open(path, "rb", buffering=0) as held:
            first = held.read(4096)
            (tmp_path / "src" / "changing.bin").write_bytes(version_b)
            assert worker.client.refresh_dataset("ds")["changed"] == 1
            rest = held.read()  # fills the old inode's pages with A
            with open(path, "rb", buffering=0) as fresh:
                assert fresh.read() == version_b
            assert first + rest == version_a
        assert os.stat(path).st_ino != old_ino
        drop_pages_keep_dentries()
        with open(path, "rb", buffering=0) as again:
            assert again.read() == version_b
    finally:
        worker.cleanup()
