"""The coordinator's HTTP API served for real: ``create_app`` over a ``Coordinator`` on a real
LMDB store, served by hypercorn's trio worker on 127.0.0.1 (an OS-chosen port), spoken to with
httpx.

Auth on every /v1 route (and the placement route), none on /healthz, /metrics and the spec;
malformed requests are 4xx with a message, never 5xx; the dataset, node and preload routes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import trio

from cachefs.protocol import SHARDS, owner_table
from coordinator.api import create_app
from coordinator.service import Coordinator
from coordinator.settings import CoordinatorSettings
from coordinator.state import LmdbStateStore
from tests.fakes.wrappers import served

TOKEN = "test-token-Zq9"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
METRICS = b"# HELP cachefs_test A test gauge\n# TYPE cachefs_test gauge\ncachefs_test 1.0\n"


@dataclass
class Api:
    url: str
    client: httpx.AsyncClient  # sends the token
    coordinator: Coordinator

    async def add(self, name: str = "imagenet", **fields) -> httpx.Response:
        body = {"name": name, "uri": f"s3://bucket/{name}/", **fields}
        return await self.client.post("/v1/datasets", json=body)

    async def beat(self, node: str, **report) -> httpx.Response:
        body = {"address": f"127.0.0.{int(node[1:]) + 1}:7070", **report}
        return await self.client.post(f"/v1/nodes/{node}/heartbeat", json=body)


@pytest.fixture
async def api(tmp_path) -> AsyncIterator[Api]:
    store = LmdbStateStore(tmp_path / "state")
    try:
        coordinator = Coordinator(store, CoordinatorSettings(heartbeat_interval_s=1.0))
        app = create_app(coordinator, TOKEN, metrics_text=lambda: METRICS)
        async with served(app) as address:
            url = f"http://{address}"
            async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as client:
                yield Api(url, client, coordinator)
    finally:
        store.close()


def assert_client_error(response: httpx.Response, *statuses: int) -> None:
    """A 4xx (one of ``statuses`` if given) with a message saying what is wrong."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    if statuses:
        assert response.status_code in statuses, (response.status_code, response.text)
    detail = response.json()["detail"]
    assert detail, response.text


# --- auth ----------------------------------------------------------------------------------------


def fill(path: str) -> str:
    for placeholder, value in [
        ("{name}", "imagenet"), ("{node}", "n1"), ("{job_id}", "job-1"), ("{copy_id}", "A")
    ]:  # fmt: skip
        path = path.replace(placeholder, value)
    return path


async def operations(api: Api) -> list[tuple[str, str]]:
    response = await api.client.get("/openapi.json", headers={"Authorization": ""})
    assert response.status_code == 200
    spec = response.json()
    return [
        (method.upper(), fill(path))
        for path, item in spec["paths"].items()
        for method in item
        if path.startswith("/v1/")
    ]


async def test_every_v1_route_needs_the_token(api: Api) -> None:
    ops = await operations(api)
    paths = {path for _, path in ops}
    # The spec lists what the API promises; a route missing here would go unchecked.
    for expected in (
        "/v1/datasets",
        "/v1/datasets/imagenet",
        "/v1/datasets/imagenet/preload",
        "/v1/datasets/imagenet/preload/resume",
        "/v1/datasets/imagenet/preload/cancel",
        "/v1/datasets/imagenet/refresh",
        "/v1/datasets/imagenet/locality",
        "/v1/preloads",
        "/v1/preloads/job-1",
        "/v1/nodes",
        "/v1/nodes/n1",
        "/v1/nodes/n1/heartbeat",
        "/v1/locality",
        "/v1/placement",
        "/v1/schedule",
        "/v1/jobs",
        "/v1/jobs/job-1",
        "/v1/jobs/job-1/heartbeat",
        "/v1/datasets/imagenet/copies/A/scale",
        "/v1/events",
    ):
        assert expected in paths
    assert len(ops) >= 24
    async with httpx.AsyncClient(base_url=api.url, timeout=30) as anonymous:
        for method, path in ops:
            for headers in (
                {},
                {"Authorization": "Bearer wrong-token"},
                {"Authorization": f"Bearer {TOKEN}x"},
                {"Authorization": f"Basic {TOKEN}"},
                {"Authorization": TOKEN},
                {"Authorization": "Bearer"},
                {"Authorization": "tëst".encode()},
                {"Authorization": f"Bearer {TOKEN}\u00e9".encode()},
            ):
                # A valid body, so that only the token can be what is wrong.
                response = await anonymous.request(method, path, headers=headers, json={})
                assert response.status_code == 401, (method, path, headers, response.text)
                assert response.headers["www-authenticate"] == "Bearer"
                assert response.json()["detail"]
    # Nothing was done.
    assert api.coordinator.model.datasets == {} and api.coordinator.model.nodes == {}


