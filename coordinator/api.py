"""The coordinator's HTTP/JSON API (FastAPI; the OpenAPI spec is at ``/openapi.json``, the
browsable docs at ``/docs``).

Every route but ``/healthz``, ``/metrics``, the spec and its docs needs ``Authorization: Bearer
<token>``. The spec is the contract, checked by a schema fuzzer (tests/e2e/coordinator/
test_api_fuzz.py): what a request's form alone decides is in it (request bodies are strict
pydantic models, see :mod:`coordinator.json_types`), so a request it forbids is a 422 naming
the field, and one it allows is served or refused for the cluster's state: 404 (no such dataset,
node, copy, job) or 409, an unavailable state store 503, any other error 500: one mapping, in
:mod:`coordinator.errors` (:func:`~coordinator.errors.http_status`), which documents it. A
method a path does not serve is a 405 whose ``Allow`` lists every method it does. Routes are
plain ``def``: FastAPI runs them in threads, which is what the blocking
:class:`~coordinator.service.Coordinator` wants.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from cachefs.errors import CachefsError, DatasetNotFound
from cachefs.preload_jobs import Selection
from cachefs.protocol import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_FIRST_BYTE_TIMEOUT_S,
    DEFAULT_STORE_TIMEOUT_S,
    DatasetSpec,
)

from .cluster import Cluster
from .docs import serve_docs_offline
from .errors import NoPreloadJob, PreloadNotFound, http_status
from .extender import extender_router
from .json_types import INTEGRAL, STRICT, STRICT_OPEN, JsonDoc, JsonInt
from .scheduling.http import placement_router
from .scheduling.model import Dataset
from .scheduling.queue_api import LiveLocality, schedule_router
from .scheduling.sources import InMemorySource, parse_locality_document
from .service import Coordinator

# Module level: route signatures are resolved from this module's globals (postponed annotations).
BearerCredentials = Annotated[
    HTTPAuthorizationCredentials | None, Depends(HTTPBearer(auto_error=False))
]
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
DatasetName = Annotated[str, Path(pattern=NAME_PATTERN, description="dataset name")]
NodeName = Annotated[str, Path(pattern=NAME_PATTERN, description="node name")]
JobName = Annotated[str, Path(pattern=NAME_PATTERN, description="job name")]
CopyName = Annotated[str, Path(pattern=NAME_PATTERN, description="copy id (A, B, …)")]
NodeList = list[Annotated[str, Field(pattern=NAME_PATTERN)]]
# ttl:<a positive number>[unit], as cachefs.protocol.CleanupPolicy reads it: digits before any
# point (".5" is not read) and a non-zero digit somewhere; bounded so that no float underflows
# to 0 or overflows.
_POSITIVE = r"(0*[1-9][0-9]{0,8}(\.[0-9]{1,9})?|0+\.[0-9]{0,8}[1-9][0-9]{0,8})"
CLEANUP_PATTERN = rf"^(lock|lru|ttl:{_POSITIVE}(ms|s|m|h|d)?)$"
# A peer address other workers can dial: no unspecified host (0, 0.0.0.0), a port in 1..65535.
_PORT = r"([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
ADDRESS_PATTERN = rf"^[A-Za-z0-9.\-]*[A-Za-z1-9\-][A-Za-z0-9.\-]*:{_PORT}$"
# A preload path prefix, as cachefs.preload_jobs.Selection reads it: relative (no leading "/"),
# no ".." component, no NUL.
_SEGMENT = r"([^/\x00.][^/\x00]*|\.([^/\x00.][^/\x00]*)?|\.\.[^/\x00]+)"
PATH_PREFIX_PATTERN = rf"^({_SEGMENT}(/{_SEGMENT}?)*)?$"
# Shard numbers as heartbeats write them (str of an int in [0, SHARDS)).
SHARD_PATTERN = r"^(0|[1-9][0-9]{0,2}|10[01][0-9]|102[0-3])$"
ShardNumber = Annotated[str, Field(pattern=SHARD_PATTERN)]
# Integers with their bounds in the spec (json_types' docstring says why the order matters).
JobsPerCopy = Annotated[int, Field(ge=1, le=1 << 20), INTEGRAL]
PositiveInt = Annotated[int, Field(gt=0), INTEGRAL]
Count = Annotated[int, Field(ge=0), INTEGRAL]
# The spec's "additionalProperties: false" beside the key pattern: other keys are refused.
_SHARD_KEYS_ONLY = Field(json_schema_extra={"additionalProperties": False})


class _Strict(BaseModel):
    model_config = STRICT


class DatasetIn(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    uri: str = Field(min_length=1, max_length=4096, description="s3://, oss:// or file:// URI")
    endpoint: str | None = Field(None, max_length=4096)
    region: str | None = Field(None, max_length=128)
    path_style: bool | None = None
    profile: str | None = Field(None, max_length=256)
    credentials_file: str | None = Field(None, max_length=4096)
    block_size: JsonInt = Field(DEFAULT_BLOCK_SIZE, ge=64 << 10, le=64 << 20)
    timeout_s: float = Field(
        DEFAULT_STORE_TIMEOUT_S, gt=0, le=600, description="one store request, all tries"
    )
    first_byte_timeout_s: float = Field(
        DEFAULT_FIRST_BYTE_TIMEOUT_S, gt=0, le=600, description="one try of a store read"
    )
    refresh_interval_s: float | None = Field(None, gt=0, le=365 * 86400)
    max_jobs_per_copy: JobsPerCopy | None = Field(
        None, description="running jobs per cached copy (no limit if absent)"
    )
    overflow: Literal["suspend", "clone"] = Field(
        "suspend", description="a job over the limit: queue it, or clone the copy for it"
    )
    cleanup: str = Field(
        "lock",
        pattern=CLEANUP_PATTERN,
        description="lock (never freed), lru (under cache pressure) or ttl:<duration>",
    )
    nodes: NodeList | None = Field(
        None, min_length=1, max_length=4096, description="nodes of the first copy (all if absent)"
    )


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


class PolicyIn(_Strict):
    """Only the fields given change; ``max_jobs_per_copy: null`` removes the limit (the others
    cannot be null: a dataset always has an overflow and a cleanup policy)."""

    max_jobs_per_copy: JobsPerCopy | None = None
    # Their defaults are never read: only the fields given change (model_fields_set), so the
    # spec shows no default (and, unlike max_jobs_per_copy, no null).
    overflow: Literal["suspend", "clone"] = Field("suspend", json_schema_extra=_no_default)
    cleanup: str = Field("lock", pattern=CLEANUP_PATTERN, json_schema_extra=_no_default)


class JobIn(_Strict):
    id: str = Field(pattern=NAME_PATTERN, description="the job's name, unique while it lives")
    dataset: str = Field(pattern=NAME_PATTERN)
    nodes: JsonInt = Field(1, ge=1, le=4096, description="how many nodes the job runs on")
    candidates: NodeList | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="S2: nodes the job may run on (all live if absent; an empty list, a job "
        "that may run nowhere, is refused)",
    )
    lease_s: float | None = Field(
        None,
        ge=0,
        le=30 * 86400,
        allow_inf_nan=False,
        description="released unless renewed within this many seconds; 0 = never "
        "(default: the coordinator's --job-lease)",
    )


class ScaleIn(_Strict):
    add: NodeList = Field(default_factory=list, max_length=4096)
    remove: NodeList = Field(default_factory=list, max_length=4096)


class PreloadIn(_Strict):
    """A fraction of each shard's bytes or a byte budget, not both."""

    model_config = {
        **STRICT,
        "json_schema_extra": {
            "not": {
                "required": ["fraction", "bytes"],
                "properties": {"fraction": {"type": "number"}, "bytes": {"type": "integer"}},
            }
        },
    }

    paths: list[Annotated[str, Field(max_length=4096, pattern=PATH_PREFIX_PATTERN)]] = Field(
        default_factory=list,
        max_length=1000,
        description="path prefixes, relative, without '..' (all if empty)",
    )
    fraction: float | None = Field(None, gt=0, le=1, description="share of each shard's bytes")
    bytes: PositiveInt | None = Field(None, description="byte budget over the selection")
    at: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="unix time to start (now if absent)"
    )
    copy_id: str | None = Field(None, alias="copy", pattern=NAME_PATTERN)

    @model_validator(mode="after")
    def _fraction_or_bytes(self) -> PreloadIn:
        if self.fraction is not None and self.bytes is not None:
            raise ValueError("give a fraction or a byte budget, not both")
        return self


