"""Unattended restart (cachefs/mountpoint.py): a worker killed with SIGKILL, as the OOM killer
does it, leaves a dead FUSE mount (its readers get ENOTCONN); a plain restart of the same
command clears it and serves again, warm: not one store GET for a block it had cached. A mount
that a live worker serves is still refused, with one line.

Everything is real: `cachefs up` / `cachefs worker` processes with FUSE mounts, a coordinator, a
moto S3 endpoint behind the fault proxy (which counts the store's GETs), and a helper process
that keeps a killed worker's /dev/fuse descriptor open (the "held but not served" connection).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import uuid

import pytest

from cachefs.errors import ConfigError
from cachefs.host import mounts_at
from cachefs.mountpoint import FUSE_CONNECTIONS, MOUNT_RECORD, _detach
from tests.cluster_process import Cluster, read_all
from tests.waiting import WAIT_S, wait_for
from tests.worker_process import (
    REPO_ROOT,
    WorkerProcess,
    drop_page_cache,
    force_unmount,
    live_process_group,
    start_s3_world,
)

BLOCK = 256 << 10


def _files() -> dict[str, bytes]:
    rng = random.Random(15)
    files = {f"train/img-{i}.jpg": rng.randbytes(rng.randint(1, 90_000)) for i in range(20)}
    files["train/shard.tfrecord"] = rng.randbytes(3 * BLOCK + 777)  # 4 blocks
    return files


def _object_gets(proxy, bucket: str, name: str) -> int:
    """GETs of the dataset's objects (block fetches), not listings."""
    return proxy.count("GET", path_contains=f"{bucket}/{name}/")


def _mount_is_dead(path: str) -> bool:
    try:
        os.statvfs(path)
    except OSError as exc:
        return exc.errno == errno.ENOTCONN
    return False


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cachefs", *args],
        env={**os.environ, "PYTHONPATH": REPO_ROOT, **(env or {})},
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )


def test_kill9_of_cachefs_up_then_plain_restart_serves_warm(moto_s3, fault_proxy, tmp_path):
    world = start_s3_world(moto_s3, fault_proxy, str(tmp_path), _files(), block_size=BLOCK)
    worker = world.worker
    try:
        assert read_all(worker.mount, world.objects) == []  # cached now
        worker.crash()
        assert _mount_is_dead(worker.mount)  # what a reader sees: ENOTCONN
        assert os.path.exists(os.path.join(worker.state, MOUNT_RECORD))

        fault_proxy.reset_counts()
        worker.start()  # the same command line as the first start
        assert "clearing the FUSE mount" in worker.log()
        assert len(mounts_at(os.path.realpath(worker.mount))) == 1  # replaced, not stacked
        drop_page_cache()
        assert read_all(worker.mount, world.objects) == []  # byte for byte
        assert _object_gets(fault_proxy, world.bucket, world.name) == 0
        assert worker.status()["reads"]["misses"] == 0

        worker.stop()  # a clean stop forgets its mount: nothing for the next start to clear
        assert not os.path.exists(os.path.join(worker.state, MOUNT_RECORD))
    finally:
        worker.cleanup()


def test_kill9_then_plain_restart_through_a_symlinked_mount_serves_warm(
    moto_s3, fault_proxy, tmp_path
):
    """--mount names a symlink to the mountpoint. The kernel lists the mount under the
    symlink's target, so that is where the worker records it and the next start looks for it
    (without a stat through the symlink, which would enter the dead mount)."""
    bucket = moto_s3.make_bucket(f"cachefs-{uuid.uuid4().hex[:12]}")
    files = _files()
    for key, data in files.items():
        moto_s3.put(bucket, f"ds/{key}", data)
    real = tmp_path / "mnt"
    real.mkdir()
    link = tmp_path / "mnt-link"
    link.symlink_to(real)
    # The last --mount wins: every start of the worker is given the symlink, while the helper
    # waits for the mount on, reads through and cleans up the real directory.
    worker = WorkerProcess(str(tmp_path), env=moto_s3.env, extra_args=("--mount", str(link)))
    assert worker.mount == str(real)
    try:
        worker.start()
        worker.add_dataset("ds", f"s3://{bucket}/ds", endpoint=fault_proxy.url, block_size=BLOCK)
        assert read_all(worker.mount, files) == []  # cached now
        with open(os.path.join(worker.state, MOUNT_RECORD)) as f:
            assert json.load(f)["path"] == str(real)
        worker.crash()
        assert _mount_is_dead(str(link))

        fault_proxy.reset_counts()
        worker.start()  # the same command line, the symlink included
        assert "clearing the FUSE mount" in worker.log()
        assert len(mounts_at(str(real))) == 1  # replaced, not stacked
        drop_page_cache()
        assert read_all(str(link), files) == []  # byte for byte
        assert _object_gets(fault_proxy, bucket, "ds") == 0
        assert worker.status()["reads"]["misses"] == 0
    finally:
        worker.cleanup()
    assert mounts_at(str(real)) == [] and link.is_symlink()