async def test_health_metrics_and_spec_need_no_token(api: Api) -> None:
    async with httpx.AsyncClient(base_url=api.url, timeout=30) as anonymous:
        health = await anonymous.get("/healthz")
        assert health.status_code == 200
        assert health.json() == {"ok": True, "cluster_id": api.coordinator.cluster_id}
        metrics = await anonymous.get("/metrics")
        assert metrics.status_code == 200
        assert metrics.content == METRICS
        assert metrics.headers["content-type"].startswith("text/plain")
        spec = await anonymous.get("/openapi.json")
        assert spec.status_code == 200
        assert spec.json()["info"]["title"] == "cachefs coordinator"
    # With a wrong token they still answer.
    assert (await api.client.get("/healthz", headers={"Authorization": "Bearer x"})).is_success


async def test_metrics_without_a_metrics_function(tmp_path) -> None:
    store = LmdbStateStore(tmp_path / "state")
    try:
        app = create_app(Coordinator(store), TOKEN)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as c:
            response = await c.get("/metrics")
        assert response.status_code == 200 and response.content == b""
    finally:
        store.close()


# --- datasets ------------------------------------------------------------------------------------


async def test_dataset_lifecycle(api: Api) -> None:
    client = api.client
    assert (await client.get("/v1/datasets")).json() == []
    created = await api.add("imagenet", block_size=1 << 20, region="eu-west-1")
    assert created.status_code == 201, created.text
    body = created.json()
    assert (body["name"], body["uri"], body["block_size"]) == (
        "imagenet",
        "s3://bucket/imagenet/",
        1 << 20,
    )
    assert body["region"] == "eu-west-1"
    assert [(c["id"], c["nodes"], c["running_jobs"]) for c in body["copies"]] == [("A", [], 0)]

    got = await client.get("/v1/datasets/imagenet")
    assert got.status_code == 200 and got.json()["uri"] == "s3://bucket/imagenet/"
    assert [d["name"] for d in (await client.get("/v1/datasets")).json()] == ["imagenet"]

    duplicate = await api.add("imagenet")
    assert_client_error(duplicate, 409)
    assert duplicate.json()["kind"] == "DatasetExists"

    refreshed = await client.post("/v1/datasets/imagenet/refresh")
    assert refreshed.status_code == 200 and refreshed.json()["refresh_epoch"] == 1

    locality = await client.get("/v1/datasets/imagenet/locality")
    assert locality.status_code == 200
    assert locality.json()["dataset"] == "imagenet" and locality.json()["nodes"] == []

    removed = await client.delete("/v1/datasets/imagenet")
    assert removed.status_code == 200 and removed.json() == {"name": "imagenet", "removed": True}
    assert_client_error(await client.get("/v1/datasets/imagenet"), 404)
    assert_client_error(await client.delete("/v1/datasets/imagenet"), 404)
    assert (await client.get("/v1/datasets")).json() == []
    assert (await api.add("imagenet")).status_code == 201


async def test_unknown_things_are_404(api: Api) -> None:
    client = api.client
    for method, path in [
        ("GET", "/v1/datasets/nope"),
        ("DELETE", "/v1/datasets/nope"),
        ("POST", "/v1/datasets/nope/refresh"),
        ("GET", "/v1/datasets/nope/locality"),
        ("GET", "/v1/datasets/nope/preload"),
        ("POST", "/v1/datasets/nope/preload/resume"),
        ("POST", "/v1/datasets/nope/preload/cancel"),
        ("GET", "/v1/nodes/n9"),
        ("GET", "/v1/preloads/nope-0000000000000-abcd"),
    ]:
        response = await client.request(method, path)
        assert_client_error(response, 404)
        assert response.json()["kind"] in ("DatasetNotFound", "NodeNotFound", "PreloadNotFound")
    assert_client_error(await client.post("/v1/datasets/nope/preload", json={}), 404)
    # A dataset with no preload job yet: the dataset exists, so not a 404 but a conflict.
    await api.add("imagenet")
    for method, path in [
        ("GET", "/v1/datasets/imagenet/preload"),
        ("POST", "/v1/datasets/imagenet/preload/resume"),
        ("POST", "/v1/datasets/imagenet/preload/cancel"),
    ]:
        response = await client.request(method, path)
        assert_client_error(response, 409)
        assert response.json()["kind"] == "NoPreloadJob"
    # A copy the body names and the dataset lacks: a conflict (404 is for the URL's dataset).
    response = await client.post("/v1/datasets/imagenet/preload", json={"copy": "Z"})
    assert_client_error(response, 409)
    assert response.json()["kind"] == "StateConflict"
    assert_client_error(await client.get("/v1/no-such-route"), 404)


