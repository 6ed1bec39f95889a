"""Worker process settings that the kernel holds: readahead of the mount (applied after FUSE
INIT, which would otherwise reset it to 128 KiB), the clean unmount on SIGTERM, and the worker
stopping when its mount is unmounted from outside."""

from __future__ import annotations

import os
import signal
import subprocess

from tests.waiting import WAIT_S
from tests.worker_process import WorkerProcess


def mount_readahead_kib(mount: str) -> int:
    with open("/proc/self/mountinfo") as mountinfo:
        device = [line.split()[2] for line in mountinfo if line.split()[4] == mount][-1]
    with open(f"/sys/class/bdi/{device}/read_ahead_kb") as f:
        return int(f.read())


def test_readahead_is_applied_after_init_and_configurable(tmp_path):
    default = WorkerProcess(str(tmp_path / "a")).start()
    custom = WorkerProcess(str(tmp_path / "b"), extra_args=("--readahead", "256KiB")).start()
    try:
        # 1 MiB by default, or the largest READ where the patched binding lowered it (splice
        # pipes of less than 1 MiB: no CAP_SYS_RESOURCE; tests/e2e/fs/test_native_reads.py).
        largest_read = (default.status()["fuse_fast_read"] or {}).get("max_read", 0)
        expected = min(1024, largest_read // 1024) if largest_read else 1024
        assert mount_readahead_kib(os.path.realpath(default.mount)) == expected
        assert mount_readahead_kib(os.path.realpath(custom.mount)) == 256
        # Serving, the garbage collector is tuned (cachefs/worker.py tune_gc).
        tuned = default.status()["gc"]
        assert tuned["frozen_objects"] > 10_000  # the modules, parsers, clients of a worker
    finally:
        default.cleanup()
        custom.cleanup()


def test_sigterm_unmounts_cleanly_and_keeps_state(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "f").write_bytes(b"kept")
    worker = WorkerProcess(str(tmp_path / "w")).start()
    try:
        worker.add_dataset("d", f"file://{source}")
        with open(worker.path("d", "f"), "rb") as f:
            assert f.read() == b"kept"
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(timeout=30) == 0
        assert not os.path.ismount(worker.mount)
        worker.proc = None
        worker.start()
        with open(worker.path("d", "f"), "rb") as f:
            assert f.read() == b"kept"
        assert worker.status()["reads"]["misses"] == 0  # served from the kept RAM tier
    finally:
        worker.cleanup()


def test_an_unmount_from_outside_stops_the_worker_after_reads_served_in_python(tmp_path):
    """`umount` of the mount by someone else ends the FUSE session, and with it the worker
    (exit status 0, nothing left mounted), also after READs that went to Python, after which a
    session task polls /dev/fuse before it reads: an ended connection must count as ready
    there, or the task waits and polls for ever (a patched loop once did, at 100 % CPU)."""
    source = tmp_path / "src"
    source.mkdir()
    files = {f"f{i}": os.urandom(50_000) for i in range(20)}
    for name, data in files.items():
        (source / name).write_bytes(data)
    worker = WorkerProcess(str(tmp_path / "w")).start()
    try:
        worker.add_dataset("d", f"file://{source}")
        for name, data in files.items():  # cold: every READ served in Python
            with open(worker.path("d", name), "rb") as f:
                assert f.read() == data
        subprocess.run(["umount", worker.mount], check=True)
        assert worker.proc.wait(timeout=WAIT_S) == 0
        assert not os.path.ismount(worker.mount)
        worker.proc = None
    finally:
        worker.cleanup()


def test_metrics_are_served_over_tcp_for_prometheus(tmp_path):
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = WorkerProcess(str(tmp_path), extra_args=("--metrics", f"127.0.0.1:{port}")).start()
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert 'cachefs_tier_capacity_bytes{tier="ram"}' in text
        assert httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=10).status_code == 404
    finally:
        worker.cleanup()