def test_kill9_of_a_cluster_worker_then_plain_restart_serves_warm(moto_s3, fault_proxy, tmp_path):
    bucket = moto_s3.make_bucket(f"cachefs-{uuid.uuid4().hex[:12]}")
    files = _files()
    for key, data in files.items():
        moto_s3.put(bucket, f"ds/{key}", data)
    cluster = Cluster(str(tmp_path / "cluster"), 1, env=moto_s3.env).start()
    try:
        cluster.add_dataset("ds", f"s3://{bucket}/ds", endpoint=fault_proxy.url, block_size=BLOCK)
        assert cluster.preload("ds")["state"] == "completed"
        worker = cluster.workers[0]
        worker.crash()
        assert _mount_is_dead(worker.mount)

        fault_proxy.reset_counts()
        worker.start()
        wait_for(lambda: os.path.isdir(worker.path("ds")), "ds mounted again")
        drop_page_cache()
        assert read_all(worker.mount, files) == []
        assert _object_gets(fault_proxy, bucket, "ds") == 0
    finally:
        cluster.cleanup()


def test_a_mount_served_by_a_live_worker_is_refused_with_one_line(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "f").write_bytes(b"still served")
    first = WorkerProcess(str(tmp_path / "first")).start()
    try:
        first.add_dataset("d", f"file://{source}")
        # Another state directory, the same mountpoint: the mount answers, so it is refused.
        other = _cli("--state", str(tmp_path / "other"), "up", "--mount", first.mount)
        assert other.returncode == 1
        assert other.stderr.count("\n") == 1, other.stderr
        assert "is served by a running FUSE server" in other.stderr
        # The same state directory: its lock names the live worker.
        same = _cli("--state", first.state, "up", "--mount", str(tmp_path / "elsewhere"))
        assert same.returncode == 1
        assert same.stderr.count("\n") == 1, same.stderr
        assert f"another cachefs worker (pid {first.proc.pid})" in same.stderr
        assert "serving" not in other.stderr + same.stderr
        with open(first.path("d", "f"), "rb") as f:
            assert f.read() == b"still served"  # untouched
        assert first.proc.poll() is None
    finally:
        first.cleanup()


# Takes every /dev/fuse descriptor of a process (pidfd_getfd(2), Linux >= 5.6; root may): once
# that process is killed, its FUSE connection stays open but nobody reads it. Requests to it
# then wait for ever, and a statfs() never returns.
_HOLD_FUSE_FD = r"""
import ctypes, os, sys, time
pid = int(sys.argv[1])
fds = [int(fd) for fd in os.listdir(f"/proc/{pid}/fd")
       if os.readlink(f"/proc/{pid}/fd/{fd}") == "/dev/fuse"]
libc = ctypes.CDLL(None, use_errno=True)
pidfd = os.pidfd_open(pid)
for fd in fds:
    if libc.syscall(438, pidfd, fd, 0) < 0:  # SYS_pidfd_getfd
        sys.exit("pidfd_getfd: " + os.strerror(ctypes.get_errno()))
print(len(fds), flush=True)
time.sleep(3600)
"""


def _hold_fuse_connection(pid: int) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_FUSE_FD, str(pid)], stdout=subprocess.PIPE, text=True
    )
    held = holder.stdout.readline().strip()
    assert held.isdigit() and int(held) > 0, f"holder: {held!r}, rc {holder.poll()}"
    return holder