BAD_DATASETS = [
    {},
    {"name": "x"},
    {"uri": "s3://b/"},
    {"name": 5, "uri": "s3://b/"},
    {"name": None, "uri": "s3://b/"},
    {"name": "../x", "uri": "s3://b/"},
    {"name": "a/b", "uri": "s3://b/"},
    {"name": ".hidden", "uri": "s3://b/"},
    {"name": "", "uri": "s3://b/"},
    {"name": "a" * 65, "uri": "s3://b/"},
    {"name": "x" * 100_000, "uri": "s3://b/"},
    {"name": "ok", "uri": ""},
    {"name": "ok", "uri": "s3://b/" + "x" * 5000},
    {"name": "ok", "uri": ["s3://b/"]},
    {"name": "ok", "uri": "s3://b/", "bogus": 1},
    {"name": "ok", "uri": "s3://b/", "extra": {"a": 1}},
    {"name": "ok", "uri": "s3://b/", "slot": 3},
    {"name": "ok", "uri": "s3://b/", "block_size": -1},
    {"name": "ok", "uri": "s3://b/", "block_size": 1},
    {"name": "ok", "uri": "s3://b/", "block_size": 1 << 40},
    {"name": "ok", "uri": "s3://b/", "block_size": "big"},
    {"name": "ok", "uri": "s3://b/", "timeout_s": 0},
    {"name": "ok", "uri": "s3://b/", "timeout_s": -3},
    {"name": "ok", "uri": "s3://b/", "timeout_s": 10_000},
    {"name": "ok", "uri": "s3://b/", "refresh_interval_s": -1},
    {"name": "ok", "uri": "s3://b/", "path_style": "maybe"},
    # JSON types are not converted (the spec says boolean, integer).
    {"name": "ok", "uri": "s3://b/", "path_style": 1},
    {"name": "ok", "uri": "s3://b/", "block_size": "4194304"},
    {"name": "ok", "uri": "s3://b/", "block_size": True},
    {"name": "ok", "uri": "s3://b/", "block_size": 4194304.5},
    {"name": "ok", "uri": "s3://b/", "region": "r" * 1000},
    [],
    ["name", "uri"],
    "imagenet",
    None,
    12,
]


@pytest.mark.parametrize("body", BAD_DATASETS)
async def test_malformed_dataset_bodies_are_4xx(api: Api, body) -> None:
    response = await api.client.post("/v1/datasets", json=body)
    assert_client_error(response, 422)
    assert api.coordinator.model.datasets == {}


RAW_BODIES = [
    b"",
    b"not json",
    b'{"name": "ok", "uri": "s3://b/"',  # truncated
    b'{"name": "ok", "uri": "s3://b/", "timeout_s": NaN}',
    b'{"name": "ok", "uri": "s3://b/", "timeout_s": Infinity}',
    b"\xff\xfe\x00garbage",
    b"[" * 10_000 + b"]" * 10_000,
]


@pytest.mark.parametrize("raw", RAW_BODIES, ids=range(len(RAW_BODIES)))
async def test_unparseable_bodies_are_4xx(api: Api, raw: bytes) -> None:
    headers = {"Content-Type": "application/json"}
    # 400 only for what the JSON reader itself gives up on (nested too deep).
    response = await api.client.post("/v1/datasets", content=raw, headers=headers)
    assert_client_error(response, 400, 422)
    await api.add("imagenet")
    response = await api.client.post("/v1/datasets/imagenet/preload", content=raw, headers=headers)
    assert_client_error(response, 400, 422)
    response = await api.client.post("/v1/nodes/n1/heartbeat", content=raw, headers=headers)
    assert_client_error(response, 400, 422)
    assert api.coordinator.model.nodes == {} and api.coordinator.model.preloads == {}


BAD_PRELOADS = [
    {"fraction": 2.0},
    {"fraction": 0},
    {"fraction": -0.5},
    {"fraction": "half"},
    {"fraction": 0.5, "bytes": 1000},
    {"fraction": True},
    {"bytes": "1000"},
    {"bytes": False},
    {"bytes": -1},
    {"bytes": 0},
    {"bytes": 1.5},
    {"paths": ["../x"]},
    {"paths": ["a/../../etc"]},
    {"paths": ["/abs"]},
    {"paths": ["a/.."]},
    {"paths": [".."]},
    {"paths": ["a\u0000b"]},
    {"paths": "train"},
    {"paths": [1, 2]},
    {"paths": ["x" * 5000]},
    {"paths": ["p"] * 1001},
    {"at": -5},
    {"at": "tomorrow"},
    {"copy": "../A"},
    {"unknown": 1},
    {"fraction": 0.5, "priority": "high"},
]


@pytest.mark.parametrize("body", BAD_PRELOADS)
async def test_malformed_preload_bodies_are_4xx(api: Api, body) -> None:
    await api.add("imagenet")
    response = await api.client.post("/v1/datasets/imagenet/preload", json=body)
    assert_client_error(response, 422)
    assert api.coordinator.model.preloads == {}


