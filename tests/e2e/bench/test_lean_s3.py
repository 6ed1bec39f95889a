"""bench/lean_s3.py as a real server process, checked with boto3, cachefs's S3Store and a real
cachefs worker: bytes exact, ranges, HEAD, errors, conditions, listings with delimiters and
pages, hostile key names, and persistent connections. No timing assertions."""

from __future__ import annotations

import hashlib
import http.client
import os
import urllib.parse

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from bench.lean_s3 import LeanS3Process, TreeIndex, parse_range
from cachefs.errors import ObjectChanged, ObjectNotFound
from cachefs.store import StoreConfig, open_store
from tests.fakes.moto import TEST_CREDENTIALS
from tests.worker_process import WorkerProcess

BUCKET = "lean-bucket"
HOSTILE_KEY = "odd/a file %41 + plus ü 日本 &<x>.bin"
#: More than one page of a listing at the page sizes used below.
MANY_FILES = 23


def _object_bytes(key: str, size: int) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def _objects() -> dict[str, bytes]:
    objects = {
        "train/cls1/img1.jpg": _object_bytes("img1", 110_000),
        "train/cls1/img2.jpg": _object_bytes("img2", 1),
        "train/cls2/img3.jpg": _object_bytes("img3", 70_000),
        "train/empty.bin": b"",
        "train-notes.txt": b"sorts before train/ by its '-'",
        "large/shard-0": _object_bytes("shard", 5 * 1024 * 1024 + 17),
        HOSTILE_KEY: _object_bytes("hostile", 4096),
    }
    for number in range(MANY_FILES):
        objects[f"many/f{number:03d}"] = _object_bytes(f"many{number}", 100 + number)
    return objects


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lean_s3_root")
    objects = _objects()
    for key, data in objects.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    with LeanS3Process(str(root), BUCKET, processes=2) as server:
        yield server, root, objects


def _client(url: str, pool: int = 10):
    return boto3.client(
        "s3",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="any-key",
        aws_secret_access_key="any-secret",
        config=Config(
            s3={"addressing_style": "path"},
            max_pool_connections=pool,
            retries={"total_max_attempts": 1},
        ),
    )


