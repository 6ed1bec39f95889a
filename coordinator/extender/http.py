"""The extender's routes: ``POST /scheduler/filter``, ``POST /scheduler/prioritize`` and
``GET /scheduler/healthz``, with their OpenAPI shapes (kube-scheduler's wire types)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import APIRouter, Request, Response

from .decide import Extender

if TYPE_CHECKING:
    from ..service import Coordinator

_NULLABLE_OBJECT = {"anyOf": [{"type": "object"}, {"type": "null"}]}
_NODE_NAMES = {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]}
_FAILED_NODES = {"type": "object", "additionalProperties": {"type": "string"}}
_EXTENDER_ARGS = {
    "title": "ExtenderArgs",
    "description": "k8s.io/kube-scheduler/extender/v1 ExtenderArgs: the pod and its candidate "
    "nodes, as a v1.NodeList (Nodes) or as names (NodeNames).",
    "type": "object",
    "properties": {"Pod": _NULLABLE_OBJECT, "Nodes": _NULLABLE_OBJECT, "NodeNames": _NODE_NAMES},
}
# Any body, or none, is answered 200 (the extender protocol's way to refuse is the answer's
# Error, or no scores), so the spec allows any: ExtenderArgs is what kube-scheduler sends.
_ARGS_BODY = {
    "required": False,
    "content": {
        "application/json": {
            "schema": {
                "anyOf": [_EXTENDER_ARGS, {"description": "anything else: answered as above"}]
            }
        }
    },
}
_FILTER_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "ExtenderFilterResult (always 200; a body that is no ExtenderArgs "
        "gets Error set)",
        "content": {
            "application/json": {
                "schema": {
                    "title": "ExtenderFilterResult",
                    "type": "object",
                    "properties": {
                        "Nodes": _NULLABLE_OBJECT,
                        "NodeNames": _NODE_NAMES,
                        "FailedNodes": _FAILED_NODES,
                        "FailedAndUnresolvableNodes": _FAILED_NODES,
                        "Error": {"type": "string"},
                    },
                }
            }
        },
    }
}
_PRIORITIZE_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "HostPriorityList: a 0..10 score per node (always 200)",
        "content": {
            "application/json": {
                "schema": {
                    "title": "HostPriorityList",
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "Host": {"type": "string"},
                            "Score": {"type": "integer", "minimum": 0, "maximum": 10},
                        },
                    },
                }
            }
        },
    }
}


def _encode(answer: Any) -> bytes:
    # ASCII escapes: a lone surrogate in an echoed name would make UTF-8 encoding fail.
    return json.dumps(answer, ensure_ascii=True, separators=(",", ":")).encode()


def extender_router(coordinator: Coordinator) -> APIRouter:
    """The extender's routes; no bearer token (see the module's docstring)."""
    extender = Extender(coordinator)
    router = APIRouter(prefix="/scheduler", tags=["scheduler extender"])

    @router.post("/filter", responses=_FILTER_ANSWER, openapi_extra={"requestBody": _ARGS_BODY})
    async def extender_filter(request: Request) -> Response:
        """kube-scheduler's filter verb: the nodes the pod may run on, and why the others
        fail (its cachefs job is suspended; ``cachefs.io/locality: required`` and the node
        holds none of the dataset)."""
        body = await request.body()
        answer = await anyio.to_thread.run_sync(lambda: _encode(extender.filter(body)))
        return Response(answer, media_type="application/json")

    @router.post(
        "/prioritize", responses=_PRIORITIZE_ANSWER, openapi_extra={"requestBody": _ARGS_BODY}
    )
    async def extender_prioritize(request: Request) -> Response:
        """kube-scheduler's prioritize verb: 0..10 per node from its cached bytes of the pod's
        dataset (a running job's copy first), or from the ranking of the pod's
        ``cachefs.io/policy``."""
        body = await request.body()
        answer = await anyio.to_thread.run_sync(lambda: _encode(extender.prioritize(body)))
        return Response(answer, media_type="application/json")

    @router.get("/healthz")
    def extender_health() -> dict[str, Any]:
        """For a probe of the extender's URL prefix (the same answer as ``/healthz``)."""
        return {"ok": True, "cluster_id": coordinator.cluster_id}

    return router