GOOD_SHARDS = {"shards": {"0": 10, "1023": 5}}
BAD_HEARTBEATS = [
    {},
    {"address": "no-port"},
    {"address": "host:port"},
    {"address": "h:123456"},
    {"address": "h:1/x"},
    # Addresses no peer can dial (a fuzzer's "0:0" registered a phantom node).
    {"address": "0:0"},
    {"address": "0.0.0.0:7070"},
    {"address": "h:0"},
    {"address": "h:65536"},
    {"address": "h:1", "gpus": True},
    {"address": "h:1", "gpus": "8"},
    {"address": "h:1", "tasks_done": {"t-1": {"freed_bytes": False}}},
    {"address": "h:1", "fills": {"f": {"copy": "A", "id": "A-1", "done": 1}}},
    {"address": "h:1", "datasets": {"d": {"shards": {"007": 1}}}},
    {"address": 7},
    {"address": "h:1", "gpus": -1},
    {"address": "h:1", "gpus": 10**6},
    {"address": "h:1", "gpus": "eight"},
    {"address": "h:1", "tiers": "ram"},
    {"address": "h:1", "tiers": [{"name": "ram", "capacity": -1, "used": 0}]},
    {"address": "h:1", "tiers": [{"name": "ram"}]},
    {"address": "h:1", "tiers": [{"name": "r", "capacity": 1, "used": 0}] * 17},
    {"address": "h:1", "datasets": {"d": {"shards": {"1024": 1}}}},
    {"address": "h:1", "datasets": {"d": {"shards": {"-1": 1}}}},
    {"address": "h:1", "datasets": {"d": {"shards": {"x": 1}}}},
    {"address": "h:1", "datasets": {"d": {"shards": {" 1": 1}}}},
    {"address": "h:1", "datasets": {"d": {"shards": {"1.0": 1}}}},
    {"address": "h:1", "datasets": {"d": {"shards": {"²": 1}}}},
    {"address": "h:1", "datasets": {"d": {"shards": {"١": 1}}}},
    {"address": "h:1", "datasets": {"d": {"shards": {"99999999999999999999": 1}}}},
    {"address": "h:1", "datasets": {"d": {"cached_bytes": -5}}},
    {"address": "h:1", "datasets": {"d": {"shards": {"1": "lots"}}}},
    {"address": "h:1", "datasets": ["d"]},
    {"address": "h:1", "preloads": {"job": {"1024": {}}}},
    {"address": "h:1", "preloads": {"job": {"-3": {}}}},
    {"address": "h:1", "preloads": {"job": {"abc": {}}}},
    {"address": "h:1", "preloads": {"job": {"²": {}}}},
    {"address": "h:1", "preloads": {"job": {"0": {"done_bytes": -1}}}},
    {"address": "h:1", "preloads": {"job": {"0": {"complete": "sort of"}}}},
    {"address": "h:1", "preloads": {"job": []}},
]


@pytest.mark.parametrize("body", BAD_HEARTBEATS)
async def test_malformed_heartbeats_are_4xx(api: Api, body) -> None:
    response = await api.client.post("/v1/nodes/n1/heartbeat", json=body)
    assert_client_error(response, 422)
    assert api.coordinator.model.nodes == {}


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/datasets/-x"),
        ("GET", "/v1/datasets/" + "a" * 65),
        ("GET", "/v1/datasets/a%20b"),
        ("GET", "/v1/datasets/%2E%2E%2Fx"),
        ("DELETE", "/v1/datasets/.x"),
        ("POST", "/v1/datasets/a%00b/refresh"),
        ("GET", "/v1/nodes/-n"),
        ("POST", "/v1/nodes/" + "n" * 65 + "/heartbeat"),
        ("GET", "/v1/preloads/" + "j" * 201),
    ],
)
async def test_bad_names_in_paths_are_4xx(api: Api, method: str, path: str) -> None:
    response = await api.client.request(method, path, json={"address": "h:1"})
    assert_client_error(response)
    assert api.coordinator.model.nodes == {}


async def test_values_json_cannot_carry_are_refused(api: Api) -> None:
    """Whatever is accepted must be answerable: an ``at`` of Infinity (Python's json reads it)
    or a string with a lone surrogate would be stored and then break every later answer."""
    await api.add("imagenet")
    headers = {"Content-Type": "application/json"}
    for raw in (
        b'{"at": Infinity}',
        b'{"at": NaN}',
        b'{"paths": ["train/\\ud800"]}',
    ):
        response = await api.client.post(
            "/v1/datasets/imagenet/preload", content=raw, headers=headers
        )
        assert_client_error(response, 422)
    raw = b'{"name": "coco", "uri": "s3://b/\\udfff"}'
    assert_client_error(await api.client.post("/v1/datasets", content=raw, headers=headers))
    raw = b'{"address": "h:1", "tiers": [{"name": "\\ud800", "capacity": 1, "used": 0}]}'
    assert_client_error(
        await api.client.post("/v1/nodes/n1/heartbeat", content=raw, headers=headers)
    )
    # Everything still answers.
    for path in ("/v1/datasets", "/v1/preloads", "/v1/nodes", "/v1/locality"):
        assert (await api.client.get(path)).status_code == 200, path


