"""build_snapshot and the Snapshot reads on hand-written listings: the ImageNet shape, markers,
file/directory conflicts in both orders, hostile keys, unsorted input, big directories, and
failures (a build that fails removes its directory; bad object metadata is a clear error)."""

from __future__ import annotations

import os
import random

import pytest

from cachefs.meta import ROOT, Entry, Snapshot, SnapshotError, build_snapshot
from cachefs.store.base import ObjectInfo
from tests.unit.meta.checks import SNAPSHOT_TIME_SLACK_NS, assert_snapshot_matches
from tests.unit.meta.model import build_model, dump


def obj(key: str, size: int = 1, etag: str = "e", mtime_ns: int = 1_000) -> ObjectInfo:
    return ObjectInfo(key=key, size=size, etag=etag, mtime_ns=mtime_ns)


@pytest.fixture
def build(tmp_path):
    """build(objects, **kwargs) -> (Snapshot, BuildResult), closed after the test."""
    opened = []

    def _build(objects, name="snap", **kwargs):
        dest = tmp_path / name
        result = build_snapshot(objects, dest, **kwargs)
        snapshot = Snapshot.open(dest)
        opened.append(snapshot)
        return snapshot, result

    yield _build
    for snapshot in opened:
        snapshot.close()


def test_imagenet_shaped_tree(build) -> None:
    objects = [
        obj("train/n01440764/n01440764_10026.JPEG", 110_000, '"abc"', 300),
        obj("train/n01440764/n01440764_10027.JPEG", 120_000, "def", 100),
        obj("train/n01443537/n01443537_1.JPEG", 90_000, "ghi", 200),
        obj("val/ILSVRC2012_val_00000001.JPEG", 100_000, "jkl", 50),
    ]
    snapshot, result = build(objects)

    image = snapshot.resolve("train/n01440764/n01440764_10026.JPEG")
    class_dir = snapshot.resolve("train/n01440764")
    assert image == Entry(
        ino=image.ino,
        parent=class_dir.ino,
        name=b"n01440764_10026.JPEG",
        is_dir=False,
        size=110_000,
        mtime_ns=300,
        etag='"abc"',
        key="train/n01440764/n01440764_10026.JPEG",
        nlink=1,
    )
    assert snapshot.getattr(image.ino) == image
    assert snapshot.lookup(image.parent, image.name) == image

    train = snapshot.lookup(ROOT, b"train")
    assert train is not None and train.is_dir
    assert train.nlink == 4  # 2 + two class directories
    assert train.mtime_ns == 300  # newest child: n01440764 (300) vs n01443537 (200)
    assert [e.name for e in snapshot.readdir(train.ino)] == [b"n01440764", b"n01443537"]
    assert [e.name for e in snapshot.readdir(ROOT)] == [b"train", b"val"]
    root = snapshot.getattr(ROOT)
    assert root.nlink == 4 and root.mtime_ns == 300 and root.parent == ROOT

    stats = result.stats
    assert (stats.files, stats.dirs, stats.bytes) == (4, 4, 420_000)
    assert stats.skipped == {} and stats.skipped_samples == []
    assert snapshot.stats == stats
    assert_snapshot_matches(snapshot, build_model(objects), result)


@pytest.mark.parametrize("order", ["file first (sorted)", "directory first (unsorted)"])
def test_file_and_directory_with_the_same_path_the_directory_wins(build, order) -> None:
    file_a = obj("a", size=5, mtime_ns=9_999)  # newer than everything else
    objects = [file_a, obj("a/b", size=2, mtime_ns=20), obj("c", size=3, mtime_ns=10)]
    if order.startswith("directory"):
        objects = [objects[1], objects[0], objects[2]]
    snapshot, result = build(objects)

    a = snapshot.resolve("a")
    assert a.is_dir and a.nlink == 2
    assert snapshot.resolve("a/b").size == 2
    # The dropped file's mtime does not linger in the root's mtime.
    assert snapshot.getattr(ROOT).mtime_ns == 20
    assert [e.name for e in snapshot.readdir(ROOT)] == [b"a", b"c"]
    assert result.stats.skipped == {"conflict": 1}
    assert result.stats.skipped_samples == ["'a'"]
    assert (result.stats.files, result.stats.bytes) == (2, 5)


