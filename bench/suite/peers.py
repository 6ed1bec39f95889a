"""The suite's peer systems: s3fs-fuse and rclone mounts of the suite's bucket.

Both mount the same S3 endpoint and bucket that cachefs reads (the delay proxy in front of
moto), tuned as their own documentation recommends for read-only training data: large,
immutable, read many times. That means read-only mounts, a local disk cache of the data, long
attribute and directory caches and (s3fs; rclone 1.60 has no such option) the kernel page cache
kept across opens. ``describe()`` gives the exact argv and every tuning flag with the reason it
is there, for the report.

    with S3fsMount(endpoint, bucket, "/tmp/work/s3fs", cache_size=8 << 30) as mount:
        data = open(os.path.join(mount.root, "small/train/n01/x.JPEG"), "rb").read()
        mount.drop_cache()  # next reads are cold (the caller drops the page cache too)

Each mount runs in the foreground in its own session (``harness.processes.ChildProcess``), so the
bench owns its process and its pid, and its log goes to ``<workdir>/<name>.log``. Credentials
never appear on a command line: s3fs reads a mode-600 ``passwd_file`` in the work dir (removed
by ``stop()``), rclone's remote is configured through ``RCLONE_CONFIG_<NAME>_*`` variables.

Findings that shape the numbers (``notes`` in ``describe()``): s3fs 1.90 drops a file's
stat-cache entry on every open and close, so each open costs one or two HEADs even when its data
comes from the disk cache; rclone 1.60 answers re-opens from its directory cache without any
request, but keeps no file data in the kernel page cache, so every read goes through rclone.
Nothing here is imported by cachefs.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping

from bench.read_bench import MOTO_ENV, BenchmarkFailure
from harness.processes import ChildProcess, log_tail

#: How long start() waits for the mount to appear and its root to list.
MOUNT_TIMEOUT_S = 60.0
#: Cache lifetimes for attributes, directories and cached data. The data is immutable for the
#: whole run, so nothing should expire or be re-checked during it.
CACHE_LIFETIME_S = 7 * 24 * 3600
#: How long stop() waits for the process to exit after the unmount, and again after SIGTERM
#: before SIGKILL.
EXIT_TIMEOUT_S = 10.0

#: name -> (binary, Debian package)
BINARIES = {"s3fs": ("s3fs", "s3fs"), "rclone": ("rclone", "rclone")}


def available() -> dict[str, str | None]:
    """For each peer, None when its binary is installed, otherwise why it cannot run."""
    return {
        name: None if shutil.which(binary) else f"{binary} not found on PATH (apt install {pkg})"
        for name, (binary, pkg) in BINARIES.items()
    }


@functools.cache
def binary_version(binary: str) -> str:
    """The version a peer's binary reports (``s3fs --version``, ``rclone version``)."""
    argv, pattern = {
        "s3fs": ([binary, "--version"], r"V(\d[\w.\-]*)"),
        "rclone": ([binary, "version"], r"rclone v(\S+)"),
    }[binary]
    output = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30).stdout
    match = re.search(pattern, output)
    if match:
        return match.group(1)
    return output.strip().split("\n")[0] or "?"


def is_mounted(path: str) -> bool:
    """Whether something is mounted at ``path``, also a FUSE mount whose process died (where
    os.path.ismount says False: it cannot stat the mountpoint)."""
    # The parent's real path: touching the mountpoint itself blocks while a FUSE process is
    # still starting (s3fs checks its store before it answers anything).
    parent, name = os.path.split(os.path.abspath(path))
    target = os.path.join(os.path.realpath(parent), name).replace(" ", "\\040")  # as in mounts
    with open("/proc/self/mounts") as mounts:
        return any(line.split()[1] == target for line in mounts)


def list_within(path: str, timeout: float) -> str | None:
    """None when ``path`` lists within ``timeout`` seconds, else what went wrong. A listing
    that hangs (a FUSE process still retrying its store) is left to a daemon thread, which
    ends when that process is stopped."""
    outcome: list[str | None] = []

    def attempt() -> None:
        try:
            os.listdir(path)
            outcome.append(None)
        except OSError as exc:
            outcome.append(f"listing the root failed: {exc}")

    lister = threading.Thread(target=attempt, daemon=True)
    lister.start()
    lister.join(max(0.0, timeout))
    return outcome[0] if outcome else f"listing the root did not answer in {timeout:.0f}s"