def _release(holder: subprocess.Popen) -> None:
    holder.kill()
    holder.wait(timeout=WAIT_S)


@pytest.mark.parametrize("recorded", [True, False], ids=["own-mount", "unknown-mount"])
def test_a_connection_held_open_but_not_served(tmp_path, recorded):
    """The killed worker's connection is kept open by another process, so its mount does not
    answer at all (not even ENOTCONN). The worker that recorded it (mount.json) is dead, since
    its state directory's lock is free: the next start aborts the connection through
    /sys/fs/fuse/connections and mounts again. A silent mount it did not record is refused:
    it may belong to a stopped server."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "f").write_bytes(b"back")
    worker = WorkerProcess(str(tmp_path / "w")).start()
    holder = None
    try:
        worker.add_dataset("d", f"file://{source}")
        holder = _hold_fuse_connection(worker.proc.pid)
        worker.crash()
        if recorded:
            worker.start()  # waits out the probe, aborts, clears, mounts
            assert "held open but not served: aborting it" in worker.log()
            with open(worker.path("d", "f"), "rb") as f:
                assert f.read() == b"back"
        else:
            os.unlink(os.path.join(worker.state, MOUNT_RECORD))
            refused = _cli("--state", worker.state, "up", "--mount", worker.mount, *worker.args)
            assert refused.returncode == 1
            assert refused.stderr.count("\n") == 1, refused.stderr
            assert "whose server does not answer" in refused.stderr
            assert "fusermount3 -uz" in refused.stderr
            assert os.path.isdir(FUSE_CONNECTIONS)
    finally:
        if holder is not None:
            _release(holder)  # its descriptor closes: the connection is aborted, if it was not
        worker.cleanup()
    assert mounts_at(os.path.realpath(worker.mount)) == []


def test_stale_lock_socket_and_record_of_a_killed_worker_do_not_block_a_restart(tmp_path):
    worker = WorkerProcess(str(tmp_path)).start()
    try:
        killed_pid = worker.proc.pid
        worker.crash()
        for left in ("worker.lock", "worker.sock", MOUNT_RECORD):
            assert os.path.exists(os.path.join(worker.state, left)), left
        with open(os.path.join(worker.state, MOUNT_RECORD)) as f:
            assert json.load(f)["pid"] == killed_pid
        status = _cli("--state", worker.state, "status")
        assert status.returncode == 1 and "no cachefs worker is running" in status.stderr
        worker.start()
        assert worker.status()["pid"] == worker.proc.pid != killed_pid
        with open(os.path.join(worker.state, "worker.lock")) as f:
            assert f.read() == str(worker.proc.pid)
        down = _cli("--state", worker.state, "down")
        assert down.returncode == 0, down.stderr
        # `down` returns once the worker has unmounted and let go of its state directory.
        assert mounts_at(os.path.realpath(worker.mount)) == []
        assert worker.proc.wait(timeout=WAIT_S) == 0
    finally:
        worker.cleanup()


def test_down_after_a_kill9_clears_the_dead_mount(tmp_path):
    worker = WorkerProcess(str(tmp_path)).start()
    try:
        worker.crash()
        assert _mount_is_dead(worker.mount)
        down = _cli("--state", worker.state, "down")
        assert down.returncode == 0, down.stderr
        assert down.stderr == (
            "cachefs: no worker running; cleared the dead mount it left at "
            f"{os.path.realpath(worker.mount)}\n"
        )
        assert mounts_at(os.path.realpath(worker.mount)) == []
        assert not os.path.exists(os.path.join(worker.state, MOUNT_RECORD))
        again = _cli("--state", worker.state, "down")
        assert again.stderr == "cachefs: no worker running\n"  # nothing left to clear
    finally:
        worker.cleanup()


def test_down_leaves_alone_a_later_mount_that_only_shares_the_killed_ones_ids(tmp_path):
    """Worker A is killed and its dead mount unmounted by hand, so A's mount.json stays; worker
    B (another state directory) mounts the same path. The kernel may give B's mount A's mount
    id and device again (lowest free first): written into A's record here, so that it surely
    happens. B then stops answering (SIGSTOP). `cachefs down --state A` must not take B's
    mount for A's: each mount has a name of its own (its fsname), and B's is not A's."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "f").write_bytes(b"B serves this")
    first = WorkerProcess(str(tmp_path / "a"))
    second = WorkerProcess(str(tmp_path / "b"))
    second.mount = first.mount
    try:
        first.start()
        first.crash()
        force_unmount(first.mount)  # by hand: the record stays
        record_path = os.path.join(first.state, MOUNT_RECORD)
        second.start()
        second.add_dataset("d", f"file://{source}")
        (mount,) = mounts_at(os.path.realpath(second.mount))
        with open(record_path) as f:
            record = json.load(f)
        assert record["source"] != mount.source  # names made for each mount
        assert record["source"].startswith("cachefs-") and mount.source.startswith("cachefs-")
        record.update(mount_id=mount.mount_id, device=mount.device)
        with open(record_path, "w") as f:
            json.dump(record, f)

        os.kill(second.proc.pid, signal.SIGSTOP)
        try:
            down = _cli("--state", first.state, "down")
        finally:
            os.kill(second.proc.pid, signal.SIGCONT)
        assert down.returncode == 0, down.stderr
        assert down.stderr == "cachefs: no worker running\n"  # nothing of A's to clear
        assert not os.path.exists(record_path)  # A's mount is gone: forgotten
        assert mounts_at(os.path.realpath(second.mount)) == [mount]
        with open(second.path("d", "f"), "rb") as f:
            assert f.read() == b"B serves this"
        assert second.proc.poll() is None
    finally:
        second.cleanup()
        first.cleanup()


