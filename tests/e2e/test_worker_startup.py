"""Starting `cachefs up` for real: two workers on one machine with default options, and every
refused start (a port taken, a busy mountpoint, a bad state directory, tiers that cannot fit)
is one line on stderr and exit status 1, prints no "serving" line, and leaves nothing behind:
nothing mounted, no RAM-tier directory in /dev/shm."""

from __future__ import annotations

import os
import resource
import shutil
import socket
import subprocess
import sys
import time

import pytest

from cachefs.client import ControlClient
from cachefs.host import OPEN_FILES_WANTED, mounts_at
from cachefs.pidlock import is_locked, names_held_lock, take_pid_lock
from cachefs.settings import default_ram_dir
from tests.waiting import WAIT_S, wait_for
from tests.worker_process import REPO_ROOT, force_unmount, log_tail


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}
    return {**env, "PYTHONPATH": REPO_ROOT, **extra}


def _cachefs(*args: str) -> list[str]:
    return [sys.executable, "-m", "cachefs", *args]


def _refused(*args: str, env: dict[str, str] | None = None) -> str:
    """Run a start that must be refused; returns its one line."""
    done = subprocess.run(
        _cachefs(*args), env=env or _env(), capture_output=True, text=True, timeout=WAIT_S
    )
    assert done.returncode == 1, (done.returncode, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cachefs: error: "), done.stderr
    assert done.stdout == ""
    return lines[0]


def _tcp_listeners(pid: int) -> list[str]:
    """The TCP addresses a process listens on (from /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    found.append(fields[1])
    return found


def test_two_workers_with_default_options_share_a_machine(tmp_path):
    """Only what must differ is given (state directory, mountpoint): no port, no RAM dir.
    Both serve /metrics on their control socket and listen on no TCP port. Started at a soft
    limit of 1,024 open files, as many hosts start them, each raises its own."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    raised = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(OPEN_FILES_WANTED, hard)
    started = []
    try:
        for name in ("a", "b"):
            state, mount = str(tmp_path / name / "state"), str(tmp_path / name / "mnt")
            log_path = tmp_path / f"{name}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    _cachefs("--state", state, "up", "--mount", mount),
                    env=_env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)),
                )
            started.append((proc, state, mount, str(log_path)))
        for proc, state, mount, log_path in started:
            with ControlClient(state, timeout=30) as client:

                def serving(proc=proc, client=client, log_path=log_path) -> bool:
                    assert proc.poll() is None, log_tail(log_path)
                    return client.is_running()

                wait_for(serving, f"the worker of {state}")
                assert "cachefs_tier_capacity_bytes" in client.metrics()
            assert len(mounts_at(mount)) == 1
            assert _tcp_listeners(proc.pid) == []
            assert "serving" in log_tail(log_path)
            with open(f"/proc/{proc.pid}/limits") as limits:
                (soft,) = [line.split()[3] for line in limits if line.startswith("Max open files")]
            assert soft == str(raised)
    finally:
        for proc, state, mount, _log in started:
            proc.terminate()
            proc.wait(timeout=WAIT_S)
            force_unmount(mount)
            shutil.rmtree(default_ram_dir(state), ignore_errors=True)


@pytest.fixture
def taken_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def _nothing_left(tmp_path, mount: str) -> None:
    assert mounts_at(os.path.realpath(mount)) == []
    assert not os.path.exists(default_ram_dir(str(tmp_path / "state")))


def test_a_taken_metrics_port_is_one_line(tmp_path, taken_port):
    mount = str(tmp_path / "mnt")
    line = _refused(
        "--state", str(tmp_path / "state"), "up", "--mount", mount,
        "--metrics", f"127.0.0.1:{taken_port}",
    )  # fmt: skip
    assert line == (
        f"cachefs: error: cannot listen on 127.0.0.1:{taken_port} (--metrics): "
        "Address already in use"
    )
    _nothing_left(tmp_path, mount)


