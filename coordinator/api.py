"""The coordinator's HTTP/JSON API (FastAPI; the OpenAPI spec is at ``/openapi.json``, the
browsable docs at ``/docs``).

Every route but ``/healthz``, ``/metrics`` and the spec itself needs ``Authorization: Bearer
<token>``. Request bodies are pydantic models, so a malformed body is a 422 naming the field;
domain errors map to 400/404/409 in one place (:func:`_status_of`); an unavailable state store
is a 503. Routes are plain ``def``: FastAPI runs them in threads, which is what the blocking
:class:`~coordinator.cluster.Cluster` wants.
"""

from __future__ import annotations

import hmac
import json
import re
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from cachefs.errors import CachefsError, ConfigError, DatasetExists, DatasetNotFound
from cachefs.protocol import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_FIRST_BYTE_TIMEOUT_S,
    DEFAULT_STORE_TIMEOUT_S,
    DatasetSpec,
)

from .cluster import Cluster, NodeNotFound, PreloadNotFound
from .extender import extender_router
from .manager import CopyBusy, JobExists, JobNotFound
from .preload import Selection
from .scheduling.http import placement_router
from .scheduling.sources import InMemorySource, parse_locality_document
from .state import StateStoreError

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
CLEANUP_PATTERN = r"^(lock|lru|ttl:[0-9.]+(ms|s|m|h|d)?)$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DatasetIn(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    uri: str = Field(min_length=1, max_length=4096, description="s3://, oss:// or file:// URI")
    endpoint: str | None = Field(None, max_length=4096)
    region: str | None = Field(None, max_length=128)
    path_style: bool | None = None
    profile: str | None = Field(None, max_length=256)
    credentials_file: str | None = Field(None, max_length=4096)
    block_size: int = Field(DEFAULT_BLOCK_SIZE, ge=64 << 10, le=64 << 20)
    timeout_s: float = Field(
        DEFAULT_STORE_TIMEOUT_S, gt=0, le=600, description="one store request, all tries"
    )
    first_byte_timeout_s: float = Field(
        DEFAULT_FIRST_BYTE_TIMEOUT_S, gt=0, le=600, description="one try of a store read"
    )
    refresh_interval_s: float | None = Field(None, gt=0, le=365 * 86400)
    max_jobs_per_copy: int | None = Field(
        None, ge=1, le=1 << 20, description="running jobs per cached copy (no limit if absent)"
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


class PolicyIn(_Strict):
    """Only the fields given change; ``max_jobs_per_copy: null`` removes the limit."""

    max_jobs_per_copy: int | None = Field(None, ge=1, le=1 << 20)
    overflow: Literal["suspend", "clone"] | None = None
    cleanup: str | None = Field(None, pattern=CLEANUP_PATTERN)


class JobIn(_Strict):
    id: str = Field(pattern=NAME_PATTERN, description="the job's name, unique while it lives")
    dataset: str = Field(pattern=NAME_PATTERN)
    nodes: int = Field(1, ge=1, le=4096, description="how many nodes the job runs on")
    candidates: NodeList | None = Field(
        None, max_length=4096, description="S2: nodes the job may run on (all live if absent)"
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
    paths: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, max_length=1000, description="path prefixes (all if empty)"
    )
    fraction: float | None = Field(None, gt=0, le=1, description="share of each shard's bytes")
    bytes: int | None = Field(None, gt=0, description="byte budget over the selection")
    at: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="unix time to start (now if absent)"
    )
    copy_id: str | None = Field(None, alias="copy", pattern=NAME_PATTERN)


class TierReport(BaseModel):
    name: str = Field(max_length=64)
    capacity: int = Field(ge=0)
    used: int = Field(ge=0)


class DatasetReport(BaseModel):
    bytes: int = Field(0, ge=0)
    files: int = Field(0, ge=0)
    cached_bytes: int = Field(0, ge=0)
    shards: dict[str, int] = Field(default_factory=dict)
    last_read_at: float = Field(0.0, ge=0, allow_inf_nan=False)


