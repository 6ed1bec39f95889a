"""Who can read what through the mount, checked as real other users.

Real `cachefs up` worker processes and FUSE mounts (allow_other and default_permissions, so the
kernel enforces the mode bits the worker reports), a real S3 endpoint (moto server), and real
unprivileged readers: every "other user" here is a command run under ``setpriv`` with another
uid and gid and no supplementary groups, exactly as a training container's user would read.
Also: empty directories of a file:// source and S3 directory markers, the symlinks and FIFOs a
local source holds (skipped and counted), the option errors, and a snapshot written before
modes were recorded (rebuilt at start).
"""

from __future__ import annotations

import gzip
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid

import pytest

from cachefs.cli import build_parser
from cachefs.commands.worker import worker_config
from cachefs.meta import Snapshot
from tests.waiting import WAIT_S
from tests.worker_process import REPO_ROOT, WorkerProcess, drop_page_cache

NOBODY = 65534  # uid and gid ("nogroup") of Debian's nobody
OTHER = 4000  # a user and group that own nothing
FORMAT1_FIXTURE = os.path.join(
    REPO_ROOT, "tests", "unit", "meta", "data", "format1-snapshot.mdb.gz"
)


def run_as(uid: int, gid: int, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *argv],
        capture_output=True,
        timeout=WAIT_S,
        check=False,
    )


def read_as(uid: int, gid: int, path: str) -> bytes | str:
    """The file's bytes as that user reads them, or "EACCES"."""
    done = run_as(uid, gid, "cat", path)
    if done.returncode == 0:
        return done.stdout
    assert b"Permission denied" in done.stderr, done.stderr
    return "EACCES"


