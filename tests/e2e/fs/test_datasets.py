"""Datasets under a live mount: add/remove without remounting, hostile keys, refresh, bad input.
Real worker process, real FUSE mount, real S3 endpoint (moto server)."""

from __future__ import annotations

import os
import uuid

import pytest

from cachefs.client import ControlError
from tests.waiting import wait_for
from tests.worker_process import WorkerProcess, drop_page_cache


def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture
def worker(moto_s3, tmp_path):
    w = WorkerProcess(str(tmp_path), env=moto_s3.env).start()
    yield w
    w.cleanup()


@pytest.fixture
def bucket(moto_s3):
    name = f"cachefs-{uuid.uuid4().hex[:12]}"
    moto_s3.make_bucket(name)
    return name


def test_datasets_appear_and_disappear_without_remount(worker, moto_s3, bucket):
    moto_s3.put(bucket, "a/x.bin", b"x" * 1000)
    moto_s3.put(bucket, "b/y.bin", b"y" * 2000)
    assert os.listdir(worker.mount) == []
    worker.add_dataset("alpha", f"s3://{bucket}/a", endpoint=moto_s3.endpoint)
    assert os.listdir(worker.mount) == ["alpha"]
    assert read_file(worker.path("alpha", "x.bin")) == b"x" * 1000
    worker.add_dataset("beta", f"s3://{bucket}/b/", endpoint=moto_s3.endpoint)
    assert sorted(os.listdir(worker.mount)) == ["alpha", "beta"]
    assert read_file(worker.path("beta", "y.bin")) == b"y" * 2000
    before = worker.status()["tiers"][0]["used"]
    result = worker.client.remove_dataset("alpha")
    assert result["freed_bytes"] == 1000
    page = os.sysconf("SC_PAGE_SIZE")  # the RAM tier counts the tmpfs pages a block takes
    assert worker.status()["tiers"][0]["used"] == before - page
    assert os.listdir(worker.mount) == ["beta"]
    assert not os.path.exists(worker.path("alpha", "x.bin"))
    # Re-adding under the same name works and serves the data again.
    worker.add_dataset("alpha", f"s3://{bucket}/a", endpoint=moto_s3.endpoint)
    assert read_file(worker.path("alpha", "x.bin")) == b"x" * 1000
    # State survives a clean down/up.
    worker.restart()
    assert sorted(os.listdir(worker.mount)) == ["alpha", "beta"]
    assert read_file(worker.path("beta", "y.bin")) == b"y" * 2000


HOSTILE_KEYS = [
    "ds/a//b.bin",  # empty segment
    "ds/./c.bin",  # dot segment
    "ds/../escape.bin",  # dot-dot segment
    "ds/x/../../escape2.bin",
    "ds/" + "n" * 256 + ".bin",  # component longer than 255 bytes
    "ds/ctrl\x00nul.bin",  # NUL (S3 accepts it in keys)
]


def test_hostile_keys_are_skipped_counted_and_never_escape(worker, moto_s3, bucket):
    moto_s3.put(bucket, "ds/good/ok.bin", b"fine")
    for key in HOSTILE_KEYS:
        try:
            moto_s3.put(bucket, key, b"evil")
        except Exception:  # the endpoint may refuse some names itself; that is fine
            pass
    result = worker.add_dataset("ds", f"s3://{bucket}/ds", endpoint=moto_s3.endpoint)
    assert result["files"] == 1
    assert result["skipped_total"] >= 4
    all_entries = []
    for dirpath, dirnames, filenames in os.walk(worker.mount):
        all_entries += [os.path.join(dirpath, n) for n in dirnames + filenames]
    assert sorted(os.path.relpath(p, worker.mount) for p in all_entries) == [
        "ds",
        "ds/good",
        "ds/good/ok.bin",
    ]
    assert not os.path.exists(os.path.join(os.path.dirname(worker.mount), "escape.bin"))
    status = worker.dataset_status("ds")
    assert status["skipped_total"] == result["skipped_total"]
    assert status["skipped_samples"]