class FillReport(BaseModel):
    copy_id: str = Field(alias="copy", max_length=64)
    id: str = Field(max_length=128)
    done: bool = False
    copied_blocks: int = Field(0, ge=0)
    copied_bytes: int = Field(0, ge=0)
    absent_blocks: int = Field(0, ge=0)
    failed_blocks: int = Field(0, ge=0)


class TaskResult(BaseModel):
    freed_bytes: int = Field(0, ge=0)
    error: str | None = Field(None, max_length=4096)


class ShardReport(BaseModel):
    objects: int = Field(0, ge=0)
    bytes: int = Field(0, ge=0)
    done_objects: int = Field(0, ge=0)
    done_bytes: int = Field(0, ge=0)
    failed: dict[str, str] = Field(default_factory=dict)
    failed_count: int = Field(0, ge=0)
    complete: bool = False


_CounterName = Annotated[str, Field(max_length=64)]
_Count = Annotated[int, Field(ge=0)]
_BucketCounts = Annotated[list[_Count], Field(max_length=65)]


class ActivityReport(BaseModel):
    """A worker's read counters since it started (cachefs/metrics.py WorkerMetrics.activity),
    stamped with its clock: kept as last reported for `cachefs stats`, acted on by nothing."""

    sampled_at: float = Field(0.0, ge=0, allow_inf_nan=False)
    counters: dict[_CounterName, _Count] = Field(default_factory=dict, max_length=64)
    fuse_latency_bounds: list[float] = Field(default_factory=list, max_length=64)
    fuse_latency: dict[_CounterName, _BucketCounts] = Field(
        default_factory=dict, max_length=32, description="op -> counts per bucket, +Inf last"
    )


class HeartbeatIn(BaseModel):
    address: str = Field(pattern=r"^[A-Za-z0-9.\-]+:[0-9]{1,5}$", description="peer HOST:PORT")
    gpus: int = Field(0, ge=0, le=4096)
    tiers: list[TierReport] = Field(default_factory=list, max_length=16)
    datasets: dict[str, DatasetReport] = Field(default_factory=dict)
    preloads: dict[str, dict[str, ShardReport]] = Field(default_factory=dict)
    fills: dict[str, FillReport] = Field(default_factory=dict)
    tasks_done: dict[str, TaskResult] = Field(default_factory=dict)
    activity: ActivityReport | None = None


# Documented on every authenticated route (the spec must name every status a route answers).
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "A domain rule refused the request; `detail` says which"},
    401: {"description": "Missing or wrong bearer token"},
    404: {"description": "No such dataset, node, job or preload job"},
    409: {"description": "The dataset or job already exists, or the copy is still filling"},
    503: {"description": "The state store (or a locality source) is unavailable"},
}


def _status_of(exc: CachefsError) -> int:
    if isinstance(exc, DatasetNotFound | NodeNotFound | PreloadNotFound | JobNotFound):
        return 404
    if isinstance(exc, DatasetExists | JobExists | CopyBusy):
        return 409
    if isinstance(exc, StateStoreError):
        return 503
    return 400


class CoordinatorLocality(InMemorySource):
    """The placement endpoint's locality and cluster source: the coordinator's own state."""

    def __init__(self, cluster: Cluster):
        super().__init__()
        self._cluster = cluster

    async def refresh(self) -> None:
        self.update(*parse_locality_document(self._cluster.locality_document(), "coordinator"))