def test_get_whole_and_ranged_bytes_exact(served):
    server, _, objects = served
    client = _client(server.url)
    for key, data in objects.items():
        reply = client.get_object(Bucket=BUCKET, Key=key)
        assert reply["Body"].read() == data, key
        assert reply["ContentLength"] == len(data)
    shard = objects["large/shard-0"]
    reply = client.get_object(Bucket=BUCKET, Key="large/shard-0", Range="bytes=1000-1048575")
    assert reply["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert reply["ContentRange"] == f"bytes 1000-1048575/{len(shard)}"
    assert reply["Body"].read() == shard[1000:1048576]
    tail = client.get_object(Bucket=BUCKET, Key="large/shard-0", Range="bytes=-10")
    assert tail["Body"].read() == shard[-10:]
    past_end = client.get_object(Bucket=BUCKET, Key="large/shard-0", Range="bytes=5242880-")
    assert past_end["Body"].read() == shard[5242880:]
    with pytest.raises(ClientError) as raised:
        client.get_object(Bucket=BUCKET, Key="train/cls1/img2.jpg", Range="bytes=5-9")
    assert raised.value.response["Error"]["Code"] == "InvalidRange"


def test_head_and_missing_objects(served):
    server, root, _ = served
    client = _client(server.url)
    head = client.head_object(Bucket=BUCKET, Key="train/cls2/img3.jpg")
    assert head["ContentLength"] == 70_000
    stat = os.stat(root / "train/cls2/img3.jpg")
    assert int(head["LastModified"].timestamp()) == int(stat.st_mtime)
    assert head["ETag"].startswith('"') and head["ETag"].endswith('"')
    assert client.head_object(Bucket=BUCKET, Key="train/cls2/img3.jpg")["ETag"] == head["ETag"]
    with pytest.raises(ClientError) as raised:
        client.get_object(Bucket=BUCKET, Key="train/nope.jpg")
    assert raised.value.response["Error"]["Code"] == "NoSuchKey"
    with pytest.raises(ClientError) as raised:
        client.get_object(Bucket=BUCKET, Key="train/cls1")  # a directory is no object
    assert raised.value.response["Error"]["Code"] == "NoSuchKey"
    with pytest.raises(ClientError) as raised:
        client.head_object(Bucket=BUCKET, Key="train/nope.jpg")
    assert raised.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    with pytest.raises(ClientError) as raised:
        client.get_object(Bucket="other-bucket", Key="train/cls1/img1.jpg")
    assert raised.value.response["Error"]["Code"] == "NoSuchBucket"
    client.head_bucket(Bucket=BUCKET)
    assert client.get_bucket_location(Bucket=BUCKET)["LocationConstraint"] is None
    with pytest.raises(ClientError) as raised:
        client.put_object(Bucket=BUCKET, Key="new", Body=b"x")
    assert raised.value.response["Error"]["Code"] == "NotImplemented"
    assert not (root / "new").exists()


def test_if_match_gives_412_when_the_etag_differs(served):
    server, _, objects = served
    client = _client(server.url)
    etag = client.head_object(Bucket=BUCKET, Key="train/cls1/img1.jpg")["ETag"]
    # As cachefs's S3Store sends it: the quoted ETag in If-Match with a ranged GET.
    reply = client.get_object(
        Bucket=BUCKET, Key="train/cls1/img1.jpg", Range="bytes=0-99", IfMatch=etag
    )
    assert reply["Body"].read() == objects["train/cls1/img1.jpg"][:100]
    with pytest.raises(ClientError) as raised:
        client.get_object(
            Bucket=BUCKET, Key="train/cls1/img1.jpg", Range="bytes=0-99", IfMatch='"0123abcd"'
        )
    assert raised.value.response["Error"]["Code"] == "PreconditionFailed"
    assert raised.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412


def test_a_rewritten_file_gets_a_new_etag(tmp_path):
    (tmp_path / "k").write_bytes(b"first")
    with LeanS3Process(str(tmp_path), BUCKET) as server:
        client = _client(server.url)
        before = client.head_object(Bucket=BUCKET, Key="k")["ETag"]
        os.utime(tmp_path / "k", ns=(0, 10**18))
        (tmp_path / "k").write_bytes(b"second version")
        reply = client.get_object(Bucket=BUCKET, Key="k")
        assert reply["Body"].read() == b"second version"
        assert reply["ETag"] != before
        with pytest.raises(ClientError) as raised:
            client.get_object(Bucket=BUCKET, Key="k", IfMatch=before)
        assert raised.value.response["Error"]["Code"] == "PreconditionFailed"


def test_list_objects_v2_with_delimiter_and_pages(served):
    server, _, objects = served
    client = _client(server.url)
    every = [
        entry
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, PaginationConfig={"PageSize": 5}
        )
        for entry in page.get("Contents", ())
    ]
    keys = [entry["Key"] for entry in every]
    assert keys == sorted(objects, key=lambda key: key.encode())
    assert {entry["Key"]: entry["Size"] for entry in every} == {
        key: len(data) for key, data in objects.items()
    }
    head = client.head_object(Bucket=BUCKET, Key="train/cls1/img1.jpg")
    listed = next(entry for entry in every if entry["Key"] == "train/cls1/img1.jpg")
    assert listed["ETag"] == head["ETag"]
    assert listed["LastModified"] == head["LastModified"]

    pages = list(
        client.get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, Prefix="many/", PaginationConfig={"PageSize": 10}
        )
    )
    assert [page["KeyCount"] for page in pages] == [10, 10, MANY_FILES - 20]
    assert [page["IsTruncated"] for page in pages] == [True, True, False]
    assert [e["Key"] for p in pages for e in p["Contents"]] == [
        f"many/f{n:03d}" for n in range(MANY_FILES)
    ]

    top = client.list_objects_v2(Bucket=BUCKET, Delimiter="/")
    assert [p["Prefix"] for p in top["CommonPrefixes"]] == ["large/", "many/", "odd/", "train/"]
    assert [entry["Key"] for entry in top["Contents"]] == ["train-notes.txt"]
    train = client.list_objects_v2(Bucket=BUCKET, Prefix="train/", Delimiter="/")
    assert [p["Prefix"] for p in train["CommonPrefixes"]] == ["train/cls1/", "train/cls2/"]
    assert [entry["Key"] for entry in train["Contents"]] == ["train/empty.bin"]

    # Common prefixes count towards max-keys, and a page may end on one.
    seen_prefixes, seen_keys = [], []
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=BUCKET, Delimiter="/", PaginationConfig={"PageSize": 1}
    ):
        seen_prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", ())]
        seen_keys += [entry["Key"] for entry in page.get("Contents", ())]
    assert seen_prefixes == ["large/", "many/", "odd/", "train/"]
    assert seen_keys == ["train-notes.txt"]

    after = client.list_objects_v2(Bucket=BUCKET, Prefix="many/", StartAfter="many/f020")
    assert [entry["Key"] for entry in after["Contents"]] == ["many/f021", "many/f022"]
    v1 = client.list_objects(Bucket=BUCKET, Prefix="train/", Delimiter="/", MaxKeys=2)
    assert v1["IsTruncated"] and v1["NextMarker"] == "train/cls2/"
    rest = client.list_objects(Bucket=BUCKET, Prefix="train/", Delimiter="/", Marker="train/cls2/")
    assert [entry["Key"] for entry in rest["Contents"]] == ["train/empty.bin"]
    assert "CommonPrefixes" not in rest


