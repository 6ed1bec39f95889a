"""``POST /v1/placement``: ask a policy where a job should run, on live locality.

The router is mounted by :func:`coordinator.app.create_app` now and by the coordinator service
later. Each request refreshes the sources, builds a :class:`ClusterState` (nodes and free GPUs
from the cluster source, the job's dataset from the locality source; no queue), and asks the
named policy's :meth:`~.policy.Policy.place`.

Status codes: 200 with ``decision`` ``place`` or ``wait``; 422 for a body the spec refuses
(malformed, an unknown policy, an empty candidate list); 404 for a dataset the locality source
does not know or candidate nodes not in the cluster; 409 when the policy lacks facts it needs
(e.g. P4 without node hardware or the model's FLOPs); 503 when a source cannot be read.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, cast

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field, field_validator

from coordinator.json_types import INTEGRAL, STRICT, JsonInt

from .model import (
    ClusterState,
    Dataset,
    JobSpec,
    ModelProfile,
    PlacementChoice,
    QosClass,
    SchedulingError,
)
from .profiles import KNOWN_PROFILES, UNKNOWN, most_similar
from .registry import POLICY_NAMES, make_policy
from .sources import ClusterSource, LocalitySource, SourceUnavailable, UnknownDataset

DEFAULT_SAMPLES_PER_EPOCH = 1_000_000


class ModelFields(BaseModel):
    """What the caller knows about the model; all optional."""

    model_config = STRICT

    name: str | None = Field(default=None, max_length=128)
    samples_per_s_per_gpu: float | None = Field(default=None, gt=0)
    comm_gamma: float | None = Field(default=None, ge=0)
    comm_lambda: float | None = Field(default=None, ge=0)
    forward_flops: float | None = Field(default=None, gt=0)
    memory_bytes: float | None = Field(default=None, gt=0)
    sync_bytes: float | None = Field(default=None, gt=0)


class PlacementRequest(BaseModel):
    model_config = STRICT

    name: str = Field(min_length=1, max_length=256)
    gpus: JsonInt = Field(ge=1, le=100_000)
    # An enum in the spec; the validator's message names the known ones.
    policy: str = Field("tdcs", json_schema_extra={"enum": list(POLICY_NAMES)})
    dataset: str | None = Field(default=None, min_length=1, max_length=256)
    candidates: list[str] | None = Field(
        default=None,
        min_length=1,
        description="nodes the job may run on (all if absent; an empty list is refused)",
    )
    max_gpus: Annotated[int, Field(ge=1, le=100_000), INTEGRAL] | None = None
    qos: Literal["urgent", "prior", "normal"] = "normal"
    epochs: float = Field(default=1.0, gt=0)
    samples_per_epoch: JsonInt = Field(default=DEFAULT_SAMPLES_PER_EPOCH, ge=1)
    batch_size: JsonInt = Field(default=256, ge=1)
    model: ModelFields | None = None

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, policy: str) -> str:
        return known_policy(policy)


def known_policy(policy: str) -> str:
    """A request's policy name, checked against the registry (one message for every route)."""
    if policy not in POLICY_NAMES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICY_NAMES)}")
    return policy


class NodeGpus(BaseModel):
    node: str
    gpus: int


class RankedNode(BaseModel):
    node: str
    score: float
    free_gpus: int
    cached_bytes: int


class LocalityUsed(BaseModel):
    dataset: str
    size: int
    cached_bytes: dict[str, int]
    cached_fraction: float


class PlacementResponse(BaseModel):
    job: str
    policy: str
    decision: Literal["place", "wait"]
    placement: list[NodeGpus]
    gpus: int
    explanation: str
    predicted_seconds: float | None
    ranking: list[RankedNode]
    locality: LocalityUsed | None