def test_a_directory_marker_also_beats_a_file(build) -> None:
    snapshot, result = build([obj("a", size=7), obj("a/", size=0)])
    assert snapshot.resolve("a").is_dir
    assert list(snapshot.readdir(snapshot.resolve("a").ino)) == []
    assert result.stats.skipped == {"conflict": 1}


def test_etags_are_opaque_text(build) -> None:
    etags = ['"0123456789abcdef0123456789abcdef-12"', "", "é", "odd\udcffbyte"]
    snapshot, _ = build([obj(f"f{i}", etag=etag) for i, etag in enumerate(etags)])
    assert [snapshot.resolve(f"f{i}").etag for i in range(len(etags))] == etags


def test_duplicate_keys_first_one_wins(build) -> None:
    snapshot, result = build([obj("x", etag="first"), obj("x", etag="second"), obj("y")])
    assert snapshot.resolve("x").etag == "first"
    assert result.stats.skipped == {"conflict": 1} and result.stats.files == 2


def test_directory_markers(build) -> None:
    objects = [
        obj("", size=0),  # the prefix's own marker: the root itself, not counted as skipped
        obj("empty/", size=0, mtime_ns=5),
        obj("deep/er/", size=0),
        obj("full/", size=0),
        obj("full/f", mtime_ns=77),
        obj("weird/", size=3),  # a marker with content has no name to be served under
        obj("", size=4),
    ]
    snapshot, result = build(objects)
    snapshot_ns = round(result.stats.built_at * 1e9)

    empty = snapshot.resolve("empty")
    assert empty.is_dir and empty.nlink == 2 and list(snapshot.readdir(empty.ino)) == []
    assert abs(empty.mtime_ns - snapshot_ns) <= SNAPSHOT_TIME_SLACK_NS  # no children
    assert snapshot.resolve("deep").nlink == 3 and snapshot.resolve("deep/er").is_dir
    assert snapshot.resolve("full").mtime_ns == 77
    assert snapshot.resolve("weird") is None
    assert result.stats.skipped == {"empty-segment": 2}
    assert (result.stats.files, result.stats.dirs) == (1, 4)
    assert_snapshot_matches(snapshot, build_model(objects), result)


def test_hostile_keys_never_reach_outside_the_root(build) -> None:
    hostile = [
        "../escape",
        "a/../../escape",
        "/etc/passwd",
        "./hidden",
        "a//b",
        "a/./b",
        "nul\0byte",
        "bad\udcffbyte",
        "x" * 256,
        "/".join(["p" * 200] * 21),
        "..",
        ".",
        "/",
    ]
    snapshot, result = build([obj(key) for key in [*hostile, "ok/file"]])
    entries = dump(snapshot)
    assert set(entries) == {"", "ok", "ok/file"}
    for key in hostile:
        assert snapshot.resolve(key) is None
    assert result.stats.skipped == {
        "dot-segment": 6,
        "empty-segment": 3,
        "nul": 1,
        "undecodable": 1,
        "too-long": 1,
        "path-too-long": 1,
    }
    assert len(result.stats.skipped_samples) == len(hostile)
    assert "'../escape'" in result.stats.skipped_samples
    assert "'bad\\udcffbyte'" in result.stats.skipped_samples


def test_skipped_samples_are_capped_short_and_printable(build) -> None:
    keys = [f"bad{i}//x" for i in range(30)] + ["../" + "z" * 4000]
    _snapshot, result = build([obj(key) for key in keys])
    samples = result.stats.skipped_samples
    assert len(samples) == 20 and result.stats.skipped == {"empty-segment": 30, "dot-segment": 1}
    assert all(sample.isascii() and sample.isprintable() for sample in samples)

    _snapshot, result = build([obj("../" + "z" * 4000)], name="long")
    assert result.stats.skipped_samples[0].endswith("... (4003 characters)")
    assert len(result.stats.skipped_samples[0]) < 300


