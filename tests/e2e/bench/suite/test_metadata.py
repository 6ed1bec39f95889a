"""The metadata workload: the namespace's keys and counts, a local tree walked on tmpfs and
through a real cachefs mount, and the zero-byte objects in a real moto server."""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest

from bench.meta_build import TRAIN_FILES, class_file_count, class_wnid
from bench.read_bench import BenchmarkFailure, WorkerProcess
from bench.suite import metadata

ENTRIES = 2_003  # not a multiple of the 1000 classes: some classes hold one more file
KEY = re.compile(r"train/(n\d{8})/(n\d{8})_(\d+)\.JPEG")

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (FUSE, drop_caches)")


def test_keys_have_imagenet_shape_and_count():
    keys = list(metadata.namespace_keys(ENTRIES))
    assert len(keys) == len(set(keys)) == ENTRIES
    per_class = Counter()
    for key in keys:
        match = KEY.fullmatch(key)
        assert match and match[1] == match[2]
        per_class[match[1]] += 1
    assert len(per_class) == 1000
    assert sorted(Counter(per_class.values()).items()) == [(2, 997), (3, 3)]
    assert list(metadata.namespace_keys(ENTRIES)) == keys  # deterministic
    assert metadata.expected_counts(ENTRIES) == (ENTRIES, 1001)
    # Fewer entries than classes: only the classes holding a file are directories.
    assert metadata.expected_counts(10) == (10, 11)
    assert len(list(metadata.namespace_keys(10))) == 10


def test_full_namespace_matches_imagenet_class_counts():
    per_class = Counter(key.split("/")[1] for key in metadata.namespace_keys(TRAIN_FILES))
    assert sum(per_class.values()) == TRAIN_FILES
    assert per_class == {class_wnid(i): class_file_count(i, 1000) for i in range(1000)}
    assert metadata.expected_counts(TRAIN_FILES) == (TRAIN_FILES, 1001)


@pytest.fixture(scope="module")
def local_tree(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("namespace") / "tree")
    assert metadata.make_local_namespace(root, ENTRIES) == ENTRIES
    return root


@needs_root
def test_local_namespace_measures_exact_counts(local_tree):
    files, dirs = metadata.expected_counts(ENTRIES)
    result = metadata.measure_namespace(local_tree, files, dirs)
    for walk in (result["walk_cold"], result["walk_warm"]):
        assert (walk["files"], walk["dirs"], walk["entries"]) == (files, dirs, files + dirs)
    assert result["find"]["files"] == ENTRIES
    assert result["stat"]["files"] == ENTRIES  # fewer files than the 10,000 sample
    with pytest.raises(BenchmarkFailure, match="expected"):
        metadata.measure_namespace(local_tree, files + 1, dirs)


def test_marker_makes_a_repeat_a_no_op(local_tree):
    with open(local_tree + ".complete") as marker:
        assert marker.read().strip() == str(ENTRIES)
    os.unlink(os.path.join(local_tree, next(metadata.namespace_keys(ENTRIES))))
    assert metadata.make_local_namespace(local_tree, ENTRIES) == 0  # trusted, not re-checked


def test_marker_of_another_size_rebuilds(tmp_path):
    root = str(tmp_path / "tree")
    assert metadata.make_local_namespace(root, 30) == 30
    assert metadata.make_local_namespace(root, 20) == 20
    found = sum(len(names) for _, _, names in os.walk(root))
    assert found == 20


@needs_root
def test_namespace_through_a_cachefs_mount(tmp_path):
    root = str(tmp_path / "tree")
    metadata.make_local_namespace(root, ENTRIES)
    workdir = tmp_path / "work"
    workdir.mkdir()
    worker = WorkerProcess(
        str(workdir), ram="64MiB", env={}, ram_dir=f"/dev/shm/test-meta-{os.getpid()}"
    )
    try:
        worker.client.add_dataset({"name": "meta", "uri": f"file://{root}"})
        files, dirs = metadata.expected_counts(ENTRIES)
        result = metadata.measure_namespace(os.path.join(worker.mount, "meta"), files, dirs)
        assert result["walk_cold"]["files"] == result["find"]["files"] == ENTRIES
        assert result["walk_warm"]["dirs"] == dirs
        rss = metadata.process_rss(worker.process.pid)
        assert rss["VmRSS"] > 0 and rss["VmHWM"] >= rss["VmRSS"]
        assert set(rss) == {"VmRSS", "VmHWM", "RssAnon", "RssFile"}
    finally:
        worker.stop()


def test_upload_namespace_lists_back(moto_s3):
    bucket = moto_s3.make_bucket()
    client = moto_s3.client()
    assert metadata.upload_namespace(client, bucket, "meta/", 150, threads=8) == 150
    listed = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        listed.update({item["Key"]: item["Size"] for item in page.get("Contents", [])})
    assert listed == {f"meta/{key}": 0 for key in metadata.namespace_keys(150)}