def profile_for(fields: ModelFields | None) -> ModelProfile:
    """The job's profile: its own numbers over a known model's, an unknown model borrowing the
    most similar known one (P3), or a neutral profile when it says nothing."""
    if fields is None:
        return UNKNOWN
    if fields.name in KNOWN_PROFILES:
        base = KNOWN_PROFILES[fields.name]
    elif fields.forward_flops and fields.memory_bytes:
        base = most_similar(fields.forward_flops, fields.memory_bytes)
    else:
        base = UNKNOWN
    speed = fields.samples_per_s_per_gpu
    return ModelProfile(
        fields.name or base.name,
        (speed, 0.0, 0.0) if speed else base.throughput_coeffs,
        comm_gamma=base.comm_gamma if fields.comm_gamma is None else fields.comm_gamma,
        comm_lambda=base.comm_lambda if fields.comm_lambda is None else fields.comm_lambda,
        forward_flops=fields.forward_flops or base.forward_flops,
        memory_bytes=fields.memory_bytes or base.memory_bytes,
        sync_bytes=fields.sync_bytes or base.sync_bytes,
    )


_PLACEMENT_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"description": "The dataset or a candidate node is not known"},
    409: {"description": "The policy lacks facts it needs (node hardware, model FLOPs)"},
    503: {"description": "A locality or cluster source cannot be read"},
}


def placement_router(locality: LocalitySource, cluster: ClusterSource) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/placement/policies")
    async def list_policies() -> dict[str, list[str]]:
        return {"policies": list(POLICY_NAMES)}

    @router.post("/v1/placement", responses=_PLACEMENT_ERRORS)
    async def place(request: PlacementRequest) -> PlacementResponse:
        try:
            await cluster.refresh()
            if cast(object, locality) is not cluster:  # one source may serve both: refresh once
                await locality.refresh()
            nodes = cluster.nodes()
            dataset = _dataset(locality, request.dataset)
        except SourceUnavailable as err:
            raise HTTPException(status_code=503, detail=str(err)) from None
        except UnknownDataset as err:
            raise HTTPException(status_code=404, detail=str(err)) from None

        unknown = sorted(set(request.candidates or ()) - set(nodes))
        if unknown:
            raise HTTPException(
                status_code=404, detail=f"candidate nodes not in the cluster: {', '.join(unknown)}"
            )
        try:
            spec = JobSpec(
                request.name,
                0.0,
                request.gpus,
                profile_for(request.model),
                request.epochs * request.samples_per_epoch,
                request.samples_per_epoch,
                request.batch_size,
                dataset=request.dataset,
                qos=QosClass(request.qos),
                max_gpus=request.max_gpus,
                candidates=frozenset(request.candidates) if request.candidates else None,
            )
            datasets = {dataset.name: dataset} if dataset else {}
            state = ClusterState(0.0, nodes, datasets)
            choice = make_policy(request.policy).place(spec, state)
        except SchedulingError as err:
            # The request is well formed; the policy cannot decide with the facts at hand.
            raise HTTPException(status_code=409, detail=str(err)) from None
        return _response(request, dataset, choice)

    return router


def _dataset(locality: LocalitySource, name: str | None) -> Dataset | None:
    if name is None:
        return None
    return Dataset(name, locality.dataset_size(name), locality.cached_bytes(name))


def _response(
    request: PlacementRequest, dataset: Dataset | None, choice: PlacementChoice | None
) -> PlacementResponse:
    used = None
    if dataset is not None:
        fraction = dataset.cached_total / dataset.size if dataset.size else 1.0
        used = LocalityUsed(
            dataset=dataset.name,
            size=dataset.size,
            cached_bytes=dict(dataset.cached),
            cached_fraction=fraction,
        )
    if choice is None:
        return PlacementResponse(
            job=request.name,
            policy=request.policy,
            decision="wait",
            placement=[],
            gpus=0,
            explanation="no placement fits the free GPUs now",
            predicted_seconds=None,
            ranking=[],
            locality=used,
        )
    return PlacementResponse(
        job=request.name,
        policy=request.policy,
        decision="place",
        placement=[NodeGpus(node=n, gpus=g) for n, g in sorted(choice.placement.items())],
        gpus=sum(choice.placement.values()),
        explanation=choice.explanation,
        predicted_seconds=_finite(choice.predicted_seconds),
        ranking=[RankedNode(**row.__dict__) for row in choice.ranking],
        locality=used,
    )


def _finite(seconds: float | None) -> float | None:
    """JSON has no infinity: a time a policy cannot predict is reported as null."""
    return seconds if seconds is not None and math.isfinite(seconds) else None
