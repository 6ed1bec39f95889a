"""The placement endpoint through a real hypercorn server on 127.0.0.1, with an in-memory
source and with the HTTP source polling a second real server for the locality document."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import httpx
import trio
from fastapi import FastAPI
from hypercorn.config import Config
from hypercorn.trio import serve

from coordinator.app import create_app
from coordinator.scheduling.model import Dataset, Node
from coordinator.scheduling.sources import HttpSource, InMemorySource

GB = 10**9


@asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[str]:
    """Serve ``app`` on an ephemeral 127.0.0.1 port; yields its base URL."""
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app, config, shutdown_trigger=shutdown.wait))
        try:
            yield binds[0]
        finally:
            shutdown.set()


def in_memory() -> InMemorySource:
    return InMemorySource(
        {"imagenet": Dataset("imagenet", 144 * GB, {"n2": 100 * GB, "n3": 44 * GB})},
        {name: Node(name, 8, 8) for name in ("n1", "n2", "n3")},
    )


async def post(base: str, body: object) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base) as client:
        return await client.post("/v1/placement", json=body)


async def test_placement_uses_live_locality() -> None:
    source = in_memory()
    async with serving(create_app(source, source)) as base:
        job = {"name": "train", "gpus": 4, "dataset": "imagenet", "policy": "fifo+locality"}
        response = await post(base, job)
        assert response.status_code == 200
        body = response.json()
        assert body["decision"] == "place"
        assert body["placement"] == [{"node": "n2", "gpus": 4}]
        assert [row["node"] for row in body["ranking"]] == ["n2", "n3", "n1"]
        assert body["locality"]["cached_fraction"] == 1.0
        # The cache moves: the answer follows.
        source.update({"imagenet": Dataset("imagenet", 144 * GB, {"n1": 144 * GB})})
        assert (await post(base, job)).json()["placement"] == [{"node": "n1", "gpus": 4}]


async def test_tdcs_is_the_default_and_wait_is_an_answer() -> None:
    source = in_memory()
    async with serving(create_app(source, source)) as base:
        body = (await post(base, {"name": "j", "gpus": 12, "dataset": "imagenet"})).json()
        assert body["policy"] == "tdcs"
        # S3 = {n2, n3} first (most cached bytes first), then the rest.
        assert body["placement"] == [{"node": "n2", "gpus": 8}, {"node": "n3", "gpus": 4}]
        too_big = (await post(base, {"name": "j", "gpus": 64, "policy": "fifo"})).json()
        assert too_big["decision"] == "wait" and too_big["placement"] == []


async def test_policies_with_models_and_the_policy_list() -> None:
    source = in_memory()
    async with serving(create_app(source, source)) as base:
        job = {
            "name": "q",
            "gpus": 4,
            "max_gpus": 8,
            "policy": "p3-qos+locality",
            "dataset": "imagenet",
            "qos": "prior",
            "model": {"name": "resnet50"},
        }
        body = (await post(base, job)).json()
        assert body["decision"] == "place" and body["predicted_seconds"] > 0
        # An unknown model borrows the most similar known profile (P3).
        borrowed = dict(job, model={"name": "mynet", "forward_flops": 4e9, "memory_bytes": 1e8})
        assert (await post(base, borrowed)).status_code == 200
        async with httpx.AsyncClient(base_url=base) as client:
            names = (await client.get("/v1/placement/policies")).json()["policies"]
        assert "p5-themis+locality" in names and "tdcs-clone" in names


async def test_bad_requests_get_4xx_naming_the_problem() -> None:
    source = in_memory()
    async with serving(create_app(source, source)) as base:
        missing_gpus = await post(base, {"name": "j"})
        assert missing_gpus.status_code == 422
        zero = await post(base, {"name": "j", "gpus": 0})
        assert zero.status_code == 422
        extra = await post(base, {"name": "j", "gpus": 1, "colour": "blue"})
        assert extra.status_code == 422
        unknown = await post(base, {"name": "j", "gpus": 1, "policy": "lottery"})
        assert unknown.status_code == 422
        assert "unknown policy 'lottery'" in unknown.text and "p2-elastic" in unknown.text
        no_data = await post(base, {"name": "j", "gpus": 1, "dataset": "coco"})
        assert no_data.status_code == 404 and "'coco'" in no_data.json()["detail"]
        nodes = await post(base, {"name": "j", "gpus": 1, "candidates": ["n9"]})
        assert nodes.status_code == 404 and "n9" in nodes.json()["detail"]
        no_candidates = await post(base, {"name": "j", "gpus": 1, "candidates": []})
        assert no_candidates.status_code == 422
        # Well formed, but the policy lacks facts it needs: a conflict, not a malformed body.
        roofline = await post(base, {"name": "j", "gpus": 1, "policy": "p4-roofline"})
        assert roofline.status_code == 409 and "forward_flops" in roofline.json()["detail"]
        async with httpx.AsyncClient(base_url=base) as client:
            not_json = await client.post(
                "/v1/placement", content=b"{", headers={"content-type": "application/json"}
            )
        assert not_json.status_code == 422


class Clock:
    """A hand-moved clock for the HTTP source's refresh interval (no sleeping in tests)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def locality_api(document: dict) -> FastAPI:
    """A stand-in for the coordinator's locality API: serves ``document`` as it is now."""
    app = FastAPI()

    @app.get("/v1/locality")
    async def everything() -> dict:
        return document

    return app


async def test_http_source_polls_the_locality_document() -> None:
    document = {
        "datasets": {"imagenet": {"size": 144 * GB, "nodes": {"n3": 144 * GB}}},
        "nodes": {name: {"gpus": 8, "free_gpus": 8} for name in ("n1", "n2", "n3")},
    }
    clock = Clock()
    async with serving(locality_api(document)) as upstream:
        source = HttpSource(f"{upstream}/v1/locality", max_age_s=5.0, clock=clock)
        async with serving(create_app(source, source)) as base:
            job = {"name": "j", "gpus": 2, "dataset": "imagenet", "policy": "fifo+locality"}
            assert (await post(base, job)).json()["placement"] == [{"node": "n3", "gpus": 2}]
            document["datasets"]["imagenet"]["nodes"] = {"n1": 144 * GB}
            # Within max_age_s the snapshot is reused; after it, the new locality is fetched.
            assert (await post(base, job)).json()["placement"] == [{"node": "n3", "gpus": 2}]
            clock.now = 10.0
            assert (await post(base, job)).json()["placement"] == [{"node": "n1", "gpus": 2}]
            # A malformed document is refused with the field named.
            document["nodes"]["n1"]["free_gpus"] = -1
            clock.now = 20.0
            broken = await post(base, job)
            assert broken.status_code == 503
            assert "nodes.n1.free_gpus must be a non-negative integer" in broken.json()["detail"]


async def test_an_unreachable_source_is_503_without_credentials() -> None:
    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    source = HttpSource(f"http://scheduler:s3cret@127.0.0.1:{port}/v1/locality?token=abc")
    async with serving(create_app(source, source)) as base:
        response = await post(base, {"name": "j", "gpus": 1})
    assert response.status_code == 503
    detail = response.json()["detail"]
    assert f"http://127.0.0.1:{port}/v1/locality" in detail and "ConnectError" in detail
    assert "s3cret" not in detail and "token" not in detail and "scheduler" not in detail