def free_bytes(path: str) -> int:
    """Free space of the filesystem that holds (or will hold) ``path``."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def unmount(path: str) -> None:
    """Unmount a FUSE mount: ``fusermount3 -u`` (the FUSE process then exits by itself), or a
    lazy ``umount -l`` when that fails (busy, or the process is gone)."""
    for argv in (["fusermount3", "-u", path], ["umount", "-l", path]):
        if not is_mounted(path):
            return
        if shutil.which(argv[0]):
            subprocess.run(argv, capture_output=True, check=False, timeout=30)
    if is_mounted(path):
        raise BenchmarkFailure(f"could not unmount {path}")


class PeerMount:
    """One peer's FUSE mount of ``bucket`` at ``<workdir>/mnt`` with a disk cache in
    ``<workdir>/cache``; object key ``a/b/c`` is the file ``root/a/b/c``.

    ``env`` holds the credentials and region (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
    AWS_DEFAULT_REGION, as bench.read_bench.MOTO_ENV); ``cache_size`` (bytes) bounds the disk
    cache where the peer can bound it (None: unbounded).
    """

    name = ""
    binary = ""

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        workdir: str,
        *,
        env: Mapping[str, str] = MOTO_ENV,
        cache_size: int | None = None,
    ):
        self.endpoint = endpoint
        self.bucket = bucket
        self.workdir = os.path.abspath(workdir)
        self.access_key = env["AWS_ACCESS_KEY_ID"]
        self.secret_key = env["AWS_SECRET_ACCESS_KEY"]
        self.region = env.get("AWS_DEFAULT_REGION", "us-east-1")
        self.cache_size = cache_size
        self.root = os.path.join(self.workdir, "mnt")
        self.cache_dir = os.path.join(self.workdir, "cache")
        self.log_path = os.path.join(self.workdir, f"{self.name}.log")
        self._child: ChildProcess | None = None

    # --- what each peer defines ------------------------------------------------------------

    def flags(self) -> dict[str, str]:
        """The tuning flags as they appear in the argv, each with why it is there."""
        raise NotImplementedError

    def argv(self) -> list[str]:
        raise NotImplementedError

    def child_env(self) -> dict[str, str]:
        """The environment of the mount process: ours without any AWS_* variable, so the only
        credentials it sees are the ones given explicitly (and AWS_CA_BUNDLE, which rclone
        1.60's S3 client cannot combine with its own HTTP transport, does not break it)."""
        return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}

    def notes(self) -> list[str]:
        """What a reader of the numbers should know about this peer."""
        return []

    def _write_config(self) -> None:
        """Files the process needs before it starts (credentials, config)."""

    def _remove_config(self) -> None:
        """Remove what _write_config wrote that holds a secret."""

    # --- life cycle ------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._child.process.pid if self._child else None

    def start(self) -> PeerMount:
        """Mount, and wait (at most MOUNT_TIMEOUT_S) until the root is a mount and lists;
        BenchmarkFailure with the end of the log if it does not."""
        if is_mounted(self.root):
            raise BenchmarkFailure(
                f"{self.root} is already mounted (a previous run? umount -l {self.root})"
            )
        os.makedirs(self.root, exist_ok=True)
        os.makedirs(self.cache_dir, exist_ok=True)
        self._write_config()
        self._child = ChildProcess(self.argv(), self.log_path, self.child_env())
        try:
            problem = self._wait_mounted()
        except BaseException:
            self.stop()
            raise
        if problem is not None:
            self.stop()  # first, so that the process's last words are in the log
            raise BenchmarkFailure(
                f"{self.name} did not mount {self.bucket} at {self.root}: {problem}\n"
                f"{self.log_tail()}"
            )
        return self

    def _wait_mounted(self) -> str | None:
        """None once the root is a mount that lists; what went wrong when the process exits
        or MOUNT_TIMEOUT_S pass first."""
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        problem = "no mount appeared"
        while time.monotonic() < deadline:
            if not self._child.alive():
                return f"it exited with {self._child.process.returncode}"
            if is_mounted(self.root):
                problem = list_within(self.root, deadline - time.monotonic())
                if problem is None:
                    return None
            time.sleep(0.1)
        return f"{problem} (waited {MOUNT_TIMEOUT_S:.0f}s)"

    def log_tail(self, chars: int = 4000) -> str:
        return log_tail(self.log_path, chars)

    def drop_cache(self) -> None:
        """Make the next reads cold: unmount, empty the disk cache, mount again (the in-memory
        attribute and directory caches go with the process; the caller drops the page cache)."""
        self.stop()
        shutil.rmtree(self.cache_dir, ignore_errors=True)
        self.start()

    def stop(self) -> None:
        """Unmount and end the process; the cache dir and the log stay."""
        try:
            if is_mounted(self.root):
                unmount(self.root)
        finally:
            if self._child is not None:
                try:
                    self._child.process.wait(timeout=EXIT_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    pass  # still busy (e.g. retrying its store): SIGTERM, then SIGKILL
                self._child.terminate(timeout=EXIT_TIMEOUT_S)
                self._child = None
            self._remove_config()

    def __enter__(self) -> PeerMount:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def describe(self) -> dict:
        """For the report: what ran, exactly (no secret in it), and why each flag."""
        return {
            "name": self.name,
            "version": binary_version(self.binary),
            "argv": self.argv(),
            "cache_dir": self.cache_dir,
            "cache_size": self.cache_size,
            "flags": self.flags(),
            "notes": self.notes(),
        }


class S3fsMount(PeerMount):
    """s3fs-fuse (Debian's 1.90) with its disk cache (``use_cache``)."""

    name = "s3fs"
    binary = "s3fs"
    #: Large objects are read as this many parallel ranged GETs of MULTIPART_MB each.
    PARALLEL_COUNT = 8
    MULTIPART_MB = 16
    #: Parallel HEADs when a directory is listed (default 20).
    MULTIREQ_MAX = 32
    #: Stat-cache entries (default 100,000, about 40 MB): a whole ImageNet (1.28 M files) fits.
    STAT_CACHE_ENTRIES = 2_000_000

    @property
    def passwd_path(self) -> str:
        return os.path.join(self.workdir, "passwd-s3fs")

    def _write_config(self) -> None:
        fd = os.open(self.passwd_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as passwd:
            os.fchmod(passwd.fileno(), 0o600)  # s3fs refuses a file others can read
            passwd.write(f"{self.access_key}:{self.secret_key}\n")

    def _remove_config(self) -> None:
        try:
            os.remove(self.passwd_path)
        except FileNotFoundError:
            pass

    @functools.cached_property
    def _ensure_diskfree_mb(self) -> int | None:
        """s3fs 1.90 has no cache size limit; it stops caching (and cleans its cache) when the
        free space of the cache's filesystem would fall below ``ensure_diskfree``. Keeping
        (free space - cache_size) free caps the cache at about ``cache_size`` (measured once, so
        that every mount of this object runs with the same flags)."""
        if self.cache_size is None:
            return None
        return max(0, free_bytes(self.cache_dir) - self.cache_size) >> 20

    def flags(self) -> dict[str, str]:
        flags = {
            "ro": "read-only training data",
            "allow_other": "readers of any user see the mount",
            f"url={self.endpoint}": "the suite's store (the delay proxy in front of moto)",
            "use_path_request_style": "path-style requests, as the store expects",
            f"endpoint={self.region}": "the region requests are signed for (SigV4)",
            f"passwd_file={self.passwd_path}": "credentials from a mode-600 file, not argv",
            f"logfile={self.log_path}": "its log, written as it goes (stdout is buffered)",
            "dbglevel=warn": "errors and warnings in the log (default: critical only)",
            f"use_cache={self.cache_dir}": "disk cache: each object is downloaded once, later "
            "opens read the local copy",
            "kernel_cache": "keep the page cache across opens: the objects never change",
            f"max_stat_cache_size={self.STAT_CACHE_ENTRIES}": "attributes of every object fit "
            "(default 100,000)",
            f"stat_cache_expire={CACHE_LIFETIME_S}": "attributes never expire during a run",
            "enable_noobj_cache": "remember names that are not objects, so implied directories "
            "do not cost repeated HEADs and listings",
            f"entry_timeout={CACHE_LIFETIME_S}": "FUSE: the kernel keeps names for the run",
            f"attr_timeout={CACHE_LIFETIME_S}": "FUSE: the kernel keeps attributes for the run",
            f"multireq_max={self.MULTIREQ_MAX}": "more parallel HEADs when listing a directory",
            f"parallel_count={self.PARALLEL_COUNT}": "large objects: parallel ranged GETs",
            f"multipart_size={self.MULTIPART_MB}": "large objects: MB per ranged GET",
        }
        diskfree = self._ensure_diskfree_mb
        if diskfree is not None:
            flags[f"ensure_diskfree={diskfree}"] = (
                "no cache size option in s3fs: keep (free space - cache_size) free, which "
                "caps the cache at about cache_size"
            )
        return flags

    def argv(self) -> list[str]:
        return [self.binary, self.bucket, self.root, "-f", "-o", ",".join(self.flags())]

    def notes(self) -> list[str]:
        return [
            "no notsup_compat_dir: the bucket has no directory objects, and s3fs 1.90's "
            "default recognises the directories implied by keys",
            "s3fs 1.90 drops a file's stat-cache entry when it opens and when it closes the "
            "file, so every open costs one HEAD to the store (two when the kernel asks for the "
            "attributes first) even when the data comes from the disk cache",
        ]


class RcloneMount(PeerMount):
    """``rclone mount`` (Debian's 1.60) with the VFS cache in full mode."""

    name = "rclone"
    binary = "rclone"
    #: The remote's name; its settings are RCLONE_CONFIG_<REMOTE upper-case>_* variables.
    REMOTE = "cachefsbench"

    @property
    def config_path(self) -> str:
        """An empty config file: the remote is in the environment, nothing is read from
        ~/.config/rclone and no notice about a missing file is logged."""
        return os.path.join(self.workdir, "rclone.conf")

    def _write_config(self) -> None:
        with open(self.config_path, "a"):
            pass

    def remote_settings(self) -> dict[str, str]:
        """The remote's settings without its keys (they are added in child_env only)."""
        return {
            "type": "s3",
            "provider": "Other",
            "endpoint": self.endpoint,
            "region": self.region,
            "force_path_style": "true",
            "env_auth": "false",
        }

    def child_env(self) -> dict[str, str]:
        settings = {
            **self.remote_settings(),
            "access_key_id": self.access_key,
            "secret_access_key": self.secret_key,
        }
        prefix = f"RCLONE_CONFIG_{self.REMOTE.upper()}_"
        return {**super().child_env(), **{prefix + k.upper(): v for k, v in settings.items()}}

    def flags(self) -> dict[str, str]:
        lifetime = f"{CACHE_LIFETIME_S // 3600}h"
        flags = {
            "--read-only": "read-only training data",
            "--vfs-cache-mode full": "disk cache of the data read: each object is downloaded "
            "once, later opens read the local copy",
            f"--cache-dir {self.cache_dir}": "where the disk cache lives",
            f"--vfs-cache-max-age {lifetime}": "cached data never expires during a run",
            f"--dir-cache-time {lifetime}": "directory listings never expire during a run",
            f"--attr-timeout {lifetime}": "the kernel keeps attributes for the run: safe, as "
            "the objects never change (the docs warn only about changes made outside rclone)",
            "--poll-interval 0": "S3 has no change notifications to poll",
            "--allow-other": "readers of any user see the mount",
            "--no-modtime": "no modification-time lookups (the docs: can speed things up)",
            "--no-checksum": "no checksum of each download",
            "--vfs-fast-fingerprint": "the cache's fingerprints skip the slow parts (modtime "
            "is slow on S3)",
            "--s3-no-head-object": "no HEAD before each GET",
            "--vfs-read-ahead 64M": "full mode: fetch this far ahead of a sequential reader",
            "--vfs-read-chunk-size 32M": "first ranged GET of an object; doubles on each "
            "further chunk (--vfs-read-chunk-size-limit off) for long sequential reads",
        }
        if self.cache_size is not None:
            # A bare number is KiB to rclone: give the unit.
            flags[f"--vfs-cache-max-size {self.cache_size}B"] = "bounds the disk cache"
        return flags

    def argv(self) -> list[str]:
        args = [arg for flag in self.flags() for arg in flag.split(" ", 1)]
        return [
            self.binary,
            "mount",
            f"{self.REMOTE}:{self.bucket}",
            self.root,
            "--config",
            self.config_path,
            *args,
        ]

    def notes(self) -> list[str]:
        return [
            "rclone 1.60's mount keeps no file data in the kernel page cache (none resident "
            "right after a read): every read reaches rclone, which serves cached data from its "
            "disk cache",
            "the remote comes from RCLONE_CONFIG_* variables (see remote; keys not shown)",
        ]

    def describe(self) -> dict:
        return {**super().describe(), "remote": self.remote_settings()}
