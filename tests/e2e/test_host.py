"""cachefs/host.py against the real machine: mounts read from /proc/self/mountinfo (real tmpfs
mounts, one with a space in its path), tier sizes checked against real filesystems, and the
open-file limit raised in a real child process."""

from __future__ import annotations

import logging
import os
import resource
import subprocess
import sys

import pytest

from cachefs.errors import ConfigError
from cachefs.host import (
    TierRequest,
    check_tier_sizes,
    filesystem_type,
    memory_limit,
    mounts,
    mounts_at,
    resolve_mountpoint,
    resolve_without_entering,
    warn_if_short,
)


@pytest.fixture
def tmpfs(tmp_path):
    """A real tmpfs of 4 MiB, on a path with a space (mountinfo writes it as \\040)."""
    path = tmp_path / "a tmpfs"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)], check=True)
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_mounts_are_read_with_their_paths_decoded(tmpfs):
    (entry,) = mounts_at(tmpfs)
    assert entry.fstype == "tmpfs" and not entry.is_fuse
    assert entry.device == f"0:{os.minor(os.stat(tmpfs).st_dev)}"
    assert entry.source == "tmpfs"  # the field after the type
    assert entry in mounts()
    assert filesystem_type(os.path.join(tmpfs, "not", "made", "yet")) == "tmpfs"


def test_resolve_without_entering_resolves_only_the_parent(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert resolve_without_entering(str(tmp_path / "link" / "mnt")) == str(
        tmp_path / "real" / "mnt"
    )
    (tmp_path / "real" / "mnt").symlink_to(tmp_path)
    assert resolve_without_entering(str(tmp_path / "link" / "mnt")) == str(
        tmp_path / "real" / "mnt"
    )  # its own symlink is left: the CSI plugin refuses a target that is one
    assert resolve_mountpoint(str(tmp_path / "link" / "mnt")) == str(tmp_path)


def test_resolve_mountpoint_follows_a_symlink_to_a_mount_point(tmpfs, tmp_path):
    """The kernel lists a mount made through a symlink under the symlink's target: resolved
    the same way (relative and chained links too), the path is found in mountinfo."""
    (tmp_path / "to-mount").symlink_to(tmpfs)
    (tmp_path / "relative").symlink_to("to-mount")
    for link in ("to-mount", "relative"):
        resolved = resolve_mountpoint(str(tmp_path / link))
        assert resolved == tmpfs and len(mounts_at(resolved)) == 1
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(ConfigError, match="symlinks to follow"):
        resolve_mountpoint(str(tmp_path / "loop"))


def test_a_tier_larger_than_its_filesystem_is_refused(tmpfs):
    with pytest.raises(ConfigError, match=r"^--ssd 5.0 MiB cannot fit: the filesystem of .* holds"):
        check_tier_sizes([TierRequest("--ssd", f"{tmpfs}/ssd", 5 << 20, in_memory=False)])
    check_tier_sizes([TierRequest("--ssd", f"{tmpfs}/ssd", 4 << 20, in_memory=False)])
    assert os.listdir(tmpfs) == []  # checked, nothing created


def test_the_memory_bounds_a_ram_tier_only_on_a_memory_filesystem(tmp_path):
    memory = memory_limit()
    disk = os.statvfs(tmp_path).f_blocks * os.statvfs(tmp_path).f_frsize
    if filesystem_type(str(tmp_path)) in ("tmpfs", "ramfs") or disk <= memory:
        pytest.skip("needs a disk-backed tmp_path larger than the memory")
    between = (memory + disk) // 2
    check_tier_sizes([TierRequest("--ram", str(tmp_path / "ram"), between, in_memory=True)])


def test_a_tier_larger_than_the_room_free_now_is_only_warned_about(tmpfs, caplog):
    with open(os.path.join(tmpfs, "other"), "wb") as f:
        f.write(b"x" * (3 << 20))
    tier = TierRequest("--ram", tmpfs, 2 << 20, in_memory=True)
    check_tier_sizes([tier])  # fits the filesystem: not refused
    with caplog.at_level(logging.WARNING, logger="cachefs.host"):
        warn_if_short(tier, held=0)
        assert "--ram 2.0 MiB is more than the" in caplog.text
        caplog.clear()
        warn_if_short(tier, held=3 << 20)  # the tier's own blocks are its room too
        assert caplog.text == ""


def _limit_after_raise(soft: int, hard: int, wanted: int) -> tuple[str, str]:
    """Run raise_open_file_limit in a process started with the open-file limit (soft, hard):
    (its soft and hard limits after, from /proc/self/limits; what it logged)."""
    code = (
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stderr, level=logging.INFO, format='%(message)s')\n"
        "from cachefs.host import raise_open_file_limit\n"
        f"raise_open_file_limit({wanted})\n"
        "print([line.split()[3:5] for line in open('/proc/self/limits')"
        " if line.startswith('Max open files')][0])\n"
    )

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=limited, check=True
    )
    return done.stdout.strip(), done.stderr


def test_the_open_file_limit_is_raised_up_to_the_hard_limit_and_never_lowered():
    """Many hosts start processes at a soft limit of 1,024: the worker raises its own (its
    peer connections and open block files need more); children inherit it."""
    hard = 8192  # set in the child (as root, the tests' user, even above the machine's own)
    limits, logged = _limit_after_raise(256, hard, 6000)
    assert limits == str(["6000", str(hard)]) and "raised from 256 to 6000" in logged
    limits, logged = _limit_after_raise(256, 3000, 6000)  # only as far as the hard limit
    assert limits == str(["3000", "3000"]) and "raised from 256 to 3000" in logged
    assert "the open-file limit is 3000: " in logged  # low: warned
    limits, logged = _limit_after_raise(7000, hard, 6000)  # never lowered
    assert limits == str(["7000", str(hard)]) and logged == ""