def create_app(cluster: Cluster, token: str, *, metrics_text=None) -> FastAPI:
    app = FastAPI(
        title="cachefs coordinator",
        version="1",
        description="Datasets, nodes, preload jobs and the locality API of a cachefs cluster. "
        "Every route except /healthz and /metrics needs `Authorization: Bearer <token>`.",
    )

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

    @app.exception_handler(CachefsError)
    async def _cachefs_error(request: Request, exc: CachefsError) -> JSONResponse:
        return JSONResponse(
            {"detail": str(exc), "kind": type(exc).__name__}, status_code=_status_of(exc)
        )

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, Any]:
        return {"ok": True, "cluster_id": cluster.cluster_id}

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
        return cluster.list_datasets()

    @v1.post("/datasets", tags=["datasets"], status_code=201)
    def add_dataset(body: DatasetIn) -> dict[str, Any]:
        fields = body.model_dump()
        nodes = fields.pop("nodes")
        return cluster.add_dataset(DatasetSpec.from_json(fields), nodes)

    @v1.get("/datasets/{name}", tags=["datasets"])
    def get_dataset(name: DatasetName) -> dict[str, Any]:
        return cluster.dataset_status(name)

    @v1.delete("/datasets/{name}", tags=["datasets"])
    def remove_dataset(name: DatasetName) -> dict[str, Any]:
        return cluster.remove_dataset(name)

    @v1.patch("/datasets/{name}", tags=["datasets"])
    def update_policy(name: DatasetName, body: PolicyIn) -> dict[str, Any]:
        """Change the dataset's sharing and cleanup policy; a raised limit promotes suspended
        jobs at once."""
        changes = {field: getattr(body, field) for field in body.model_fields_set}
        if any(v is None for k, v in changes.items() if k != "max_jobs_per_copy"):
            raise ConfigError("overflow and cleanup cannot be null")
        return cluster.update_policy(name, changes)

    @v1.post("/datasets/{name}/refresh", tags=["datasets"])
    def refresh_dataset(name: DatasetName) -> dict[str, Any]:
        return cluster.refresh_dataset(name)

    @v1.get("/datasets/{name}/locality", tags=["locality"])
    def dataset_locality(name: DatasetName) -> dict[str, Any]:
        """Nodes holding the dataset, with cached bytes and fraction (as of their last
        heartbeat: accurate within one heartbeat interval)."""
        return cluster.locality(name)

    @v1.post("/datasets/{name}/preload", tags=["preload"], status_code=201)
    def start_preload(name: DatasetName, body: PreloadIn) -> dict[str, Any]:
        selection = Selection(
            paths=tuple(body.paths), fraction=body.fraction, bytes=body.bytes, at=body.at
        )
        return cluster.start_preload(name, selection, copy=body.copy_id)

    @v1.get("/datasets/{name}/preload", tags=["preload"])
    def preload_status(name: DatasetName) -> dict[str, Any]:
        """The dataset's latest preload job: state, objects and bytes done of planned, rate,
        ETA, failed objects with reasons."""
        return cluster.preload_status(name)

    @v1.post("/datasets/{name}/preload/resume", tags=["preload"])
    def resume_preload(name: DatasetName) -> dict[str, Any]:
        """Run the latest job's selection again: cached blocks are skipped, failures retried."""
        return cluster.resume_preload(name)

    @v1.post("/datasets/{name}/copies/{copy_id}/scale", tags=["jobs"])
    def scale_copy(name: DatasetName, copy_id: CopyName, body: ScaleIn) -> dict[str, Any]:
        """Add and remove nodes of a copy. Only the shards whose rendezvous owner changes move;
        their new owners copy them from the old ones before those drop them (409 while an
        earlier fill of the copy is still running)."""
        return cluster.manager.scale(name, copy_id, body.add, body.remove)

    @v1.post("/jobs", tags=["jobs"], status_code=201)
    def submit_job(body: JobIn) -> dict[str, Any]:
        """Register a job reading a dataset. The answer is ``running`` with the ranked nodes
        (TDCS: the chosen copy's nodes among the candidates first, each with the reason), or
        ``suspended`` with its queue position, or ``running`` on a new copy (``cloned``)."""
        return cluster.manager.submit(
            body.id, body.dataset, body.nodes, body.candidates, body.lease_s
        )

    @v1.get("/jobs", tags=["jobs"])
    def list_jobs(
        dataset: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None,
    ) -> list[dict[str, Any]]:
        return cluster.manager.list_jobs(dataset)

    @v1.get("/jobs/{job_id}", tags=["jobs"])
    async def get_job(
        job_id: JobName, wait: Annotated[float, Query(ge=0, le=300, allow_inf_nan=False)] = 0
    ) -> dict[str, Any]:
        """One job. With ``wait=N`` (a long-poll, for the owner of a suspended job) the answer
        comes as soon as the job is promoted or released, at the latest after N seconds, and
        the call renews the job's lease."""
        manager = cluster.manager
        if wait == 0:
            return await anyio.to_thread.run_sync(manager.job, job_id)
        deadline = anyio.current_time() + wait
        while True:
            seen = manager.version
            doc = await anyio.to_thread.run_sync(manager.renew, job_id)
            if doc["state"] != "suspended" or anyio.current_time() >= deadline:
                return doc
            # Job changes bump the version; checking it costs no lock and no thread.
            while manager.version == seen and anyio.current_time() < deadline:
                await anyio.sleep(min(0.1, max(0.0, deadline - anyio.current_time())))

    @v1.post("/jobs/{job_id}/heartbeat", tags=["jobs"])
    def renew_job(job_id: JobName) -> dict[str, Any]:
        """Renew the job's lease (its owner is alive)."""
        return cluster.manager.renew(job_id)

    @v1.delete("/jobs/{job_id}", tags=["jobs"])
    def release_job(job_id: JobName) -> dict[str, Any]:
        """Release the job: its copy gets the slot back and the head of the dataset's suspend
        queue is placed at once (``promoted`` names it)."""
        return cluster.manager.release(job_id)

    @v1.get("/events", tags=["jobs"])
    def list_events(
        dataset: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[dict[str, Any]]:
        """What the CacheManager did and why: placements, promotions, clones, scaling,
        hand-offs, cleanup and the bytes it freed, oldest first."""
        return cluster.manager.list_events(dataset, limit)

    @v1.post("/datasets/{name}/preload/cancel", tags=["preload"])
    def cancel_preload(name: DatasetName) -> dict[str, Any]:
        return cluster.cancel_preload(name)

    @v1.get("/preloads", tags=["preload"])
    def list_preloads() -> list[dict[str, Any]]:
        return cluster.list_preloads()

    @v1.get("/preloads/{job_id}", tags=["preload"])
    def get_preload(job_id: Annotated[str, Path(max_length=200)]) -> dict[str, Any]:
        return cluster.preload_job(job_id)

    @v1.get("/nodes", tags=["locality"])
    def list_nodes() -> list[dict[str, Any]]:
        return cluster.list_nodes()

    @v1.get("/nodes/{node}", tags=["locality"])
    def get_node(node: NodeName) -> dict[str, Any]:
        """One node: state, tiers, and the datasets it holds with cached bytes and fraction."""
        return cluster.node_status(node)

    @v1.post("/nodes/{node}/heartbeat", tags=["workers"])
    def heartbeat(node: NodeName, body: HeartbeatIn) -> dict[str, Any]:
        """A worker's heartbeat (registers it on first contact). The reply is the worker's view
        of the cluster: live membership per copy, datasets, running preload jobs."""
        report = body.model_dump(by_alias=True)
        if not all(_is_shard(s) for d in report["datasets"].values() for s in d["shards"]):
            raise ConfigError("shard numbers must be integers in [0, 1024)")
        if not all(_is_shard(s) for job in report["preloads"].values() for s in job):
            raise ConfigError("shard numbers must be integers in [0, 1024)")
        return cluster.heartbeat(node, report)

    @v1.get("/locality", tags=["locality"])
    def locality_document() -> dict[str, Any]:
        """Every dataset's cached bytes per node and every live node's GPUs and cache: the
        document the placement policies read."""
        return cluster.locality_document()

    app.include_router(v1)
    source = CoordinatorLocality(cluster)
    app.include_router(
        placement_router(source, source),
        dependencies=[Depends(require_token), Depends(_utf8_body)],
        tags=["placement"],
        responses=_ERRORS,
    )
    app.include_router(extender_router(cluster))  # no token: kube-scheduler sends none
    return app


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
        raise HTTPException(
            422, "the body holds a lone UTF-16 surrogate (\\ud800-\\udfff)"
        ) from None
    except ValueError:
        return  # not JSON: the body's own validation says so


def _is_shard(text: str) -> bool:
    # isdigit() alone admits "²" (int() fails) and "١" (another script's 1).
    return text.isascii() and text.isdigit() and int(text) < 1024