class _Report(BaseModel):
    """A worker's report: strict like the requests, but fields a newer worker adds are ignored."""

    model_config = STRICT_OPEN


class TierReport(_Report):
    name: str = Field(max_length=64)
    capacity: JsonInt = Field(ge=0)
    used: JsonInt = Field(ge=0)


class DatasetReport(_Report):
    bytes: JsonInt = Field(0, ge=0)
    files: JsonInt = Field(0, ge=0)
    cached_bytes: JsonInt = Field(0, ge=0)
    shards: Annotated[dict[ShardNumber, JsonInt], _SHARD_KEYS_ONLY] = Field(default_factory=dict)
    last_read_at: float = Field(0.0, ge=0, allow_inf_nan=False)


class FillReport(_Report):
    copy_id: str = Field(alias="copy", max_length=64)
    id: str = Field(max_length=128)
    done: bool = False
    copied_blocks: JsonInt = Field(0, ge=0)
    copied_bytes: JsonInt = Field(0, ge=0)
    absent_blocks: JsonInt = Field(0, ge=0)
    failed_blocks: JsonInt = Field(0, ge=0)
    failed_shards: Annotated[dict[ShardNumber, Count], _SHARD_KEYS_ONLY] = Field(
        default_factory=dict,
        description="shard -> blocks whose copy failed in the latest pass over it (the "
        "coordinator keeps such shards on the nodes that handed them off)",
    )


