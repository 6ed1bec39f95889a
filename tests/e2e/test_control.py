"""The worker's control API answers every error through its one table (cachefs.control.
ERROR_STATUSES) with {"error", "message"}; anything the table does not list is 500. The rows a
request can reach are checked against a real worker process and a real S3 endpoint (moto)."""

from __future__ import annotations

import uuid

import httpx
import pytest

from cachefs.control import ERROR_STATUSES, UNEXPECTED_STATUS, create_control_app, status_of
from cachefs.errors import (
    CachefsError,
    ConfigError,
    CorruptBlock,
    DatasetExists,
    DatasetNotFound,
    EmptySource,
    InvalidURI,
    ObjectChanged,
    PathNotFound,
    PreloadNotFound,
    StoreAuthError,
    StoreBucketNotFound,
    StoreThrottled,
    StoreUnavailable,
)
from tests.worker_process import WorkerProcess


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (DatasetNotFound("no dataset named 'x'"), 404),
        (PathNotFound("'a' not found in dataset 'x'"), 404),
        (PreloadNotFound("no preload job of dataset 'x'"), 404),
        (DatasetExists("dataset 'x' already exists"), 409),
        (ConfigError("bad size"), 400),
        (InvalidURI("bad scheme"), 400),
        (EmptySource("x", "s3://b/p"), 400),
        (StoreAuthError("access denied"), 424),
        (StoreBucketNotFound("no such bucket"), 424),
        (StoreUnavailable("timed out"), 502),
        (StoreThrottled("slow down"), 502),
        (ObjectChanged("etag changed"), 502),
        # Not in the table: the worker failed, not the request.
        (CorruptBlock("checksum mismatch"), UNEXPECTED_STATUS),
        (CachefsError("something"), UNEXPECTED_STATUS),
        (RuntimeError("a bug"), UNEXPECTED_STATUS),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else str(value),
)
def test_each_error_gets_the_status_of_its_first_row(error, status):
    assert status_of(error) == status


def test_the_table_lists_a_subclass_before_its_base():
    for index, (error_class, _) in enumerate(ERROR_STATUSES):
        for earlier, _ in ERROR_STATUSES[:index]:
            assert not issubclass(error_class, earlier), (error_class, earlier)


class _BrokenWorker:
    """A worker whose status call hits a bug."""

    def status(self) -> dict:
        raise KeyError("tiers")


async def test_an_unexpected_exception_is_a_500_with_a_one_line_json_answer():
    app = create_control_app(_BrokenWorker())  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
        response = await client.get("/v1/status")
    assert response.status_code == 500
    body = response.json()
    assert body["error"] == "KeyError"
    assert "internal error in the worker" in body["message"] and "tiers" in body["message"]


@pytest.fixture
def worker(moto_s3, tmp_path):
    w = WorkerProcess(str(tmp_path), env=moto_s3.env).start()
    yield w
    w.cleanup()


def _answer(worker: WorkerProcess, method: str, path: str, **kwargs) -> httpx.Response:
    transport = httpx.HTTPTransport(uds=worker.client.socket_path)
    with httpx.Client(transport=transport, base_url="http://worker", timeout=120) as client:
        return client.request(method, path, **kwargs)


def test_a_real_worker_answers_each_reachable_row(worker, moto_s3):
    bucket = f"cachefs-{uuid.uuid4().hex[:12]}"
    moto_s3.make_bucket(bucket)
    moto_s3.put(bucket, "ds/f.bin", b"f" * 1000)
    spec = {"name": "ds", "uri": f"s3://{bucket}/ds", "endpoint": moto_s3.endpoint}
    assert _answer(worker, "POST", "/v1/datasets", json=spec).status_code == 201

    bad_uri = {**spec, "name": "x", "uri": "ftp://b/x"}
    no_bucket = {**spec, "name": "y", "uri": "s3://no-such-bucket-here/x"}
    missing_file = {"params": {"dataset": "ds", "path": "gone.bin"}}
    cases = [
        (("POST", "/v1/datasets/nope/refresh", {}), 404, "DatasetNotFound"),
        (("GET", "/v1/resolve", missing_file), 404, "PathNotFound"),
        (("POST", "/v1/datasets", {"json": spec}), 409, "DatasetExists"),
        (("POST", "/v1/datasets", {"json": bad_uri}), 400, "InvalidURI"),
        (("POST", "/v1/datasets", {"json": no_bucket}), 424, "StoreBucketNotFound"),
    ]
    for request, status, error in cases:
        method, path, options = request
        response = _answer(worker, method, path, **options)
        assert response.status_code == status, (request, response.text)
        body = response.json()
        assert body["error"] == error, (request, body)
        assert body["message"] and "\n" not in body["message"]
    assert [d["name"] for d in worker.client.datasets()] == ["ds"]  # the refusals changed nothing