def test_a_hostile_key_round_trips(served):
    server, _, objects = served
    client = _client(server.url)
    assert client.get_object(Bucket=BUCKET, Key=HOSTILE_KEY)["Body"].read() == objects[HOSTILE_KEY]
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix="odd/a file %41 + ")
    assert [entry["Key"] for entry in listed["Contents"]] == [HOSTILE_KEY]
    # Without encoding-type=url the key comes back as XML text, escaped only for XML.
    split = urllib.parse.urlsplit(server.url)
    connection = http.client.HTTPConnection(split.hostname, split.port)
    connection.request("GET", f"/{BUCKET}?list-type=2&prefix=odd/")
    body = connection.getresponse().read().decode()
    connection.close()
    assert "<Key>odd/a file %41 + plus ü 日本 &amp;&lt;x&gt;.bin</Key>" in body


def test_many_requests_reuse_one_connection(served):
    server, _, _ = served
    client = _client(server.url, pool=1)
    client.head_bucket(Bucket=BUCKET)  # the client's one connection is open
    before = server.stats()
    for _ in range(40):
        client.get_object(Bucket=BUCKET, Key="train/cls1/img1.jpg")["Body"].read()
        client.head_object(Bucket=BUCKET, Key="train/cls1/img2.jpg")
    client.list_objects_v2(Bucket=BUCKET, Prefix="many/")
    after = server.stats()
    # The only new connection is the one that fetched the second stats.
    assert after["connections_accepted"] - before["connections_accepted"] == 1
    assert after["requests"] - before["requests"] == 81 + 1
    assert after["get_object"] - before["get_object"] == 40


def test_cachefs_store_lists_and_reads(served, monkeypatch):
    server, _, objects = served
    for name, value in TEST_CREDENTIALS.items():  # any credentials: lean_s3 checks none
        monkeypatch.setenv(name, value)
    store = open_store(StoreConfig(uri=f"s3://{BUCKET}/train/", endpoint=server.url))
    try:
        listed = {info.key: info for info in store.list()}
        expected = {k[len("train/") :]: v for k, v in objects.items() if k.startswith("train/")}
        assert {key: info.size for key, info in listed.items()} == {
            key: len(data) for key, data in expected.items()
        }
        info = store.head("cls1/img1.jpg")
        assert info.etag == listed["cls1/img1.jpg"].etag
        data = expected["cls1/img1.jpg"]
        assert store.get_range("cls1/img1.jpg", 0, len(data), etag=info.etag) == data
        assert store.get_range("cls1/img1.jpg", 4096, 5000, etag=info.etag) == data[4096:9096]
        with pytest.raises(ObjectChanged):
            store.get_range("cls1/img1.jpg", 0, 10, etag="0123abcd")
        with pytest.raises(ObjectNotFound):
            store.head("cls1/missing.jpg")
    finally:
        store.close()


def test_a_cachefs_worker_reads_a_dataset_from_it(served, tmp_path):
    server, _, objects = served
    credentials = {**TEST_CREDENTIALS, "AWS_EC2_METADATA_DISABLED": "true"}
    worker = WorkerProcess(str(tmp_path / "w"), env=credentials).start()
    try:
        worker.add_dataset("ds", f"s3://{BUCKET}/", endpoint=server.url)
        for key, data in objects.items():
            with open(worker.path("ds", *key.split("/")), "rb") as f:
                assert f.read() == data, key
        assert sorted(os.listdir(worker.path("ds", "train"))) == ["cls1", "cls2", "empty.bin"]
    finally:
        worker.cleanup()


def test_the_index_lists_in_utf8_byte_order(tmp_path):
    for name in ("b/x", "b-c", "a", "é", "z/", "\U0001f600"):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if not name.endswith("/"):
            path.write_bytes(b"")
    index = TreeIndex(str(tmp_path))
    assert index.keys == sorted(index.keys, key=lambda key: key.encode())
    assert index.keys == ["a", "b-c", "b/x", "é", "\U0001f600"]
    page = index.page("", "/", "", 10)
    assert (page.keys, page.prefixes) == (["a", "b-c", "é", "\U0001f600"], ["b/"])


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("bytes=0-9", (0, 9)),
        ("bytes=5-", (5, 99)),
        ("bytes=-10", (90, 99)),
        ("bytes=90-500", (90, 99)),
        ("bytes=9-3", None),
        ("bytes=0-1,5-6", None),
        ("items=0-1", None),
        ("bytes=a-b", None),
    ],
)
def test_parse_range(header, expected):
    assert parse_range(header, 100) == expected


@pytest.mark.parametrize("header", ["bytes=100-", "bytes=-0"])
def test_parse_range_unsatisfiable(header):
    with pytest.raises(ValueError):
        parse_range(header, 100)