# --- nodes and preload ---------------------------------------------------------------------------


async def test_heartbeat_nodes_and_locality(api: Api) -> None:
    await api.add("imagenet")
    tiers = [{"name": "ram", "capacity": 1000, "used": 100}]
    report = {"bytes": 1000, "files": 4, "cached_bytes": 250, **GOOD_SHARDS}
    response = await api.beat("n1", gpus=8, tiers=tiers, datasets={"imagenet": report})
    assert response.status_code == 200, response.text
    view = response.json()
    assert view["nodes"] == {"n1": {"address": "127.0.0.2:7070", "up": True}}
    assert view["datasets"][0]["copies"] == {"A": ["n1"]}
    assert view["cluster_id"] == api.coordinator.cluster_id

    node = (await api.client.get("/v1/nodes/n1")).json()
    assert (node["state"], node["gpus"], node["tiers"]) == ("up", 8, tiers)
    assert node["datasets"] == [{"dataset": "imagenet", "cached_bytes": 250, "fraction": 0.25}]
    assert [n["node"] for n in (await api.client.get("/v1/nodes")).json()] == ["n1"]
    locality = (await api.client.get("/v1/datasets/imagenet/locality")).json()
    assert locality["cached_bytes"] == 250 and locality["fraction"] == 0.25
    document = (await api.client.get("/v1/locality")).json()
    assert document["datasets"]["imagenet"] == {"size": 1000, "nodes": {"n1": 250}}
    assert document["nodes"]["n1"]["gpus"] == 8
    placement = await api.client.post(
        "/v1/placement", json={"name": "job", "dataset": "imagenet", "gpus": 2}
    )
    assert placement.status_code == 200, placement.text
    assert placement.json()["placement"] == [{"node": "n1", "gpus": 2}]


async def test_preload_over_http(api: Api) -> None:
    client = api.client
    await api.add("imagenet")
    await api.beat("n1")
    await api.beat("n2")
    started = await client.post(
        "/v1/datasets/imagenet/preload", json={"paths": ["train"], "fraction": 0.5}
    )
    assert started.status_code == 201, started.text
    job = started.json()
    assert job["state"] == "running"
    assert job["selection"] == {"paths": ["train"], "fraction": 0.5, "bytes": None, "at": None}
    assert (await client.get("/v1/datasets/imagenet/preload")).json()["id"] == job["id"]
    assert (await client.get(f"/v1/preloads/{job['id']}")).json()["id"] == job["id"]
    assert [j["id"] for j in (await client.get("/v1/preloads")).json()] == [job["id"]]

    owners = owner_table("imagenet", ["n1", "n2"])
    for node in ("n1", "n2"):
        shards = {
            str(s): {
                "objects": 1,
                "bytes": 10,
                "done_objects": 1,
                "done_bytes": 10,
                "complete": True,
            }
            for s in range(SHARDS)
            if owners[s] == node
        }
        view = (await api.beat(node, preloads={job["id"]: shards})).json()
    assert view["preloads"] == []
    status = (await client.get("/v1/datasets/imagenet/preload")).json()
    assert status["state"] == "completed"
    assert status["bytes_done"] == 10 * SHARDS

    resumed = await client.post("/v1/datasets/imagenet/preload/resume")
    assert resumed.status_code == 200
    assert resumed.json()["id"] != job["id"] and resumed.json()["state"] == "running"
    cancelled = await client.post("/v1/datasets/imagenet/preload/cancel")
    assert cancelled.status_code == 200
    assert cancelled.json()["state"] == "cancelled"
    assert cancelled.json()["id"] == resumed.json()["id"]

    scheduled = await client.post(
        "/v1/datasets/imagenet/preload", json={"bytes": 5000, "at": 4e9, "copy": "A"}
    )
    assert scheduled.status_code == 201 and scheduled.json()["state"] == "scheduled"

    # The body is JSON all the way: no non-standard numbers in any answer.
    def refuse(constant: str) -> None:
        raise AssertionError(f"non-standard JSON number {constant}")

    for path in ("/v1/preloads", "/v1/datasets", "/v1/nodes", "/v1/locality"):
        json.loads((await client.get(path)).text, parse_constant=refuse)


# --- jobs, scaling, events -----------------------------------------------------------------------


