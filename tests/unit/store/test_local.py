"""LocalStore over real directories and files (tmp_path)."""

from __future__ import annotations

import os
import stat

import pytest

from cachefs.errors import (
    ObjectChanged,
    ObjectNotFound,
    StoreBucketNotFound,
    StoreIOError,
)
from cachefs.store.base import StoreConfig
from cachefs.store.local import LocalStore, etag_of


def make_tree(root, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def local_store(root) -> LocalStore:
    return LocalStore(StoreConfig(uri=f"file://{root}", dataset="ds"))


def file_keys(listed) -> list[str]:
    """The keys of the regular files of a listing (directory markers and the entries the
    snapshot builder skips carry other file types)."""
    return [info.key for info in listed if stat.S_ISREG(info.mode)]


def test_list_yields_every_file_in_utf8_byte_order(tmp_path):
    # "a-b" < "a/x" < "a0" in byte order ("-" 0x2D < "/" 0x2F < "0" 0x30): a per-directory
    # sort by name alone would put the directory "a" first.
    keys = ["a-b", "a/x", "a/y/z", "a0", "b", "é", "\uff21", "\U0001f600", "dir/sub/deep.bin"]
    make_tree(tmp_path, {key: key.encode() for key in keys})
    (tmp_path / "empty-dir").mkdir()
    markers = ["", "a/", "a/y/", "dir/", "dir/sub/", "empty-dir/"]  # every directory, root first

    listed = list(local_store(tmp_path).list())

    assert [info.key for info in listed] == sorted(keys + markers, key=lambda key: key.encode())
    for info in listed:
        st = os.stat(tmp_path / info.key)
        assert (info.mode, info.uid, info.gid) == (st.st_mode, st.st_uid, st.st_gid)
        if info.key in markers:
            assert stat.S_ISDIR(info.mode) and (info.size, info.etag) == (0, "")
            continue
        assert (info.size, info.mtime_ns) == (st.st_size, st.st_mtime_ns)
        assert info.etag == f"{st.st_mtime_ns:x}-{st.st_size:x}"


def test_list_with_a_prefix(tmp_path):
    make_tree(tmp_path, {k: b"x" for k in ["train/a", "train/b", "trainx", "val/c", "t"]})
    store = local_store(tmp_path)

    assert [i.key for i in store.list("train/")] == ["train/", "train/a", "train/b"]
    assert [i.key for i in store.list("train")] == ["train/", "train/a", "train/b", "trainx"]
    assert [i.key for i in store.list("train/b")] == ["train/b"]
    assert [i.key for i in store.list("nothing/here/")] == []


def test_symlinks_inside_are_followed_others_listed_as_symlinks_for_the_builder(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    make_tree(root, {"real.txt": b"real", "sub/file": b"sub"})
    make_tree(outside, {"secret.txt": b"not yours"})
    (root / "inside-link").symlink_to(root / "real.txt")
    (root / "outside-link").symlink_to(outside / "secret.txt")
    (root / "dir-link").symlink_to(root / "sub")
    (root / "dangling").symlink_to(root / "missing")
    (root / "loop").symlink_to(root)
    store = local_store(root)

    listed = {info.key: info for info in store.list()}

    assert file_keys(listed.values()) == ["inside-link", "real.txt", "sub/file"]
    assert listed["inside-link"].size == 4
    assert listed["inside-link"].mode == os.stat(root / "real.txt").st_mode  # the target's
    symlinks = [key for key, info in listed.items() if stat.S_ISLNK(info.mode)]
    assert symlinks == ["dangling", "dir-link", "loop", "outside-link"]
    assert all(listed[key].size == 0 for key in symlinks)
    assert store.get_range("inside-link", 0, 4) == b"real"
    with pytest.raises(ObjectNotFound, match="outside the dataset directory"):
        store.get_range("outside-link", 0, 4)
    with pytest.raises(ObjectNotFound):
        store.head("outside-link")


def test_special_files_are_skipped_counted_and_never_opened_blocking(tmp_path):
    make_tree(tmp_path, {"f": b"x"})
    os.mkfifo(tmp_path / "fifo")
    store = local_store(tmp_path)

    listed = {info.key: info for info in store.list()}
    assert file_keys(listed.values()) == ["f"]
    assert stat.S_ISFIFO(listed["fifo"].mode)
    with pytest.raises(ObjectNotFound, match="not a regular file"):
        store.get_range("fifo", 0, 1)  # would block forever on a blocking open


def test_undecodable_names_are_listed_surrogate_escaped_and_readable(tmp_path):
    raw_name = b"bad-\xff-name"
    with open(os.path.join(os.fsencode(tmp_path), raw_name), "wb") as file:
        file.write(b"bytes")
    store = local_store(tmp_path)

    [_root, info] = list(store.list())

    assert info.key == os.fsdecode(raw_name)
    assert "\udcff" in info.key  # the snapshot builder rejects such keys; the store just reports
    assert store.get_range(info.key, 0, 5, etag=info.etag) == b"bytes"


def test_get_range_reads_exact_bytes(tmp_path):
    data = bytes(range(256)) * 100
    make_tree(tmp_path, {"f": data})
    store = local_store(tmp_path)

    assert store.get_range("f", 0, len(data)) == data
    assert store.get_range("f", 1234, 5678) == data[1234 : 1234 + 5678]
    assert store.get_range("f", len(data) - 1, 1) == data[-1:]
    assert store.get_range("f", 10, 0) == b""


def test_a_changed_file_raises_object_changed(tmp_path):
    make_tree(tmp_path, {"f": b"version one"})
    store = local_store(tmp_path)
    etag = store.head("f").etag

    assert store.get_range("f", 0, 7, etag=etag) == b"version"
    (tmp_path / "f").write_bytes(b"version two, longer")

    with pytest.raises(ObjectChanged, match="'f'"):
        store.get_range("f", 0, 7, etag=etag)


def test_a_same_size_rewrite_with_a_new_mtime_is_a_change(tmp_path):
    make_tree(tmp_path, {"f": b"aaaa"})
    store = local_store(tmp_path)
    etag = store.head("f").etag
    (tmp_path / "f").write_bytes(b"bbbb")
    st = os.stat(tmp_path / "f")
    os.utime(tmp_path / "f", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))

    with pytest.raises(ObjectChanged):
        store.get_range("f", 0, 4, etag=etag)


def test_reading_past_the_end_is_an_io_error_not_short_data(tmp_path):
    make_tree(tmp_path, {"f": b"short"})

    with pytest.raises(StoreIOError, match="ended after 5 bytes"):
        local_store(tmp_path).get_range("f", 0, 10)


def test_missing_files_and_directories(tmp_path):
    make_tree(tmp_path, {"dir/f": b"x"})
    store = local_store(tmp_path)

    with pytest.raises(ObjectNotFound, match="'nope'"):
        store.head("nope")
    with pytest.raises(ObjectNotFound):
        store.get_range("nope", 0, 1)
    with pytest.raises(ObjectNotFound, match="not a regular file"):
        store.head("dir")
    with pytest.raises(StoreBucketNotFound, match="does not exist"):
        list(local_store(tmp_path / "absent").list())


@pytest.mark.parametrize("key", ["../escape", "a/../../escape", "/etc/passwd", "a//b", "a\0b"])
def test_keys_that_could_escape_the_root_are_refused(tmp_path, key):
    make_tree(tmp_path / "root", {"a/b": b"x"})
    make_tree(tmp_path, {"escape": b"outside"})

    with pytest.raises(ObjectNotFound):
        local_store(tmp_path / "root").get_range(key, 0, 1)


def test_etag_of_matches_the_listing(tmp_path):
    make_tree(tmp_path, {"f": b"12345"})

    [_root, info] = list(local_store(tmp_path).list())

    assert info.etag == etag_of(os.stat(tmp_path / "f"))
