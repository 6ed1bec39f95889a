"""cachefs/csi/mounts.py on real directories: the read-only remount after the bind is what
makes a volume read-only when its source is writable (the worker's FUSE mount is read-only
already, so tests/e2e/csi/test_node_plugin.py cannot tell the two apart)."""

from __future__ import annotations

import errno
import os

import pytest

from cachefs.csi.mounts import MountFailed, bind_read_only, unmount, unmount_all, visible_mount


@pytest.fixture
def dirs(tmp_path):
    source, target = tmp_path / "source", tmp_path / "target"
    source.mkdir()
    target.mkdir()
    (source / "data.bin").write_bytes(b"\x00cachefs\xff" * 1000)
    yield str(source), str(target)
    unmount_all(str(target))


def test_a_bind_of_a_writable_directory_is_read_only_nosuid_nodev(dirs):
    source, target = dirs
    bind_read_only(source, target)
    mount = visible_mount(target)
    assert mount is not None and {"ro", "nosuid", "nodev"} <= set(mount.options)
    with open(os.path.join(target, "data.bin"), "rb") as f:
        assert f.read() == b"\x00cachefs\xff" * 1000
    with pytest.raises(OSError) as caught:
        os.open(os.path.join(target, "new"), os.O_WRONLY | os.O_CREAT)
    assert caught.value.errno == errno.EROFS
    # The source stays writable: only the bind is read-only.
    with open(os.path.join(source, "new"), "wb") as f:
        f.write(b"x")
    assert unmount_all(target) == 1
    assert visible_mount(target) is None
    assert os.listdir(target) == []


def test_a_failed_bind_leaves_the_target_as_it_was(dirs, tmp_path):
    _, target = dirs
    missing = str(tmp_path / "missing")
    with pytest.raises(MountFailed) as caught:
        bind_read_only(missing, target)
    assert caught.value.errno == errno.ENOENT
    assert (
        str(caught.value)
        == f"bind mount of {missing} on {target} failed: No such file or directory"
    )
    assert visible_mount(target) is None


def test_unmounting_a_path_that_is_no_mount_removes_nothing(dirs):
    _, target = dirs
    assert unmount_all(target) == 0
    with pytest.raises(MountFailed) as caught:
        unmount(target)
    assert caught.value.errno == errno.EINVAL
