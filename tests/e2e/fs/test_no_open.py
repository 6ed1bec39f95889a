"""FUSE no-open mode (needs the patched pyfuse3 that scripts/setup.sh builds from
third_party/pyfuse3): the kernel stops sending OPEN and RELEASE, keeps the page cache across
opens, and read() is given the inode. Real worker processes and mounts, both modes side by side."""

from __future__ import annotations

import os
import random

import pytest

from cachefs.fs.fuse_ops import NO_OPEN_SUPPORTED
from tests.worker_process import WorkerProcess, drop_page_cache

pytestmark = pytest.mark.skipif(
    not NO_OPEN_SUPPORTED, reason="stock pyfuse3: run scripts/setup.sh to build the patched one"
)


def fuse_op_count(worker: WorkerProcess, op: str) -> int:
    for line in worker.client.metrics().splitlines():
        if line.startswith(f'cachefs_fuse_op_seconds_count{{op="{op}"}}'):
            return int(float(line.split()[-1]))
    return 0


@pytest.mark.parametrize("mode", ["on", "off"])
def test_reads_are_byte_exact_and_opens_stop_reaching_the_worker(tmp_path, mode):
    rng = random.Random(9)
    source = tmp_path / "src"
    (source / "d").mkdir(parents=True)
    files = {f"d/f{i}.bin": rng.randbytes(rng.randint(0, 300_000)) for i in range(30)}
    for name, data in files.items():
        (source / name).write_bytes(data)
    worker = WorkerProcess(str(tmp_path / mode), extra_args=("--fuse-no-open", mode)).start()
    try:
        assert worker.status()["fuse_no_open"] is (mode == "on")
        worker.add_dataset("ds", f"file://{source}", block_size=64 * 1024)
        for _ in range(3):
            for name, data in files.items():
                with open(worker.path("ds", name), "rb") as f:
                    assert f.read() == data
                    assert os.pread(f.fileno(), 100, 70_000) == data[70_000:70_100]
            drop_page_cache()
        opens = fuse_op_count(worker, "open")
        if mode == "on":
            assert opens == 1  # answered ENOSYS once; the kernel never asked again
        else:
            assert opens == 3 * len(files)
        with pytest.raises(OSError) as info:
            os.open(worker.path("ds", "d/f0.bin"), os.O_WRONLY)
        assert info.value.errno == 30  # EROFS, from the read-only mount
    finally:
        worker.cleanup()