class TaskResult(_Report):
    freed_bytes: JsonInt = Field(0, ge=0)
    error: str | None = Field(None, max_length=4096)


class ShardReport(_Report):
    objects: JsonInt = Field(0, ge=0)
    bytes: JsonInt = Field(0, ge=0)
    done_objects: JsonInt = Field(0, ge=0)
    done_bytes: JsonInt = Field(0, ge=0)
    failed: dict[str, str] = Field(default_factory=dict)
    failed_count: JsonInt = Field(0, ge=0)
    complete: bool = False


_CounterName = Annotated[str, Field(max_length=64)]
_BucketCounts = Annotated[list[Count], Field(max_length=65)]


class ActivityReport(_Report):
    """A worker's read counters since it started (cachefs/metrics.py WorkerMetrics.activity),
    stamped with its clock: kept as last reported for `cachefs stats`, acted on by nothing."""

    sampled_at: float = Field(0.0, ge=0, allow_inf_nan=False)
    counters: dict[_CounterName, Count] = Field(default_factory=dict, max_length=64)
    fuse_latency_bounds: list[float] = Field(default_factory=list, max_length=64)
    fuse_latency: dict[_CounterName, _BucketCounts] = Field(
        default_factory=dict, max_length=32, description="op -> counts per bucket, +Inf last"
    )


class HeartbeatIn(_Report):
    address: str = Field(
        max_length=300,
        pattern=ADDRESS_PATTERN,
        description="peer HOST:PORT other workers dial (not 0.0.0.0, port 1-65535)",
    )
    gpus: JsonInt = Field(0, ge=0, le=4096)
    tiers: list[TierReport] = Field(default_factory=list, max_length=16)
    datasets: dict[str, DatasetReport] = Field(default_factory=dict)
    preloads: dict[str, Annotated[dict[ShardNumber, ShardReport], _SHARD_KEYS_ONLY]] = Field(
        default_factory=dict
    )
    fills: dict[str, FillReport] = Field(default_factory=dict)
    tasks_done: dict[str, TaskResult] = Field(default_factory=dict)
    activity: ActivityReport | None = None


# Documented on every authenticated route (the spec must name every status a route answers).
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "A domain rule refused the request; `detail` says which"},
    401: {"description": "Missing or wrong bearer token"},
    404: {"description": "No such dataset, node, copy, job or preload job"},
    409: {
        "description": "The request conflicts with the cluster's state: the dataset or job "
        "already exists, the copy is still filling, too few live nodes, a node in another "
        "copy, no preload job of the dataset yet; `detail` says which"
    },
    503: {"description": "The state store (or a locality source) is unavailable"},
}


class CoordinatorLocality(InMemorySource):
    """The placement endpoint's locality and cluster source: the coordinator's own state."""

    def __init__(self, cluster: Cluster):
        super().__init__()
        self._cluster = cluster

    async def refresh(self) -> None:
        self.update(*parse_locality_document(self._cluster.locality_document(), "coordinator"))


