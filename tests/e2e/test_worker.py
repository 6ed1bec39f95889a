"""Worker process settings that the kernel holds: readahead of the mount (applied after FUSE
INIT, which would otherwise reset it to 128 KiB) and the clean unmount on SIGTERM."""

from __future__ import annotations

import os
import signal

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
