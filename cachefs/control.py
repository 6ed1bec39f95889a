"""The worker's local control API (HTTP over a unix socket) and the metrics endpoint.

Used by the `cachefs` CLI, and by same-node readers to resolve a path to local block files for
short-circuit reads. The socket is mode 0600 in the state directory: whoever can reach it can
manage this worker. This module defines the HTTP surface only; the work is done by an object
implementing :class:`WorkerAPI` (the worker), so the layering stays one-way.
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from cachefs.errors import (
    CachefsError,
    ConfigError,
    DatasetExists,
    DatasetNotFound,
    PathNotFound,
    PreloadNotFound,
    StoreAuthError,
    StoreBucketNotFound,
    StoreError,
)
from cachefs.protocol import DatasetSpec


class PreloadAPI(Protocol):
    """A single node's preload jobs (cachefs/cluster/local_preload.py): the coordinator's
    preload calls, answered with the coordinator's status documents."""

    async def start(self, dataset: str, body: Any) -> dict[str, Any]: ...
    async def status(self, dataset: str) -> dict[str, Any]: ...
    async def resume(self, dataset: str) -> dict[str, Any]: ...
    async def cancel(self, dataset: str) -> dict[str, Any]: ...


class WorkerAPI(Protocol):
    def status(self) -> dict[str, Any]: ...
    def list_datasets(self) -> list[dict[str, Any]]: ...
    async def add_dataset(self, spec: DatasetSpec, *, allow_empty: bool) -> dict[str, Any]: ...
    async def remove_dataset(self, name: str, *, keep_cache: bool) -> dict[str, Any]: ...
    async def refresh_dataset(self, name: str) -> dict[str, Any]: ...
    def resolve(self, dataset: str, path: str) -> dict[str, Any]: ...
    async def resolve_many(self, dataset: str, paths: list[str]) -> dict[str, Any]: ...
    def prefetch(self, dataset: str, paths: list[str]) -> dict[str, Any]: ...
    def request_shutdown(self) -> None: ...
    def local_preloads(self) -> PreloadAPI:
        """Raises ConfigError on a worker that follows a coordinator (preload goes there)."""
        ...

    def metrics_text(self) -> bytes: ...


def _status_code(exc: CachefsError) -> int:
    if isinstance(exc, DatasetNotFound | PathNotFound | PreloadNotFound):
        return 404
    if isinstance(exc, DatasetExists):
        return 409
    if isinstance(exc, ConfigError):
        return 400
    if isinstance(exc, StoreAuthError | StoreBucketNotFound):
        return 424  # the request was fine; the store it names rejected it
    if isinstance(exc, StoreError):
        return 502
    return 500


def _paths_of(body: dict) -> list[str]:
    paths = body.get("paths")
    if not isinstance(paths, list) or not all(isinstance(path, str) for path in paths):
        raise ConfigError('the body must be {"paths": [<path relative to the dataset>, ...]}')
    return paths


def create_control_app(worker: WorkerAPI) -> FastAPI:
    app = FastAPI(title="cachefs worker control API", version="1")

    @app.exception_handler(CachefsError)
    async def _cachefs_error(request: Request, exc: CachefsError) -> JSONResponse:
        return JSONResponse(
            {"error": type(exc).__name__, "message": str(exc)}, status_code=_status_code(exc)
        )

    @app.get("/v1/status")
    async def status() -> dict:
        return worker.status()

    @app.get("/v1/datasets")
    async def list_datasets() -> list:
        return worker.list_datasets()

    @app.post("/v1/datasets", status_code=201)
    async def add_dataset(body: dict, allow_empty: bool = False) -> dict:
        """A source that lists no file is refused (400) unless ``?allow_empty=true``."""
        return await worker.add_dataset(DatasetSpec.from_json(body), allow_empty=allow_empty)

    @app.delete("/v1/datasets/{name}")
    async def remove_dataset(name: str, keep_cache: bool = False) -> dict:
        return await worker.remove_dataset(name, keep_cache=keep_cache)

    @app.post("/v1/datasets/{name}/refresh")
    async def refresh_dataset(name: str) -> dict:
        return await worker.refresh_dataset(name)

    @app.get("/v1/resolve")
    async def resolve(dataset: str, path: str) -> dict:
        return worker.resolve(dataset, path)

    @app.post("/v1/datasets/{name}/resolve")
    async def resolve_many(name: str, body: dict) -> JSONResponse:
        """Many paths at once: ``{"paths": [...]}`` (a training epoch resolves its files in
        batches, not one request per file). Returned as a JSONResponse: FastAPI's own encoding
        of a returned dict walks every value first, which costs more than the resolving."""
        return JSONResponse(await worker.resolve_many(name, _paths_of(body)))

    @app.post("/v1/datasets/{name}/prefetch", status_code=202)
    async def prefetch(name: str, body: dict) -> dict:
        """A hint: ``{"paths": [...]}`` will be read soon; their uncached blocks are fetched in
        the background (bounded; excess hints are dropped, oldest first)."""
        return worker.prefetch(name, _paths_of(body))

    # Preload on a single node: the coordinator's routes (coordinator/api.py), same bodies.
    @app.post("/v1/datasets/{name}/preload", status_code=201)
    async def start_preload(name: str, body: dict) -> dict:
        """``{"paths": [...], "fraction": f | "bytes": n, "at": unix time}``, all optional."""
        return await worker.local_preloads().start(name, body)

    @app.get("/v1/datasets/{name}/preload")
    async def preload_status(name: str) -> dict:
        return await worker.local_preloads().status(name)

    @app.post("/v1/datasets/{name}/preload/resume")
    async def resume_preload(name: str) -> dict:
        return await worker.local_preloads().resume(name)

    @app.post("/v1/datasets/{name}/preload/cancel")
    async def cancel_preload(name: str) -> dict:
        return await worker.local_preloads().cancel(name)

    @app.post("/v1/shutdown", status_code=202)
    async def shutdown() -> dict:
        worker.request_shutdown()
        return {"shutting_down": True}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(worker.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return app


def create_metrics_app(worker: WorkerAPI):
    """A bare ASGI app serving only GET /metrics (for the TCP listener Prometheus scrapes)."""

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        if scope["path"] == "/metrics":
            status, body, ctype = 200, worker.metrics_text(), CONTENT_TYPE_LATEST
        else:
            status, body, ctype = 404, b"only /metrics is served here\n", "text/plain"
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", ctype.encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app