def create_app(
    coordinator: Coordinator,
    token: str,
    *,
    metrics_text: Callable[[], bytes] | None = None,
) -> FastAPI:
    app = FastAPI(
        title="cachefs coordinator",
        version="1",
        description="Datasets, nodes, preload jobs and the locality API of a cachefs cluster. "
        "Every route except /healthz, /metrics and these docs needs "
        "`Authorization: Bearer <token>`.",
        docs_url=None,  # served by serve_docs_offline: FastAPI's own load from a CDN
        redoc_url=None,
    )
    serve_docs_offline(app)

    def require_token(credentials: BearerCredentials) -> None:
        if credentials is None or not hmac.compare_digest(
            credentials.credentials.encode(), token.encode()
        ):
            raise HTTPException(
                401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
            )

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes each bad input, which may be no JSON at all (NaN,
        # Infinity: Python's json reads them) and would turn the 422 into a 500.
        errors = [{k: v for k, v in e.items() if k != "input"} for e in exc.errors()]
        return JSONResponse({"detail": jsonable_encoder(errors)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:
            # Starlette names only the methods of the first route on the path (FastAPI makes
            # one route per method).
            exc.headers = {**(exc.headers or {}), "Allow": ", ".join(_allowed_methods(request))}
        return await http_exception_handler(request, exc)

    @app.exception_handler(CachefsError)
    async def _cachefs_error(request: Request, exc: CachefsError) -> JSONResponse:
        return JSONResponse(
            {"detail": str(exc), "kind": type(exc).__name__}, status_code=http_status(exc)
        )

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, Any]:
        return {"ok": True, "cluster_id": coordinator.cluster_id}

    @app.get("/metrics", tags=["health"], response_class=PlainTextResponse)
    def metrics() -> PlainTextResponse:
        body = metrics_text() if metrics_text else b""
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4")

    v1 = APIRouter(
        prefix="/v1",
        dependencies=[Depends(require_token), Depends(_utf8_body)],
        responses=_ERRORS,
    )

    @v1.get("/datasets", tags=["datasets"])
    def list_datasets() -> list[dict[str, Any]]:
        return coordinator.list_datasets()

    @v1.post("/datasets", tags=["datasets"], status_code=201)
    def add_dataset(body: DatasetIn) -> dict[str, Any]:
        fields = body.model_dump()
        nodes = fields.pop("nodes")
        return coordinator.add_dataset(DatasetSpec.from_json(fields), nodes)

    @v1.get("/datasets/{name}", tags=["datasets"])
    def get_dataset(name: DatasetName) -> dict[str, Any]:
        return coordinator.dataset_status(name)

    @v1.delete("/datasets/{name}", tags=["datasets"])
    def remove_dataset(name: DatasetName) -> dict[str, Any]:
        return coordinator.remove_dataset(name)

    @v1.patch("/datasets/{name}", tags=["datasets"])
    def update_policy(name: DatasetName, body: PolicyIn) -> dict[str, Any]:
        """Change the dataset's sharing and cleanup policy; a raised limit promotes suspended
        jobs at once."""
        changes = {field: getattr(body, field) for field in body.model_fields_set}
        return coordinator.update_policy(name, changes)

    @v1.post("/datasets/{name}/refresh", tags=["datasets"])
    def refresh_dataset(name: DatasetName) -> dict[str, Any]:
        return coordinator.refresh_dataset(name)

    @v1.get("/datasets/{name}/locality", tags=["locality"])
    def dataset_locality(name: DatasetName) -> dict[str, Any]:
        """Nodes holding the dataset, with cached bytes and fraction (as of their last
        heartbeat: accurate within one heartbeat interval)."""
        return coordinator.cluster.locality(name)

    @v1.post("/datasets/{name}/preload", tags=["preload"], status_code=201)
    def start_preload(name: DatasetName, body: PreloadIn) -> dict[str, Any]:
        selection = Selection(
            paths=tuple(body.paths), fraction=body.fraction, bytes=body.bytes, at=body.at
        )
        return coordinator.cluster.start_preload(name, selection, copy=body.copy_id)

    @v1.get("/datasets/{name}/preload", tags=["preload"])
    def preload_status(name: DatasetName) -> dict[str, Any]:
        """The dataset's latest preload job: state, objects and bytes done of planned, rate,
        ETA, failed objects with reasons (409 while it has none)."""
        return _of_latest_preload(coordinator.cluster.preload_status, name)

    @v1.post("/datasets/{name}/preload/resume", tags=["preload"])
    def resume_preload(name: DatasetName) -> dict[str, Any]:
        """Run the latest job's selection again: cached blocks are skipped, failures retried."""
        return _of_latest_preload(coordinator.cluster.resume_preload, name)

    @v1.post("/datasets/{name}/copies/{copy_id}/scale", tags=["jobs"])
    def scale_copy(name: DatasetName, copy_id: CopyName, body: ScaleIn) -> dict[str, Any]:
        """Add and remove nodes of a copy. Only the shards whose rendezvous owner changes move;
        their new owners copy them from the old ones before those drop them (409 while an
        earlier fill of the copy is still running)."""
        return coordinator.scale_copy(name, copy_id, body.add, body.remove)

    @v1.post("/jobs", tags=["jobs"], status_code=201)
    def submit_job(body: JobIn) -> dict[str, Any]:
        """Register a job reading a dataset. The answer is ``running`` with the ranked nodes
        (TDCS: the chosen copy's nodes among the candidates first, each with the reason), or
        ``suspended`` with its queue position, or ``running`` on a new copy (``cloned``)."""
        return coordinator.manager.jobs.submit(
            body.id, body.dataset, body.nodes, body.candidates, body.lease_s
        )

    @v1.get("/jobs", tags=["jobs"])
    def list_jobs(
        dataset: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None,
    ) -> list[dict[str, Any]]:
        return coordinator.manager.jobs.list_jobs(dataset)

    @v1.get("/jobs/{job_id}", tags=["jobs"])
    async def get_job(
        job_id: JobName, wait: Annotated[float, Query(ge=0, le=300, allow_inf_nan=False)] = 0
    ) -> dict[str, Any]:
        """One job. With ``wait=N`` (a long-poll, for the owner of a suspended job) the answer
        comes as soon as the job is promoted or released, at the latest after N seconds, and
        the call renews the job's lease."""
        jobs = coordinator.manager.jobs
        if wait == 0:
            return await anyio.to_thread.run_sync(jobs.job, job_id)
        deadline = anyio.current_time() + wait
        while True:
            seen = jobs.version
            doc = await anyio.to_thread.run_sync(jobs.renew, job_id)
            if doc["state"] != "suspended" or anyio.current_time() >= deadline:
                return doc
            # Job changes bump the version; checking it costs no lock and no thread.
            while jobs.version == seen and anyio.current_time() < deadline:
                await anyio.sleep(min(0.1, max(0.0, deadline - anyio.current_time())))

    @v1.post("/jobs/{job_id}/heartbeat", tags=["jobs"])
    def renew_job(job_id: JobName) -> dict[str, Any]:
        """Renew the job's lease (its owner is alive)."""
        return coordinator.manager.jobs.renew(job_id)

    @v1.delete("/jobs/{job_id}", tags=["jobs"])
    def release_job(job_id: JobName) -> dict[str, Any]:
        """Release the job: its copy gets the slot back and the head of the dataset's suspend
        queue is placed at once (``promoted`` names it)."""
        return coordinator.manager.jobs.release(job_id)

    @v1.get("/events", tags=["jobs"])
    def list_events(
        dataset: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[dict[str, Any]]:
        """What the CacheManager did and why: placements, promotions, clones, scaling,
        hand-offs, cleanup and the bytes it freed, oldest first."""
        return coordinator.manager.journal.list_events(dataset, limit)

    @v1.post("/datasets/{name}/preload/cancel", tags=["preload"])
    def cancel_preload(name: DatasetName) -> dict[str, Any]:
        """Cancel the dataset's latest preload job; the answer is that job (``cancelled``, or
        the state it had already ended in)."""
        return _of_latest_preload(coordinator.cluster.cancel_preload, name)

    @v1.get("/preloads", tags=["preload"])
    def list_preloads() -> list[dict[str, Any]]:
        return coordinator.cluster.list_preloads()

    @v1.get("/preloads/{job_id}", tags=["preload"])
    def get_preload(job_id: Annotated[str, Path(max_length=200)]) -> dict[str, Any]:
        return coordinator.cluster.preload_job(job_id)

    @v1.get("/nodes", tags=["locality"])
    def list_nodes() -> list[dict[str, Any]]:
        return coordinator.cluster.list_nodes()

    @v1.get("/nodes/{node}", tags=["locality"])
    def get_node(node: NodeName) -> dict[str, Any]:
        """One node: state, tiers, and the datasets it holds with cached bytes and fraction."""
        return coordinator.cluster.node_status(node)

    @v1.post("/nodes/{node}/heartbeat", tags=["workers"])
    def heartbeat(node: NodeName, body: HeartbeatIn) -> dict[str, Any]:
        """A worker's heartbeat (registers it on first contact). The reply is the worker's view
        of the cluster: live membership per copy, datasets, running preload jobs."""
        return coordinator.heartbeat(node, body.model_dump(by_alias=True))

    @v1.get("/locality", tags=["locality"])
    def locality_document() -> dict[str, Any]:
        """Every dataset's cached bytes per node and every live node's GPUs and cache: the
        document the placement policies read."""
        return coordinator.cluster.locality_document()

    app.include_router(v1)
    source = CoordinatorLocality(coordinator.cluster)
    app.include_router(
        placement_router(source, source),
        dependencies=[Depends(require_token), Depends(_utf8_body)],
        tags=["placement"],
        responses=_ERRORS,
    )
    app.include_router(
        schedule_router(lambda datasets: live_locality(coordinator.cluster, datasets)),
        dependencies=[Depends(require_token), Depends(_utf8_body)],
        tags=["placement"],
        responses=_ERRORS,
    )
    app.include_router(extender_router(coordinator))  # no token: kube-scheduler sends none
    return app


def live_locality(cluster: Cluster, datasets: Iterable[str]) -> LiveLocality:
    """``POST /v1/schedule``'s locality: the named datasets the coordinator knows (cached
    bytes on live nodes, the CacheManager's copies) and the cache of every live node."""
    found = {}
    for name in datasets:
        try:
            doc = cluster.locality(name)
        except DatasetNotFound:
            continue  # scheduled without locality; the answer says it is not known
        cached = {row["node"]: row["cached_bytes"] for row in doc["nodes"] if row["state"] == "up"}
        copies = tuple(frozenset(copy["nodes"]) for copy in doc["copies"] if copy["nodes"])
        found[name] = Dataset(name, doc["bytes"], cached, copies)
    caches = {
        node["node"]: (
            sum(tier.get("capacity", 0) for tier in node["tiers"]),
            sum(tier.get("used", 0) for tier in node["tiers"]),
        )
        for node in cluster.list_nodes()
        if node["state"] == "up"
    }
    return LiveLocality(found, caches)


def _of_latest_preload(call: Callable[[str], JsonDoc], dataset: str) -> JsonDoc:
    """``call(dataset)`` on the dataset's latest preload job. The dataset exists when the
    cluster says it has no job (it checks the dataset first): that is a 409 (start one first),
    not a 404, which says the dataset is unknown."""
    try:
        return call(dataset)
    except PreloadNotFound as exc:
        raise NoPreloadJob(str(exc)) from None


_HTTP_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "TRACE")


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves on the request's path (for a 405's ``Allow``): asked of
    the app's own routing, which also sees into included routers."""
    routes = request.app.router.routes
    return [
        method
        for method in _HTTP_METHODS
        if any(
            route.matches({**request.scope, "method": method})[0] == Match.FULL for route in routes
        )
    ]


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def _utf8_body(request: Request) -> None:
    """Refuse a JSON body holding a lone surrogate ("\\ud800"): Python's json reads it, but no
    answer that includes the string could be encoded, and a stored one would break every
    later listing."""
    body = await request.body()
    if not _SURROGATE_ESCAPE.search(body):
        return
    try:
        json.dumps(json.loads(body), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        # Shaped like the other 422s (the spec's HTTPValidationError).
        message = "the body holds a lone UTF-16 surrogate (\\ud800-\\udfff)"
        raise RequestValidationError(
            [{"type": "value_error", "loc": ("body",), "msg": message}]
        ) from None
    except ValueError:
        return  # not JSON: the body's own validation says so