async def test_jobs_over_http_with_a_long_poll_for_promotion(api: Api) -> None:
    client = api.client
    created = await api.add("imagenet", max_jobs_per_copy=1, overflow="suspend", cleanup="ttl:6h")
    assert created.status_code == 201, created.text
    assert (created.json()["max_jobs_per_copy"], created.json()["cleanup"]) == (1, "ttl:6h")
    await api.beat("n1")
    await api.beat("n2")
    first = await client.post("/v1/jobs", json={"id": "j1", "dataset": "imagenet", "nodes": 2})
    assert first.status_code == 201, first.text
    assert (first.json()["state"], first.json()["nodes"]) == ("running", ["n1", "n2"])
    second = (await client.post("/v1/jobs", json={"id": "j2", "dataset": "imagenet"})).json()
    assert (second["state"], second["position"]) == ("suspended", 1)
    duplicate = await client.post("/v1/jobs", json={"id": "j2", "dataset": "imagenet", "nodes": 2})
    assert_client_error(duplicate, 409)

    answers = []

    async def long_poll() -> None:
        answers.append(await client.get("/v1/jobs/j2", params={"wait": 30}))

    with trio.fail_after(20):  # the poll must end at the promotion, not at its 30 s limit
        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_poll)
            await trio.sleep(0.5)
            assert not answers  # still waiting: j2 is suspended
            released = (await client.delete("/v1/jobs/j1")).json()
            assert released == {"id": "j1", "released": True, "reason": "released",
                                "promoted": ["j2"]}  # fmt: skip
    assert answers[0].status_code == 200 and answers[0].json()["state"] == "running"
    listed = (await client.get("/v1/jobs", params={"dataset": "imagenet"})).json()
    assert [(j["id"], j["state"]) for j in listed] == [("j2", "running")]
    renewed = await client.post("/v1/jobs/j2/heartbeat")
    assert renewed.json()["lease_expires_in_s"] == 600
    assert (await client.get("/v1/jobs/j1")).status_code == 404
    events = (await client.get("/v1/events", params={"dataset": "imagenet"})).json()
    assert any("promoted" in e["message"] for e in events)
    dataset = (await client.get("/v1/datasets/imagenet")).json()
    assert dataset["jobs"] == {"running": 1, "suspended": 0}


async def test_policy_change_over_http(api: Api) -> None:
    await api.add("imagenet", max_jobs_per_copy=3)
    changed = await api.client.patch("/v1/datasets/imagenet", json={"overflow": "clone"})
    assert changed.status_code == 200, changed.text
    assert (changed.json()["overflow"], changed.json()["max_jobs_per_copy"]) == ("clone", 3)
    unlimited = await api.client.patch("/v1/datasets/imagenet", json={"max_jobs_per_copy": None})
    assert unlimited.json()["max_jobs_per_copy"] is None
    for body in ({"cleanup": "often"}, {"overflow": None}, {"uri": "s3://x/"}, {"cleanup": 5}):
        assert_client_error(await api.client.patch("/v1/datasets/imagenet", json=body))
    assert_client_error(await api.client.patch("/v1/datasets/nope", json={}), 404)


async def test_scale_over_http(api: Api) -> None:
    client = api.client
    await api.add("imagenet", nodes=["n1"])
    for node in ("n1", "n2", "n3"):
        await api.beat(node)
    scaled = await client.post(
        "/v1/datasets/imagenet/copies/A/scale", json={"add": ["n2"], "remove": []}
    )
    assert scaled.status_code == 200, scaled.text
    assert scaled.json()["copies"][0]["nodes"] == ["n1", "n2"]
    assert scaled.json()["moved_shards"] > 0
    busy = await client.post("/v1/datasets/imagenet/copies/A/scale", json={"add": ["n3"]})
    assert_client_error(busy, 409)
    missing = await client.post("/v1/datasets/imagenet/copies/Z/scale", json={"add": ["n3"]})
    assert_client_error(missing, 404)
    unknown = await client.post("/v1/datasets/nope/copies/A/scale", json={"add": ["n3"]})
    assert_client_error(unknown, 404)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"id": "j", "dataset": "imagenet", "nodes": 0},
        {"id": "j", "dataset": "imagenet", "nodes": "many"},
        {"id": "j", "dataset": "imagenet", "candidates": ["../x"]},
        {"id": "j", "dataset": "imagenet", "candidates": "n1"},
        {"id": "j", "dataset": "imagenet", "candidates": []},
        {"id": "j", "dataset": "imagenet", "nodes": True},
        {"id": "j", "dataset": "imagenet", "lease_s": -1},
        {"id": "j", "dataset": "imagenet", "lease_s": "Infinity"},
        {"id": "j/..", "dataset": "imagenet"},
        {"id": "j", "dataset": "imagenet", "extra": 1},
        {"id": "j", "dataset": "nope"},
        {"id": "j", "dataset": "imagenet", "nodes": 3},  # only one node is up
    ],
)
async def test_malformed_job_bodies_are_4xx(api: Api, body) -> None:
    await api.add("imagenet")
    await api.beat("n1")
    assert_client_error(await api.client.post("/v1/jobs", json=body))
    assert api.coordinator.manager.jobs.by_id == {}