def test_refresh_serves_new_bytes_never_old(worker, moto_s3, bucket):
    moto_s3.put(bucket, "ds/changing.bin", b"old" * 1000)
    moto_s3.put(bucket, "ds/stable.bin", b"s" * 10)
    moto_s3.put(bucket, "ds/going.bin", b"g")
    worker.add_dataset("ds", f"s3://{bucket}/ds", endpoint=moto_s3.endpoint)
    path = worker.path("ds", "changing.bin")
    assert read_file(path) == b"old" * 1000
    ino_before = os.stat(worker.path("ds", "stable.bin")).st_ino
    moto_s3.put(bucket, "ds/changing.bin", b"NEW!" * 2000)
    moto_s3.client().delete_object(Bucket=bucket, Key="ds/going.bin")
    moto_s3.put(bucket, "ds/added.bin", b"a")
    # Before refresh: the snapshot still names the old version; the store no longer has it, so
    # an uncached read must fail rather than return new bytes under the old size.
    assert read_file(path) == b"old" * 1000  # cached block of the old version
    result = worker.client.refresh_dataset("ds")
    assert result["changed"] == 1 and result["removed"] == 1
    assert read_file(path) == b"NEW!" * 2000
    assert os.stat(path).st_size == 8000
    assert not os.path.exists(worker.path("ds", "going.bin"))
    assert read_file(worker.path("ds", "added.bin")) == b"a"
    assert os.stat(worker.path("ds", "stable.bin")).st_ino == ino_before
    drop_page_cache()
    assert read_file(path) == b"NEW!" * 2000


def test_object_changed_behind_the_snapshot_is_eio_not_wrong_bytes(worker, moto_s3, bucket):
    moto_s3.put(bucket, "ds/f.bin", b"1" * 5000)
    worker.add_dataset("ds", f"s3://{bucket}/ds", endpoint=moto_s3.endpoint)
    moto_s3.put(bucket, "ds/f.bin", b"2" * 5000)  # same size, different content and etag
    with pytest.raises(OSError) as info:
        read_file(worker.path("ds", "f.bin"))
    assert info.value.errno == 5  # EIO: the If-Match precondition failed
    assert "changed" in worker.log().lower() or "etag" in worker.log().lower()


@pytest.mark.parametrize(
    ("uri", "fragment"),
    [
        ("s3://", "bucket"),
        ("ftp://bucket/x", "scheme"),
        ("file://relative/path", "absolute"),
        ("s3://Bad_Bucket!/x", "bucket"),
    ],
)
def test_bad_uris_give_clear_errors_and_change_nothing(worker, uri, fragment):
    with pytest.raises(ControlError) as info:
        worker.add_dataset("ds", uri)
    assert info.value.status == 400
    assert fragment in str(info.value).lower()
    assert worker.client.datasets() == []


def test_missing_bucket_and_wrong_credentials_are_named(worker, moto_s3, bucket, tmp_path):
    with pytest.raises(ControlError) as info:
        worker.add_dataset("ds", "s3://no-such-bucket-here/x", endpoint=moto_s3.endpoint)
    assert "no-such-bucket-here" in str(info.value) and "ds" in str(info.value)
    assert worker.client.datasets() == []
    with pytest.raises(ControlError) as info:
        worker.add_dataset("ds", f"file://{tmp_path}/does-not-exist")
    assert "does-not-exist" in str(info.value)
    assert worker.client.datasets() == []


def test_metrics_endpoint_exports_the_promised_series(worker, moto_s3, bucket):
    moto_s3.put(bucket, "ds/f.bin", b"z" * 3000)
    worker.add_dataset("ds", f"s3://{bucket}/ds", endpoint=moto_s3.endpoint)
    read_file(worker.path("ds", "f.bin"))
    drop_page_cache()
    read_file(worker.path("ds", "f.bin"))
    text = worker.client.metrics()
    for series in (
        'cachefs_block_hits_total{tier="ram"} 1.0',
        "cachefs_block_misses_total 1.0",
        'cachefs_bytes_served_total{source="store"} 3000.0',
        'cachefs_store_requests_total{op="get",outcome="ok"} 1.0',
        "cachefs_store_request_seconds_bucket",
        "cachefs_fuse_op_seconds_bucket",
        "cachefs_admissions_refused_total",
        "cachefs_evictions_total",
        'cachefs_dataset_cached_bytes{dataset="ds"} 3000.0',
        'cachefs_fill_blocks_total{outcome="copied"} 0.0',
        "cachefs_fill_bytes_total 0.0",
    ):
        assert series in text, series
    status = worker.status()
    assert status["cleanup"] == {"freed_bytes": {}, "tasks": []}  # single node: no tasks
    assert status["fill"] == {"blocks": {"copied": 0, "absent": 0, "failed": 0}, "bytes": 0}


def test_periodic_refresh_picks_up_new_objects(worker, tmp_path):
    source = tmp_path / "periodic"
    source.mkdir()
    (source / "a.bin").write_bytes(b"a")
    worker.add_dataset("ds", f"file://{source}", refresh_interval_s=1.0)
    assert os.listdir(worker.path("ds")) == ["a.bin"]
    (source / "b.bin").write_bytes(b"b")
    # The interval is 1 s and housekeeping ticks every second: wait for the refresh to land.
    wait_for(lambda: worker.dataset_status("ds")["files"] == 2, "the periodic refresh")
    assert worker.dataset_status("ds")["generation"] >= 2
    assert read_file(worker.path("ds", "b.bin")) == b"b"