def random_bytes(size: int, seed: int) -> bytes:
    return (seed.to_bytes(4, "big") + os.urandom(60)) * (size // 64) + b"e" * (size % 64)


@pytest.fixture
def base_dir():
    """A directory other users may traverse (pytest's tmp_path lies under a 0700 directory)."""
    path = tempfile.mkdtemp(prefix="cachefs-perms-", dir="/tmp")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def workers(base_dir, moto_s3):
    started: list[WorkerProcess] = []

    def start(name: str, *extra_args: str) -> WorkerProcess:
        worker = WorkerProcess(os.path.join(base_dir, name), env=moto_s3.env, extra_args=extra_args)
        started.append(worker)
        worker.start()
        os.chmod(worker.base_dir, 0o755)  # so that other users reach its mountpoint
        return worker

    yield start
    for worker in started:
        worker.cleanup()


def make_source(root: str) -> dict[str, bytes]:
    """A file:// dataset whose files and directories have different modes and owners."""
    files = {
        "public.bin": (random_bytes(300_000, 1), 0o644, 0, 0),
        "secret.bin": (random_bytes(70_000, 2), 0o600, 0, 0),
        "group.bin": (random_bytes(5_000, 3), 0o640, 0, NOBODY),  # readable by the group
        "mine.bin": (random_bytes(5_000, 4), 0o600, NOBODY, NOBODY),  # only nobody (and root)
        "private/inner.bin": (random_bytes(1_000, 5), 0o644, 0, 0),  # under a 0700 directory
        "train/a.npz": (random_bytes(2_000, 6), 0o644, 0, 0),
    }
    for rel, (data, mode, uid, gid) in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        os.chown(path, uid, gid)
        os.chmod(path, mode)
    os.chmod(os.path.join(root, "private"), 0o700)
    os.makedirs(os.path.join(root, "valid"))  # empty: what DLIO expects to find
    os.makedirs(os.path.join(root, "deep", "er", "est"))
    os.chmod(root, 0o755)
    os.symlink("/etc/hostname", os.path.join(root, "link-out"))  # leads outside: not served
    os.mkfifo(os.path.join(root, "pipe"))
    return {rel: data for rel, (data, *_owner) in files.items()}


def walk(top: str) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(top, onerror=pytest.fail):
        found += [os.path.relpath(os.path.join(dirpath, n), top) for n in dirnames + filenames]
    return sorted(found)


def cli(worker: WorkerProcess, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cachefs", "--state", worker.state, *argv],
        env=worker.env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )


def test_a_file_source_s_modes_and_owners_are_kept_and_enforced(workers, base_dir):
    source = os.path.join(base_dir, "source")
    files = make_source(source)
    worker = workers("w")
    result = worker.add_dataset("ds", f"file://{source}")
    ds = worker.path("ds")

    # Root reads everything, byte for byte; the empty directories are there; os.walk works.
    for rel, data in files.items():
        with open(os.path.join(ds, rel), "rb") as f:
            assert f.read() == data, rel
    assert walk(ds) == sorted(
        [*files, "private", "train", "valid", "deep", "deep/er", "deep/er/est"]
    )
    assert os.listdir(os.path.join(ds, "valid")) == []

    # stat shows the source's owner and mode, without write bits.
    def shown(rel: str) -> tuple[str, int, int]:
        st = os.stat(os.path.join(ds, rel))
        return stat.filemode(st.st_mode), st.st_uid, st.st_gid

    assert shown("public.bin") == ("-r--r--r--", 0, 0)
    assert shown("secret.bin") == ("-r--------", 0, 0)
    assert shown("group.bin") == ("-r--r-----", 0, NOBODY)
    assert shown("mine.bin") == ("-r--------", NOBODY, NOBODY)
    assert shown("private") == ("dr-x------", 0, 0)
    assert shown("valid") == ("dr-xr-xr-x", 0, 0)
    assert shown("") == ("dr-xr-xr-x", 0, 0)

    # Another user reads what the source lets it read, and nothing else.
    drop_page_cache()
    assert read_as(NOBODY, NOBODY, os.path.join(ds, "public.bin")) == files["public.bin"]
    assert read_as(NOBODY, NOBODY, os.path.join(ds, "secret.bin")) == "EACCES"
    assert read_as(NOBODY, NOBODY, os.path.join(ds, "group.bin")) == files["group.bin"]
    assert read_as(NOBODY, NOBODY, os.path.join(ds, "mine.bin")) == files["mine.bin"]
    assert read_as(NOBODY, NOBODY, os.path.join(ds, "private", "inner.bin")) == "EACCES"
    assert read_as(OTHER, OTHER, os.path.join(ds, "group.bin")) == "EACCES"
    assert read_as(OTHER, OTHER, os.path.join(ds, "mine.bin")) == "EACCES"
    # Nor through the cache: every block file is the worker's user's alone.
    block_files = [
        os.path.join(dirpath, name)
        for dirpath, _dirs, names in os.walk(worker.ram_dir)
        for name in names
        if not name.startswith(".")  # the tier's own marker file holds no data
    ]
    assert block_files
    assert all(stat.S_IMODE(os.stat(path).st_mode) == 0o600 for path in block_files)
    listing = run_as(NOBODY, NOBODY, "ls", "-A", os.path.join(ds, "valid"))
    assert (listing.returncode, listing.stdout) == (0, b"")

    # The symlink leading outside and the FIFO are not served, and are counted with examples.
    assert not os.path.lexists(os.path.join(ds, "link-out"))
    assert not os.path.lexists(os.path.join(ds, "pipe"))
    assert result["skipped"] == {"fifo": 1, "symlink": 1}
    status = cli(worker, "status")
    assert status.returncode == 0, status.stderr
    assert "fifo 1, symlink 1" in status.stdout and "'link-out'" in status.stdout
    assert "'pipe'" in status.stdout

    # A chmod in the source reaches readers at the next refresh, though the kernel caches
    # attributes for an hour (--attr-timeout): the refresh tells it what changed.
    os.chmod(os.path.join(source, "public.bin"), 0o600)
    os.chmod(os.path.join(source, "secret.bin"), 0o644)
    refreshed = worker.client.refresh_dataset("ds")
    assert refreshed["changed"] == 2
    assert read_as(NOBODY, NOBODY, os.path.join(ds, "public.bin")) == "EACCES"
    assert read_as(NOBODY, NOBODY, os.path.join(ds, "secret.bin")) == files["secret.bin"]


@pytest.fixture
def bucket(moto_s3):
    name = f"cachefs-{uuid.uuid4().hex[:12]}"
    moto_s3.make_bucket(name)
    return name


def test_uid_gid_and_modes_options_are_shown_and_enforced_with_s3_markers(workers, moto_s3, bucket):
    data = random_bytes(200_000, 7)
    moto_s3.put(bucket, "ds/train/a.bin", data)
    moto_s3.put(bucket, "ds/valid/", b"")  # a directory marker: an empty directory
    moto_s3.put(bucket, "ds/x", b"a file")  # and a marker with the same path: the
    moto_s3.put(bucket, "ds/x/", b"")  # directory wins, the file is a counted conflict
    worker = workers(
        "w", "--uid", "4242", "--gid", "4343", "--file-mode", "0440", "--dir-mode", "0550"
    )
    result = worker.add_dataset("ds", f"s3://{bucket}/ds", endpoint=moto_s3.endpoint)
    ds = worker.path("ds")

    assert walk(ds) == ["train", "train/a.bin", "valid", "x"]
    assert os.path.isdir(os.path.join(ds, "valid")) and os.path.isdir(os.path.join(ds, "x"))
    assert (result["files"], result["dirs"], result["skipped"]) == (1, 3, {"conflict": 1})
    for path, mode in [
        (worker.mount, "dr-xr-x---"),
        (ds, "dr-xr-x---"),
        (os.path.join(ds, "valid"), "dr-xr-x---"),
        (os.path.join(ds, "train", "a.bin"), "-r--r-----"),
    ]:
        st = os.stat(path)
        assert (stat.filemode(st.st_mode), st.st_uid, st.st_gid) == (mode, 4242, 4343), path

    a_bin = os.path.join(ds, "train", "a.bin")
    assert read_as(4242, OTHER, a_bin) == data  # the owner
    assert read_as(OTHER, 4343, a_bin) == data  # the group
    assert read_as(OTHER, OTHER, a_bin) == "EACCES"  # anyone else: not even the directories
    assert run_as(OTHER, OTHER, "ls", worker.mount).returncode != 0


def test_defaults_and_no_allow_other(workers, moto_s3, bucket):
    data = random_bytes(10_000, 8)
    moto_s3.put(bucket, "ds/f.bin", data)

    default = workers("default")
    default.add_dataset("ds", f"s3://{bucket}/ds", endpoint=moto_s3.endpoint)
    f_bin = default.path("ds", "f.bin")
    st = os.stat(f_bin)
    # Owned by the worker's user (root here), read-only for everyone: the mount is read-only.
    assert (stat.filemode(st.st_mode), st.st_uid, st.st_gid) == ("-r--r--r--", 0, 0)
    assert stat.filemode(os.stat(default.mount).st_mode) == "dr-xr-xr-x"
    assert read_as(NOBODY, NOBODY, f_bin) == data

    private = workers("private", "--no-allow-other")
    private.add_dataset("ds", f"s3://{bucket}/ds", endpoint=moto_s3.endpoint)
    # Without allow_other the kernel lets no other user into the mount, whatever the modes say.
    assert read_as(NOBODY, NOBODY, private.path("ds", "f.bin")) == "EACCES"
    with open(private.path("ds", "f.bin"), "rb") as f:
        assert f.read() == data


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--file-mode", "0644", "--file-mode 0644 grants write or special bits"),
        ("--dir-mode", "0755", "--dir-mode 0755 grants write or special bits"),
        ("--file-mode", "rw", "--file-mode wants an octal mode"),
        ("--uid", "alice", "--uid wants a numeric id"),
        ("--gid", "-1", "--gid -1 is not a valid id"),
    ],
)
def test_bad_permission_options_are_one_line_errors(base_dir, option, value, message):
    mount = os.path.join(base_dir, "mnt")
    done = subprocess.run(
        [
            *(sys.executable, "-m", "cachefs", "--state", os.path.join(base_dir, "state")),
            *("up", "--mount", mount, "--metrics", "off", option, value),
        ],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
    )
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert not os.path.ismount(mount)