def test_a_mount_that_cannot_be_cleared_is_refused_in_one_line(tmp_path, monkeypatch):
    """The unmount commands fail with two lines on stderr (as fusermount3 can): the error is
    still one line. Below a seam: the commands are stand-ins found first on PATH, run on a
    real tmpfs mount that they leave in place; the real commands clear real dead mounts in
    the tests above."""
    umount = shutil.which("umount")
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mountpoint)], check=True)
    try:
        stand_ins = tmp_path / "bin"
        stand_ins.mkdir()
        for name in ("umount", "fusermount3", "fusermount"):
            script = stand_ins / name
            script.write_text("#!/bin/sh\necho 'first line' >&2\necho 'second line' >&2\nexit 1\n")
            script.chmod(0o755)
        monkeypatch.setenv("PATH", str(stand_ins))
        (entry,) = mounts_at(str(mountpoint))
        with pytest.raises(ConfigError) as refused:
            _detach(entry, str(mountpoint))
        message = str(refused.value)
        assert "\n" not in message, message
        assert "umount: first line second line; fusermount3: first line second line" in message
        assert mounts_at(str(mountpoint)) == [entry]
    finally:
        subprocess.run([umount, str(mountpoint)], check=True)


def test_ctrl_c_on_a_cluster_worker_stops_it_and_its_fetchers_quietly(moto_s3, tmp_path):
    """Ctrl-C in a terminal sends SIGINT to the whole foreground process group: the worker and
    its preload fetcher processes (cachefs/cluster/fetchers.py). The worker stops them itself;
    they print nothing."""
    bucket = moto_s3.make_bucket(f"cachefs-{uuid.uuid4().hex[:12]}")
    files = _files()
    for key, data in files.items():
        moto_s3.put(bucket, f"ds/{key}", data)
    cluster = Cluster(str(tmp_path / "cluster"), 1, env=moto_s3.env)
    worker = cluster.workers[0]
    worker.own_process_group = True  # as a terminal's foreground job
    try:
        cluster.start()
        cluster.add_dataset("ds", f"s3://{bucket}/ds", endpoint=moto_s3.endpoint, block_size=BLOCK)
        assert cluster.preload("ds")["state"] == "completed"  # through the fetcher processes
        group = live_process_group(worker.proc.pid)
        assert len(group) > 1, group  # the worker and the processes it started
        os.killpg(worker.proc.pid, signal.SIGINT)
        assert worker.proc.wait(timeout=WAIT_S) == 0
        wait_for(lambda: live_process_group(worker.proc.pid) == [], "the fetchers to exit")
        assert "Traceback" not in worker.log(), worker.log()
        assert "KeyboardInterrupt" not in worker.log()
        assert mounts_at(os.path.realpath(worker.mount)) == []
    finally:
        cluster.cleanup()