def test_a_taken_peer_port_is_one_line(tmp_path, taken_port):
    mount = str(tmp_path / "mnt")
    line = _refused(
        "--state", str(tmp_path / "state"), "--token-file", os.devnull, "worker",
        "--coordinator", "http://127.0.0.1:9", "--listen", f"127.0.0.1:{taken_port}",
        "--mount", mount,
    )  # fmt: skip
    # /dev/null holds no token: that is refused first, before any port is tried.
    assert "no API token" in line
    line = _refused(
        "--state", str(tmp_path / "state"), "worker", "--coordinator", "http://127.0.0.1:9",
        "--listen", f"127.0.0.1:{taken_port}", "--mount", mount,
        env=_env(CACHEFS_TOKEN="a-token"),
    )  # fmt: skip
    assert f"cannot listen on 127.0.0.1:{taken_port} (--listen)" in line
    _nothing_left(tmp_path, mount)


def test_a_peer_address_nobody_can_dial_is_one_line(tmp_path):
    """The coordinator gives a worker's --listen address to the other workers: 0.0.0.0 (or a
    port 0) would have its heartbeats refused, so the worker refuses it at start."""
    mount = str(tmp_path / "mnt")
    for listen in ("0.0.0.0:7701", "[::]:7701", "127.0.0.2:0"):
        line = _refused(
            "--state", str(tmp_path / "state"), "worker", "--coordinator", "http://127.0.0.1:9",
            "--listen", listen, "--mount", mount, env=_env(CACHEFS_TOKEN="a-token"),
        )  # fmt: skip
        assert line.startswith(f"cachefs: error: --listen {listen}: other workers dial"), line
        _nothing_left(tmp_path, mount)


def test_a_busy_mountpoint_is_one_line_and_leaves_no_ram_dir(tmp_path):
    mount = tmp_path / "mnt"
    mount.mkdir()
    (mount / "someone's file").write_text("x")
    line = _refused("--state", str(tmp_path / "state"), "up", "--mount", str(mount))
    assert line == f"cachefs: error: mountpoint {mount} is not empty: choose an empty directory"
    _nothing_left(tmp_path, str(mount))
    assert os.listdir(mount) == ["someone's file"]

    a_file = tmp_path / "file"
    a_file.write_text("x")
    line = _refused("--state", str(tmp_path / "state"), "up", "--mount", str(a_file))
    assert f"cannot use mountpoint {a_file}" in line
    _nothing_left(tmp_path, str(a_file))


def test_a_mountpoint_on_another_kind_of_mount_is_refused(tmp_path):
    mount = tmp_path / "mnt"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mount)], check=True)
    try:
        line = _refused("--state", str(tmp_path / "state"), "up", "--mount", str(mount))
        assert "is already a mount point (tmpfs)" in line
        assert not os.path.exists(default_ram_dir(str(tmp_path / "state")))
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_bad_state_directory_is_one_line(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    line = _refused("--state", str(not_a_dir / "state"), "up", "--mount", str(tmp_path / "m"))
    assert line == f"cachefs: error: cannot use state directory {not_a_dir}/state: Not a directory"
    deep = tmp_path / ("d" * 120)
    line = _refused("--state", str(deep), "up", "--mount", str(tmp_path / "m"))
    assert "too long a path for its control socket" in line


def test_a_start_failing_after_the_tiers_were_made_removes_them(tmp_path):
    """The RAM tier directory is created when the cache opens; what fails after that (here:
    the snapshots directory of the state is a file) removes it again."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "snapshots").write_text("not a directory")
    ssd = tmp_path / "ssd"
    line = _refused(
        "--state", str(state), "up", "--mount", str(tmp_path / "mnt"), "--ssd", f"{ssd}:64MiB"
    )
    assert line == f"cachefs: error: cannot open {state}/snapshots: File exists"
    _nothing_left(tmp_path, str(tmp_path / "mnt"))
    assert not ssd.exists()


def test_tiers_larger_than_the_machine_are_refused(tmp_path):
    mount = str(tmp_path / "mnt")
    line = _refused("--state", str(tmp_path / "state"), "up", "--mount", mount, "--ram", "4096TiB")
    assert line.startswith("cachefs: error: --ram 4096.0 TiB cannot fit: the filesystem of ")
    ssd = tmp_path / "ssd"
    line = _refused(
        "--state", str(tmp_path / "state"), "up", "--mount", mount, "--ssd", f"{ssd}:4096TiB"
    )
    assert f"--ssd 4096.0 TiB cannot fit: the filesystem of {ssd} holds" in line
    assert not ssd.exists()
    _nothing_left(tmp_path, mount)


def test_a_ram_tier_larger_than_the_memory_is_refused_even_where_tmpfs_allows_it(tmp_path):
    """A tmpfs may be given any size; its pages still need the machine's memory."""
    big_tmpfs = tmp_path / "shm"
    big_tmpfs.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2048T", "tmpfs", str(big_tmpfs)], check=True
    )
    try:
        line = _refused(
            "--state", str(tmp_path / "state"), "up", "--mount", str(tmp_path / "mnt"),
            "--ram", "1024TiB", "--ram-dir", str(big_tmpfs / "ram"),
        )  # fmt: skip
        assert "--ram 1024.0 TiB cannot fit: this machine has" in line
        assert os.listdir(big_tmpfs) == []
    finally:
        subprocess.run(["umount", str(big_tmpfs)], check=True)


