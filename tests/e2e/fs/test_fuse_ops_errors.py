"""Every error the FUSE adapter answers passes its one table (cachefs.fs.fuse_ops.ERRNO_BY_ERROR)
and is counted by errno in cachefs_fuse_errors_total.

Each handler is called directly, over a FileSystem with no dataset: a read-only mount with
default_permissions never sends most of them (the kernel refuses a write with EROFS itself and
checks access() on its own), so a mount cannot reach them. The answers a mount does reach are
then checked through a real worker and mount: the errno the reader gets and the counter."""

from __future__ import annotations

import errno
import os

import pyfuse3
import pytest

from cachefs.errors import CachefsError
from cachefs.fs.core import MOUNT_ROOT, SLOT_SHIFT, FileSystem
from cachefs.fs.fuse_ops import ERRNO_BY_ERROR, NO_OPEN_SUPPORTED, FuseOperations
from cachefs.metrics import WorkerMetrics
from tests.e2e.fs.test_native_reads import make_source
from tests.worker_process import WorkerProcess

NO_SUCH_INODE = (7 << SLOT_SHIFT) | 2  # in a slot no dataset holds
CTX = None  # no handler below reads the request context


def adapter() -> FuseOperations:
    # No block reader: none of these requests gets as far as reading a block.
    return FuseOperations(FileSystem(reader=None), WorkerMetrics(), no_open=False)


# (handler, its arguments, the errno the kernel must get)
FAILING_CALLS = [
    ("lookup", (MOUNT_ROOT, b"no-such-dataset", CTX), errno.ENOENT),
    ("getattr", (NO_SUCH_INODE, CTX), errno.ENOENT),
    ("opendir", (NO_SUCH_INODE, CTX), errno.ENOENT),
    ("readdir", (NO_SUCH_INODE, 0, None), errno.ENOENT),
    ("open", (MOUNT_ROOT, os.O_RDONLY, CTX), errno.EISDIR),
    ("open", (NO_SUCH_INODE, os.O_WRONLY, CTX), errno.EROFS),
    ("read", (12345, 0, 4096), errno.EBADF),
    ("getxattr", (MOUNT_ROOT, b"security.selinux", CTX), errno.ENOSYS),
    ("listxattr", (MOUNT_ROOT, CTX), errno.ENOSYS),
    ("access", (MOUNT_ROOT, os.W_OK, CTX), errno.EROFS),
    ("readlink", (MOUNT_ROOT, CTX), errno.EINVAL),
    # Every write operation.
    ("setattr", (MOUNT_ROOT, None, None, None, CTX), errno.EROFS),
    ("mknod", (MOUNT_ROOT, b"n", 0o644, 0, CTX), errno.EROFS),
    ("mkdir", (MOUNT_ROOT, b"d", 0o755, CTX), errno.EROFS),
    ("unlink", (MOUNT_ROOT, b"n", CTX), errno.EROFS),
    ("rmdir", (MOUNT_ROOT, b"d", CTX), errno.EROFS),
    ("symlink", (MOUNT_ROOT, b"l", b"t", CTX), errno.EROFS),
    ("rename", (MOUNT_ROOT, b"a", MOUNT_ROOT, b"b", 0, CTX), errno.EROFS),
    ("link", (MOUNT_ROOT, MOUNT_ROOT, b"l", CTX), errno.EROFS),
    ("create", (MOUNT_ROOT, b"n", 0o644, os.O_WRONLY, CTX), errno.EROFS),
    ("write", (1, 0, b"x"), errno.EROFS),
    ("setxattr", (MOUNT_ROOT, b"user.x", b"1", CTX), errno.EROFS),
    ("removexattr", (MOUNT_ROOT, b"user.x", CTX), errno.EROFS),
    ("fsync", (1, False), errno.EROFS),
    ("fsyncdir", (1, False), errno.EROFS),
]


@pytest.mark.parametrize(
    ("handler", "args", "code"), FAILING_CALLS, ids=[f"{h}-{c}" for h, _, c in FAILING_CALLS]
)
async def test_each_handler_answers_its_errno_through_the_table_and_counts_it(handler, args, code):
    ops = adapter()
    with pytest.raises(pyfuse3.FUSEError) as caught:
        await getattr(ops, handler)(*args)
    assert caught.value.errno == code
    # Counted under its name: the error went through FuseOperations._fail.
    assert ops.metrics.fuse_errors == {errno.errorcode[code]: 1}
    # And the errno is one the table gives (EIO is the answer to what the table does not know).
    assert code in {table_code for _, table_code in ERRNO_BY_ERROR}


async def test_reading_is_allowed_and_an_unknown_error_is_eio():
    ops = adapter()
    assert await ops.access(MOUNT_ROOT, os.R_OK, CTX) is True
    assert ops.metrics.fuse_errors == {}
    # An error the table does not list: EIO, counted.

    def broken_lookup(parent: int, name: bytes) -> None:
        raise CachefsError("the snapshot is broken")

    ops.fs.lookup = broken_lookup
    with pytest.raises(pyfuse3.FUSEError) as caught:
        await ops.lookup(MOUNT_ROOT, b"x", CTX)
    assert caught.value.errno == errno.EIO
    assert ops.metrics.fuse_errors == {"EIO": 1}


def errors_by_name(worker: WorkerProcess) -> dict[str, int]:
    counts = {}
    for line in worker.client.metrics().splitlines():
        if line.startswith("cachefs_fuse_errors_total{"):
            name = line.split('errno="', 1)[1].split('"', 1)[0]
            counts[name] = int(float(line.split()[-1]))
    return counts


@pytest.fixture
def worker(tmp_path):
    make_source(tmp_path / "src", {"d/a.bin": b"a" * 5000, "d/b.bin": b"b" * 7000})
    worker = WorkerProcess(str(tmp_path / "w")).start()
    worker.add_dataset("ds", f"file://{tmp_path / 'src'}")
    yield worker
    worker.cleanup()


def test_the_answers_a_mount_reaches_arrive_and_are_counted(worker):
    with pytest.raises(FileNotFoundError):
        os.stat(worker.path("ds", "d", "missing.bin"))  # LOOKUP: ENOENT
    with pytest.raises(OSError) as caught:
        os.getxattr(worker.path("ds", "d", "a.bin"), "user.x")
    assert caught.value.errno == errno.EOPNOTSUPP  # the kernel's word for our ENOSYS
    with pytest.raises(OSError) as caught:
        os.listxattr(worker.path("ds", "d", "a.bin"))
    assert caught.value.errno == errno.EOPNOTSUPP
    errors = errors_by_name(worker)
    assert errors.get("ENOENT", 0) >= 1
    assert errors.get("ENOSYS") == 2  # once each: the kernel then answers xattrs itself
    for _ in range(3):
        with pytest.raises(OSError):
            os.getxattr(worker.path("ds", "d", "b.bin"), "user.x")
    assert errors_by_name(worker).get("ENOSYS") == 2


@pytest.mark.skipif(not NO_OPEN_SUPPORTED, reason="stock pyfuse3: no no-open mode")
def test_no_open_modes_one_enosys_open_is_counted_once(worker):
    assert worker.status()["fuse_no_open"] is True
    before = errors_by_name(worker).get("ENOSYS", 0)
    for name, size in (("a.bin", 5000), ("b.bin", 7000), ("a.bin", 5000)):
        with open(worker.path("ds", "d", name), "rb") as f:
            assert len(f.read()) == size
    assert errors_by_name(worker).get("ENOSYS", 0) == before + 1