@pytest.mark.parametrize(
    "fields",
    [
        {"max_jobs_per_copy": 0},
        {"overflow": "share"},
        {"cleanup": "ttl:"},
        {"cleanup": "ttl:-5s"},
        {"cleanup": "ttl:0"},
        {"cleanup": "ttl:0ms"},
        {"cleanup": "ttl:0.000"},
        {"cleanup": "ttl:.5h"},
        {"cleanup": "ttl:5.m"},
        {"cleanup": "fifo"},
        {"nodes": []},
        {"nodes": ["a b"]},
    ],
)
async def test_malformed_sharing_policies_are_4xx(api: Api, fields) -> None:
    assert_client_error(await api.add("imagenet", **fields))
    assert api.coordinator.model.datasets == {}


# --- the spec is the contract: what it allows is served, what it forbids is a 422 --------------
# (cases a schema fuzzer found; tests/e2e/coordinator/test_api_fuzz.py runs the fuzzer itself)


async def test_what_the_spec_allows_is_served(api: Api) -> None:
    client = api.client
    # ttl: durations the spec's pattern admits (it once admitted "ttl:5." and "ttl:0ms", which
    # the reader refused with a 400).
    for i, cleanup in enumerate(("ttl:5m", "ttl:0.5d", "ttl:007.25h", "ttl:250ms", "ttl:0.001")):
        added = await api.add(f"d{i}", cleanup=cleanup)
        assert added.status_code == 201, added.text
        assert added.json()["cleanup"] == cleanup
    # JSON Schema counts 5.0 as an integer.
    added = await api.add("floaty", block_size=4194304.0, max_jobs_per_copy=2.0)
    assert added.status_code == 201, added.text
    assert (added.json()["block_size"], added.json()["max_jobs_per_copy"]) == (4194304, 2)
    # A fraction or a byte budget, the other null (the CLI sends both keys).
    for body in ({"fraction": 0.5, "bytes": None}, {"fraction": None, "bytes": 1000}):
        started = await client.post("/v1/datasets/d0/preload", json=body)
        assert started.status_code == 201, started.text
    # Only the fields given change; max_jobs_per_copy may be null (no limit).
    changed = await client.patch("/v1/datasets/d0", json={"max_jobs_per_copy": None})
    assert changed.status_code == 200, changed.text
    assert changed.json()["cleanup"] == "ttl:5m"


async def test_the_spec_says_what_is_refused(api: Api) -> None:
    spec = (await api.client.get("/openapi.json")).json()
    schemas = spec["components"]["schemas"]
    preload_not = schemas["PreloadIn"]["not"]
    assert preload_not["required"] == ["fraction", "bytes"]
    candidates = schemas["JobIn"]["properties"]["candidates"]["anyOf"][0]
    assert candidates["minItems"] == 1
    overflow = schemas["PolicyIn"]["properties"]["overflow"]
    assert overflow["enum"] == ["suspend", "clone"] and "default" not in overflow
    policy = schemas["PlacementRequest"]["properties"]["policy"]
    known = (await api.client.get("/v1/placement/policies")).json()["policies"]
    assert policy["enum"] == known and "tdcs" in known
    extender_body = spec["paths"]["/scheduler/filter"]["post"]["requestBody"]
    assert extender_body["required"] is False
    # The refusals themselves: 422 naming the field, nothing stored.
    await api.add("imagenet")
    both = {"fraction": 0.5, "bytes": 9}
    both = await api.client.post("/v1/datasets/imagenet/preload", json=both)
    assert_client_error(both, 422)
    assert "not both" in both.json()["detail"][0]["msg"]
    null = await api.client.patch("/v1/datasets/imagenet", json={"cleanup": None})
    assert_client_error(null, 422)
    assert null.json()["detail"][0]["loc"] == ["body", "cleanup"]
    phantom = await api.client.post("/v1/nodes/phantom/heartbeat", json={"address": "0:0"})
    assert_client_error(phantom, 422)
    assert phantom.json()["detail"][0]["loc"] == ["body", "address"]
    assert (await api.client.get("/v1/nodes")).json() == []
    assert api.coordinator.model.preloads == {}


async def test_refusals_for_the_cluster_state_are_404_or_409(api: Api) -> None:
    client = api.client
    await api.add("imagenet", nodes=["n1"])
    await api.add("coco", nodes=["n2"])
    too_few = await client.post("/v1/jobs", json={"id": "j", "dataset": "imagenet", "nodes": 1})
    assert_client_error(too_few, 409)  # no node is up yet
    assert too_few.json()["kind"] == "StateConflict"
    for node in ("n1", "n2"):
        assert (await api.beat(node)).status_code == 200
    scale = "/v1/datasets/imagenet/copies/A/scale"
    clash = await client.post("/v1/datasets/coco/copies/A/scale", json={"add": ["n1"]})
    assert clash.status_code in (200, 409), clash.text  # n1 is in another dataset's copy: fine
    absent = await client.post(scale, json={"remove": ["n2"]})
    assert_client_error(absent, 409)
    assert absent.json()["kind"] == "StateConflict"
    empty = await client.post(scale, json={"remove": ["n1"]})
    assert_client_error(empty, 409)
    assert "at least one node" in empty.json()["detail"]
    # The placement endpoint: unknown candidates are 404, a policy lacking facts is 409.
    job = {"name": "j", "gpus": 1, "dataset": "imagenet"}
    unknown = await client.post("/v1/placement", json={**job, "candidates": ["n9"]})
    assert_client_error(unknown, 404)
    assert "n9" in unknown.json()["detail"]
    roofline = await client.post("/v1/placement", json={**job, "policy": "p4-roofline"})
    assert_client_error(roofline, 409)
    for body in ({**job, "candidates": []}, {**job, "policy": "lottery"}, {**job, "gpus": True}):
        assert_client_error(await client.post("/v1/placement", json=body), 422)
    placed = await client.post("/v1/placement", json={**job, "candidates": ["n1"]})
    assert placed.status_code == 200, placed.text