def test_lookups_of_impossible_names_find_nothing(build) -> None:
    snapshot, _result = build([obj("a/b")])
    for name in [b"", b".", b"..", b"a/b", b"x" * 300, b"a\0"]:
        assert snapshot.lookup(ROOT, name) is None
    for ino in [0, -1, 2**64, 10**6]:
        assert snapshot.getattr(ino) is None
        assert list(snapshot.readdir(ino)) == []
    assert snapshot.lookup(2**64, b"a") is None
    for path in ["/a", "a/", "a//b", "a/./b", "a/b/c", "\udcff", "x" * 300]:
        assert snapshot.resolve(path) is None
    file_b = snapshot.resolve("a/b")
    assert list(snapshot.readdir(file_b.ino)) == []  # not a directory


def test_unsorted_input_gives_the_same_namespace(build) -> None:
    objects = [
        obj(f"d{d % 7}/s{d % 3}/f{i}", size=i, mtime_ns=i)
        for d in range(40)
        for i in range(d, 800, 40)
    ]
    objects += [obj("d1/s1"), obj("d2/", size=0), obj("d3/s0/", size=0)]  # conflict, markers
    shuffled = list(objects)
    random.Random(7).shuffle(shuffled)
    in_order = sorted(objects, key=lambda info: info.key.encode())

    sorted_snapshot, sorted_result = build(in_order, name="sorted")
    shuffled_snapshot, shuffled_result = build(shuffled, name="shuffled")

    def shape(snapshot):
        return {
            path: (e.is_dir, e.size, e.mtime_ns, e.etag, e.nlink)
            for path, e in dump(snapshot).items()
        }

    assert shape(sorted_snapshot) == shape(shuffled_snapshot)
    assert sorted_result.stats.skipped == shuffled_result.stats.skipped == {"conflict": 1}
    assert_snapshot_matches(shuffled_snapshot, build_model(shuffled), shuffled_result)


def test_readdir_of_a_big_directory_resumes_anywhere(build) -> None:
    names = [f"f{i:05d}" for i in range(3000)]
    snapshot, _result = build([obj(f"big/{name}") for name in names] + [obj("big0")])
    big = snapshot.resolve("big")
    children = list(snapshot.readdir(big.ino))
    assert [e.name.decode() for e in children] == names
    # Around the chunk boundaries of the reader (32, then doubling) and a spread in between.
    positions = {p + d for p in (31, 95, 223, 479, 991, 2015) for d in (-1, 0, 1)}
    positions |= set(range(0, 3000, 97)) | {2998, 2999}
    for position in sorted(positions):
        assert (
            list(snapshot.readdir(big.ino, after=children[position].ino))
            == children[position + 1 :]
        )
    # `after` that is not a child of this directory: nothing (not a restart from the top).
    assert list(snapshot.readdir(big.ino, after=snapshot.resolve("big0").ino)) == []
    assert list(snapshot.readdir(big.ino, after=10**9)) == []
    assert list(snapshot.readdir(ROOT, after=ROOT)) == []


def test_destination_must_not_exist(tmp_path) -> None:
    dest = tmp_path / "snap"
    dest.mkdir()
    (dest / "keep-me").write_text("x")
    with pytest.raises(FileExistsError, match="already exists"):
        build_snapshot([obj("a")], dest)
    assert (dest / "keep-me").read_text() == "x"


def test_a_failed_build_removes_its_directory(tmp_path) -> None:
    def listing_that_breaks():
        for i in range(120_000):  # past the first transactions of 50,000 entries
            yield obj(f"d/{i:06d}")
        raise ConnectionResetError("listing interrupted")

    dest = tmp_path / "snap"
    with pytest.raises(ConnectionResetError):
        build_snapshot(listing_that_breaks(), dest)
    assert not dest.exists()


def test_bad_object_metadata_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(SnapshotError, match=r"object 'd/neg' has an invalid size -1"):
        build_snapshot([obj("d/ok"), obj("d/neg", size=-1)], tmp_path / "snap")
    assert not os.path.exists(tmp_path / "snap")