def test_cluster_workers_take_the_same_options():
    args = build_parser().parse_args(
        [
            *("worker", "--listen", "127.0.0.2:7701", "--uid", "7", "--gid", "8"),
            *("--file-mode", "400", "--dir-mode", "0o500", "--no-allow-other"),
        ]
    )
    config = worker_config(args)
    assert (config.permissions.uid, config.permissions.gid) == (7, 8)
    assert (config.permissions.file_mode, config.permissions.dir_mode) == (0o400, 0o500)
    assert config.allow_other is False


def test_a_snapshot_written_before_modes_were_kept_is_rebuilt_at_start(workers, base_dir):
    """The fixture was written by the format-1 builder (tests/unit/meta/test_owners.py) for the
    files below; a worker that finds it for a file:// dataset lists the directory again before
    serving, keeping the inode numbers of unchanged paths: a root-only file must not become
    readable."""
    source = os.path.join(base_dir, "source")
    for rel, data, mode in [
        ("public.bin", b"public", 0o644),
        ("secret.bin", b"secret", 0o600),
        ("sub/inner.bin", b"inner", 0o644),
    ]:
        os.makedirs(os.path.dirname(os.path.join(source, rel)), exist_ok=True)
        with open(os.path.join(source, rel), "wb") as f:
            f.write(data)
        os.chmod(os.path.join(source, rel), mode)
    os.makedirs(os.path.join(source, "empty"))
    os.chmod(source, 0o755)
    worker = workers("w")
    worker.add_dataset("ds", f"file://{source}")
    worker.stop()
    [snapshot_name] = os.listdir(os.path.join(worker.state, "snapshots"))
    snapshot_dir = os.path.join(worker.state, "snapshots", snapshot_name)
    with (
        gzip.open(FORMAT1_FIXTURE) as packed,
        open(os.path.join(snapshot_dir, "data.mdb"), "wb") as unpacked,
    ):
        shutil.copyfileobj(packed, unpacked)
    old = Snapshot.open(snapshot_dir)
    assert not old.records_owners
    # Directories keep their inodes. The files do not: the fixture's etags are not these files'
    # (a file:// etag comes from stat), so they are new bytes and get new inodes.
    old_inos = {path: old.resolve(path).ino for path in ["", "sub", "empty"]}
    old.close()

    worker.start()

    assert "snapshot rebuilt to keep the source's modes and owners" in worker.log()
    assert os.listdir(os.path.join(worker.state, "snapshots")) != [snapshot_name]
    secret = worker.path("ds", "secret.bin")
    assert stat.filemode(os.stat(secret).st_mode) == "-r--------"
    assert read_as(NOBODY, NOBODY, secret) == "EACCES"
    assert read_as(NOBODY, NOBODY, worker.path("ds", "public.bin")) == b"public"
    for path, ino in old_inos.items():
        assert os.stat(worker.path("ds", path)).st_ino & ((1 << 48) - 1) == ino, path
    assert os.path.isdir(worker.path("ds", "empty"))