async def test_a_405_names_every_method_of_the_path(api: Api) -> None:
    """Starlette named only the first route's method (FastAPI makes one route per method)."""
    spec = (await api.client.get("/openapi.json")).json()
    checked = 0
    for path, item in spec["paths"].items():
        served = sorted(method.upper() for method in item)
        other = next(m for m in ("PUT", "OPTIONS", "PATCH", "DELETE", "POST") if m not in served)
        response = await api.client.request(other, fill(path))
        assert response.status_code == 405, (other, path, response.text)
        assert response.headers["allow"].split(", ") == served, (path, response.headers)
        checked += 1
    assert checked >= 25


async def test_the_extender_answers_a_missing_body_as_the_spec_says(api: Api) -> None:
    async with httpx.AsyncClient(base_url=api.url, timeout=30) as kube_scheduler:
        answer = await kube_scheduler.post("/scheduler/filter")
        assert answer.status_code == 200
        assert answer.json()["Error"].startswith("cachefs extender: ")
        scores = await kube_scheduler.post("/scheduler/prioritize")
        assert (scores.status_code, scores.json()) == (200, [])


async def test_docs_load_without_any_other_host(api: Api) -> None:
    """/docs and /redoc reference only this server; every asset they name loads."""
    async with httpx.AsyncClient(base_url=api.url, timeout=30) as browser:
        for page in ("/docs", "/redoc"):
            html = (await browser.get(page)).text
            assert "://" not in html, html  # no absolute URL: no CDN, no font service
            assets = re.findall(r'(?:src|href|spec-url)="([^"]+)"', html)
            assets += re.findall(r"url: '([^']+)'", html)
            assert any(a.endswith(".js") for a in assets) and "/openapi.json" in assets, assets
            for asset in assets:
                assert asset.startswith("/"), asset
                loaded = await browser.get(asset)
                assert loaded.status_code == 200, asset
                assert len(loaded.content) > 1000, asset
        swagger = (await browser.get("/docs")).text
        assert '"validatorUrl": null' in swagger  # the validator badge calls a public service
        bundle = await browser.get("/docs-assets/swagger-ui-bundle.js")
        assert bundle.headers["content-type"].startswith("text/javascript")
        assert b"SwaggerUIBundle" in bundle.content


async def test_preload_cancel_exits_0(api: Api, tmp_path) -> None:
    """`cachefs preload cancel` (the real CLI, as a process) exits 0 once the job is cancelled,
    also when it had ended already; a dataset with no job is one line and exit 1."""
    await api.add("imagenet")
    started = await api.client.post("/v1/datasets/imagenet/preload", json={})
    assert started.status_code == 201, started.text
    env = {**os.environ, "CACHEFS_TOKEN": TOKEN, "PYTHONPATH": REPO_ROOT}
    cli = [sys.executable, "-m", "cachefs", "--coordinator", api.url, "--state", str(tmp_path)]

    async def cancel(dataset: str) -> subprocess.CompletedProcess:
        return await trio.run_process(
            [*cli, "preload", "cancel", dataset],
            env=env,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )

    for _ in range(2):  # the second finds it cancelled already
        done = await cancel("imagenet")
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert b"cancelled" in done.stdout, done.stdout
    assert api.coordinator.model.preloads[started.json()["id"]].state == "cancelled"
    await api.add("coco")
    none = await cancel("coco")
    assert none.returncode == 1, (none.stdout, none.stderr)
    assert none.stderr.decode().strip().count("\n") == 0, none.stderr
    assert b"has no preload job" in none.stderr


async def test_a_job_of_next_to_no_samples_is_placed_by_every_policy(api: Api) -> None:
    """A schema fuzzer's find: P3 divided by a predicted time that underflowed to 0 (a 500)."""
    await api.beat("n1", gpus=8)
    policies = (await api.client.get("/v1/placement/policies")).json()["policies"]
    for policy in policies:
        job = {"name": "j", "gpus": 1, "policy": policy, "epochs": 5e-324}
        response = await api.client.post("/v1/placement", json=job)
        assert response.status_code in (200, 409), (policy, response.text)  # 409: P4's facts
        if response.status_code == 200:
            assert response.json()["decision"] == "place", (policy, response.text)