def test_the_serving_line_comes_only_once_the_mount_is_up(tmp_path):
    mount = str(tmp_path / "mnt")
    state = str(tmp_path / "state")
    proc = subprocess.Popen(
        _cachefs("--state", state, "up", "--mount", mount, "--ram", "64MiB"),
        env=_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first_line = ""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not first_line.startswith("cachefs: serving"):
            first_line = proc.stderr.readline()
            assert first_line, f"exited with {proc.poll()}"
        assert first_line.startswith(f"cachefs: serving {mount}")
        assert len(mounts_at(mount)) == 1  # already mounted when the line came
        with ControlClient(state, timeout=30) as client:
            assert client.status()["mounted"]
    finally:
        proc.terminate()
        proc.wait(timeout=WAIT_S)
        force_unmount(mount)
        shutil.rmtree(default_ram_dir(state), ignore_errors=True)


def test_is_locked_sees_a_held_worker_lock_and_its_release(tmp_path):
    path = str(tmp_path / "worker.lock")
    assert not is_locked(path)  # no file
    lock_file = take_pid_lock(path)
    try:
        assert is_locked(path)
    finally:
        lock_file.close()
    assert not is_locked(path)  # the kernel let go of it; the pid text stays


def test_a_lock_line_naming_another_device_is_matched_by_inode_and_pid(tmp_path):
    """/proc/locks names the filesystem's own device, which stat()'s st_dev is not on a btrfs
    subvolume or overlayfs: such a line is the held lock when its inode and the pid written in
    the lock file match. (A line with another device, built here: this machine's filesystems
    show the same device both ways; the real /proc/locks is read in the test above.)"""
    path = tmp_path / "worker.lock"
    path.write_text("4242")
    stat = os.stat(path)
    other = f"{os.major(stat.st_dev) + 1:02x}:{os.minor(stat.st_dev) + 7:02x}"
    own = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}"

    def line(device: str, pid: int, inode: int = stat.st_ino, waiter: str = "") -> str:
        return f"3: {waiter}FLOCK  ADVISORY  WRITE {pid} {device}:{inode} 0 EOF\n"

    assert names_held_lock(line(other, 4242), stat, "4242")  # st_dev differs: inode and pid
    assert names_held_lock(line(own, 1), stat, "4242")  # st_dev is its device: inode alone
    assert not names_held_lock(line(other, 1), stat, "4242")  # another file's lock
    assert not names_held_lock(line(other, 4242, stat.st_ino + 1), stat, "4242")
    assert not names_held_lock(line(own, 4242, waiter="-> "), stat, "4242")  # only waits
    assert not names_held_lock("4: OFDLCK ADVISORY  WRITE -1 fe:00:1 0 EOF\n", stat, "4242")


@pytest.mark.parametrize(
    ("options", "says"),
    [
        # --fuse-fast-read on with open handles (or on a stock pyfuse3)
        (("--fuse-no-open", "off", "--fuse-fast-read", "on"), "--fuse-fast-read on needs"),
        # --fuse-passthrough is part of the native path (the binding answers OPEN and hands
        # the kernel the table's blocks)
        (("--fuse-fast-read", "off", "--fuse-passthrough", "on"), "--fuse-passthrough on needs"),
    ],
    ids=["native-reads-with-open-handles", "passthrough-without-native-reads"],
)
def test_asking_for_a_native_path_where_it_cannot_run_is_refused(tmp_path, options, says):
    """A native-path option asked for where it cannot run is one line, not a worker that
    silently serves every READ in Python or never hands a file to the kernel."""
    mount = str(tmp_path / "mnt")
    line = _refused("--state", str(tmp_path / "state"), "up", "--mount", mount, *options)
    assert says in line
    _nothing_left(tmp_path, mount)
