"""The worker's local control API (HTTP over a unix socket) and the metrics endpoint.

Used by the `cachefs` CLI, and by same-node readers to resolve a path to local block files for
short-circuit reads. The socket is mode 0600 in the state directory: whoever can reach it can
manage this worker. This module defines the HTTP surface only; the work is done by an object
implementing :class:`WorkerAPI` (the worker), so the layering stays one-way.

Errors: every error answer is ``{"error": <the exception's class name>, "message": <one
line>}`` with the status from :data:`ERROR_STATUSES`, the one table (README, "Local control
API"); anything it does not list, a bug included, is 500. FastAPI itself answers 422 for a
body or parameter of the wrong type and 404/405 for a route that does not exist.
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

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


#: The control API's one mapping of errors to HTTP statuses. The first row the error is an
#: instance of gives the status, so a subclass comes before its base.
ERROR_STATUSES: tuple[tuple[type[CachefsError], int], ...] = (
    # What the request names does not exist: a dataset, a path in it, a preload job.
    (DatasetNotFound, 404),
    (PathNotFound, 404),
    (PreloadNotFound, 404),
    (DatasetExists, 409),  # a dataset of that name is served already
    # The request is wrong: a bad URI, dataset spec, option or body; a source that lists
    # nothing (EmptySource); a call this worker does not take (it follows a coordinator).
    (ConfigError, 400),
    # The request was fine; the store it names refused it (credentials, a missing bucket).
    (StoreAuthError, 424),
    (StoreBucketNotFound, 424),
    (StoreError, 502),  # the store failed, after its retries
)
#: Any other error, and any exception that is not a CachefsError: the worker failed, not the
#: request.
UNEXPECTED_STATUS = 500


def status_of(exc: BaseException) -> int:
    """The HTTP status of an error answer (:data:`ERROR_STATUSES`)."""
    for error_class, status in ERROR_STATUSES:
        if isinstance(exc, error_class):
            return status
    return UNEXPECTED_STATUS


def _error_answer(exc: Exception) -> JSONResponse:
    if isinstance(exc, CachefsError):
        message = str(exc)  # a complete sentence for the user
    else:
        message = f"internal error in the worker ({type(exc).__name__}: {exc}); see its log"
    return JSONResponse({"error": type(exc).__name__, "message": message}, status_of(exc))


def _paths_of(body: dict[str, Any]) -> list[str]:
    paths = body.get("paths")
    if not isinstance(paths, list) or not all(isinstance(path, str) for path in paths):
        raise ConfigError('the body must be {"paths": [<path relative to the dataset>, ...]}')
    return paths


def create_control_app(worker: WorkerAPI) -> FastAPI:
    app = FastAPI(title="cachefs worker control API", version="1")

    @app.exception_handler(CachefsError)
    async def _cachefs_error(request: Request, exc: CachefsError) -> JSONResponse:
        return _error_answer(exc)

    # Starlette sends this answer, then raises the exception again for the server to log.
    @app.exception_handler(Exception)
    async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        return _error_answer(exc)

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        return worker.status()

    @app.get("/v1/datasets")
    async def list_datasets() -> list[dict[str, Any]]:
        return worker.list_datasets()

    @app.post("/v1/datasets", status_code=201)
    async def add_dataset(body: dict[str, Any], allow_empty: bool = False) -> dict[str, Any]:
        """A source that lists no file is refused (400) unless ``?allow_empty=true``."""
        return await worker.add_dataset(DatasetSpec.from_json(body), allow_empty=allow_empty)

    @app.delete("/v1/datasets/{name}")
    async def remove_dataset(name: str, keep_cache: bool = False) -> dict[str, Any]:
        return await worker.remove_dataset(name, keep_cache=keep_cache)

    @app.post("/v1/datasets/{name}/refresh")
    async def refresh_dataset(name: str) -> dict[str, Any]:
        return await worker.refresh_dataset(name)

    @app.get("/v1/resolve")
    async def resolve(dataset: str, path: str) -> dict[str, Any]:
        return worker.resolve(dataset, path)

    @app.post("/v1/datasets/{name}/resolve")
    async def resolve_many(name: str, body: dict[str, Any]) -> JSONResponse:
        """Many paths at once: ``{"paths": [...]}`` (a training epoch resolves its files in
        batches, not one request per file). Returned as a JSONResponse: FastAPI's own encoding
        of a returned dict walks every value first, which costs more than the resolving."""
        return JSONResponse(await worker.resolve_many(name, _paths_of(body)))

    @app.post("/v1/datasets/{name}/prefetch", status_code=202)
    async def prefetch(name: str, body: dict[str, Any]) -> dict[str, Any]:
        """A hint: ``{"paths": [...]}`` will be read soon; their uncached blocks are fetched in
        the background (bounded; excess hints are dropped, oldest first)."""
        return worker.prefetch(name, _paths_of(body))

    # Preload on a single node: the coordinator's routes (coordinator/api.py), same bodies.
    @app.post("/v1/datasets/{name}/preload", status_code=201)
    async def start_preload(name: str, body: dict[str, Any]) -> dict[str, Any]:
        """``{"paths": [...], "fraction": f | "bytes": n, "at": unix time}``, all optional."""
        return await worker.local_preloads().start(name, body)

    @app.get("/v1/datasets/{name}/preload")
    async def preload_status(name: str) -> dict[str, Any]:
        return await worker.local_preloads().status(name)

    @app.post("/v1/datasets/{name}/preload/resume")
    async def resume_preload(name: str) -> dict[str, Any]:
        return await worker.local_preloads().resume(name)

    @app.post("/v1/datasets/{name}/preload/cancel")
    async def cancel_preload(name: str) -> dict[str, Any]:
        return await worker.local_preloads().cancel(name)

    @app.post("/v1/shutdown", status_code=202)
    async def shutdown() -> dict[str, Any]:
        worker.request_shutdown()
        return {"shutting_down": True}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(worker.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return app


def create_metrics_app(worker: WorkerAPI) -> ASGIApp:
    """A bare ASGI app serving only GET /metrics (for the TCP listener Prometheus scrapes)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
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
