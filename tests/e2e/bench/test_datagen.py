"""bench/datagen.py: the ImageNet-like generator is deterministic, ImageNet-shaped, and writes
the same bytes to a local directory and to a real S3 endpoint (moto server on 127.0.0.1)."""

from __future__ import annotations

import os
import re
import statistics

import pytest

from bench.datagen import (
    JPEG_HEADER,
    JPEG_TRAILER,
    MIN_SIZE,
    file_bytes,
    main,
    plan_dataset,
    size_summary,
    upload_s3,
    write_local,
)
from tests.fakes.moto import MotoServer

PATH_RE = re.compile(r"^train/(n\d{8})/\1_\d{7}\.JPEG$")


def test_same_seed_same_plan_and_bytes_other_seed_differs():
    first, again = plan_dataset(500, seed=7), plan_dataset(500, seed=7)
    other = plan_dataset(500, seed=8)
    assert first == again
    assert [s.size for s in first.files] != [s.size for s in other.files]
    spec = first.files[3]
    assert file_bytes(spec, 7) == file_bytes(spec, 7)
    assert file_bytes(spec, 7) != file_bytes(spec, 8)


def test_a_file_does_not_depend_on_how_many_files_are_planned():
    small, large = plan_dataset(10, seed=1), plan_dataset(1000, seed=1)
    assert small.files == large.files[:10]


def test_default_plan_is_imagenet_shaped():
    plan = plan_dataset()
    sizes = [spec.size for spec in plan.files]
    assert len(sizes) == 10_000
    assert abs(statistics.fmean(sizes) - 110_000) < 0.03 * 110_000
    # log-normal: right-skewed (median below mean), no file below the floor
    assert statistics.median(sizes) < statistics.fmean(sizes)
    assert min(sizes) >= MIN_SIZE
    assert all(PATH_RE.match(spec.path) for spec in plan.files)
    assert len({os.path.dirname(spec.path) for spec in plan.files}) == 100
    assert len({spec.path for spec in plan.files}) == 10_000
    assert plan.total_bytes == sum(sizes)


def test_file_content_has_the_planned_size_and_jpeg_markers():
    plan = plan_dataset(20, mean_size=5000, seed=3)
    for spec in plan.files:
        data = file_bytes(spec, plan.seed)
        assert len(data) == spec.size
        assert data.startswith(JPEG_HEADER) and data.endswith(JPEG_TRAILER)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"files": 0}, "files must be at least 1"),
        ({"classes": 0}, "classes must be at least 1"),
        ({"mean_size": 10}, "mean_size must be at least"),
    ],
)
def test_bad_parameters_are_refused_with_the_reason(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_dataset(**kwargs)


def test_write_local_writes_the_plan_and_reruns_only_fix_what_is_wrong(tmp_path):
    plan = plan_dataset(30, classes=4, mean_size=4000, seed=2)
    assert write_local(str(tmp_path), plan) == 30
    for spec in plan.files:
        assert (tmp_path / spec.path).read_bytes() == file_bytes(spec, plan.seed)
    assert write_local(str(tmp_path), plan) == 0

    damaged = tmp_path / plan.files[5].path
    damaged.write_bytes(damaged.read_bytes()[:100])  # e.g. an interrupted earlier run
    assert write_local(str(tmp_path), plan) == 1
    assert damaged.read_bytes() == file_bytes(plan.files[5], plan.seed)
    assert not list(tmp_path.rglob("*.partial"))


def test_an_exact_rewrite_deletes_what_the_plan_does_not_hold(tmp_path):
    """A benchmark re-run with fewer files in its own work directory: the earlier run's extra
    files go (with exact), and stay without it (a directory the caller does not own)."""
    larger = plan_dataset(30, classes=4, mean_size=4000, seed=2)
    smaller = plan_dataset(10, classes=4, mean_size=4000, seed=2)
    write_local(str(tmp_path), larger)
    (tmp_path / "stray.txt").write_bytes(b"x")
    write_local(str(tmp_path), smaller)
    assert len([p for p in tmp_path.rglob("*") if p.is_file()]) > 10
    write_local(str(tmp_path), smaller, exact=True)
    on_disk = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert on_disk == sorted(spec.path for spec in smaller.files)
    for spec in smaller.files:
        assert (tmp_path / spec.path).read_bytes() == file_bytes(spec, smaller.seed)


def test_upload_s3_puts_the_same_bytes_as_the_local_tree(tmp_path):
    plan = plan_dataset(12, classes=3, mean_size=3000, seed=4)
    server = MotoServer()
    server.start()
    try:
        bucket = server.make_bucket()
        client = server.client()
        sent = upload_s3(client, bucket, "imagenet/", plan, threads=4)
        assert sent == plan.total_bytes
        write_local(str(tmp_path), plan)
        for spec in plan.files:
            body = client.get_object(Bucket=bucket, Key="imagenet/" + spec.path)["Body"].read()
            assert body == (tmp_path / spec.path).read_bytes()
    finally:
        server.stop()


def test_size_summary():
    assert size_summary([4, 1, 3, 2]) == {
        "count": 4,
        "mean": 2.5,
        "median": 2.5,
        "min": 1,
        "max": 4,
    }
    assert size_summary([5, 1, 3])["median"] == 3
    with pytest.raises(ValueError, match="no sizes"):
        size_summary([])


def test_command_line_writes_a_local_tree(tmp_path, capsys):
    assert (
        main([str(tmp_path / "ds"), "--files", "6", "--mean-size", "2000", "--classes", "2"]) == 0
    )
    assert len(list((tmp_path / "ds").rglob("*.JPEG"))) == 6
    assert "6 files" in capsys.readouterr().out
