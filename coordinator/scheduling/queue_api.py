"""``POST /v1/schedule``: a named policy's decisions for a whole queue, on live locality.

A batch scheduler (Volcano, Kueue, Slurm; see ``docs/scheduling.md``) sends its queue: the
jobs, waiting and running (with their current placement), and the free GPUs of each node. The
coordinator adds what only it knows, the live locality (which nodes hold each job's dataset,
as of their last heartbeat, and each node's cache size), builds a
:class:`~.model.ClusterState`, and asks the policy's own :meth:`~.policy.Policy.schedule`, the
code the simulator runs. The answer is one decision per job, in the request's order: ``start``
or ``wait`` for a waiting job, ``keep``, ``resize`` or ``preempt`` for a running one, each with
its nodes and a reason, plus TDCS clones and the locality used.

The request is the whole state: nothing is remembered between calls, so equal requests on
equal locality get equal answers. Themis' leases are therefore all taken as expiring now
(every call is a full round), and ``random`` is seeded with 0.

What the policies see: a node's GPUs are its free GPUs plus those the listed running jobs hold
there. GPUs held by anything else are outside the queue's cluster (no policy may preempt
them); a node's ``gpus`` total, when given, only bounds the request (free + held <= total) and
the size a job may ask for.

Status codes: 200; 422 for a body the spec refuses (sizes out of range, an unknown policy, an
unknown field); 409 for a well-formed request that contradicts itself or the cluster (a job
asking for more GPUs than its nodes have, a placement on a node not listed, more GPUs held
and free than a node has, duplicate ids, an arrival after ``now``, more than
:data:`MAX_JOBS_TIMES_NODES` jobs x nodes) or a policy lacking facts it needs (P4 without
node hardware or model FLOPs); 503 when the live locality cannot be read. Each ``detail`` of
a 409 is one line.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, HTTPException
from pydantic import BaseModel, Field, field_validator

from coordinator.json_types import INTEGRAL, STRICT, JsonInt

from .http import ModelFields, NodeGpus, known_policy, profile_for
from .model import (
    Clone,
    ClusterState,
    Dataset,
    Decision,
    JobSpec,
    JobState,
    Node,
    QosClass,
    Resize,
    SchedulingError,
    Start,
    Wait,
)
from .registry import POLICY_NAMES, make_policy
from .sources import SourceUnavailable

log = logging.getLogger("coordinator.scheduling.queue")

# Bounds: the policies run in the coordinator's process, in Python, and the costliest are
# quadratic in the queue (Tetris' and Min-Min's rounds), in the GPUs (P2's and Themis'
# knapsacks) or in the nodes (P3's shapes, "+locality" I/O estimates). Within these bounds the
# slowest policy (tetris+cer+locality) answers in a few seconds on one core; a bigger cluster
# is scheduled per partition.
MAX_NODES = 32
MAX_NODE_GPUS = 16
MAX_JOBS = 128
MAX_JOBS_TIMES_NODES = 1024
MAX_JOB_GPUS = MAX_NODES * MAX_NODE_GPUS
MAX_TIME_S = 1e10  # unix time until the year 2286
NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$"
DATASET_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # the coordinator's dataset names

NodeName = Annotated[str, Field(pattern=NAME)]


def _finite(**bounds: Any) -> Any:
    """A ``Field`` for a finite number (JSON has no NaN or Infinity; Python's json reads them)."""
    return Field(allow_inf_nan=False, **bounds)


class _Strict(BaseModel):
    model_config = STRICT


class QueueNode(_Strict):
    name: str = Field(pattern=NAME, description="the node's name (its cachefs node id)")
    free_gpus: JsonInt = Field(ge=0, le=MAX_NODE_GPUS, description="GPUs nothing holds now")
    gpus: Annotated[int, Field(ge=0, le=MAX_NODE_GPUS), INTEGRAL] | None = Field(
        None,
        description="the node's GPUs in all (default: free + held by the running jobs listed); "
        "bounds the request, GPUs held by others stay out of the policy's view",
    )
    peak_flops: float | None = _finite(default=None, gt=0, le=1e18)
    memory_bandwidth: float | None = _finite(default=None, gt=0, le=1e15)
    network_bits_per_s: float | None = _finite(default=None, gt=0, le=1e15)
    overhead_s: float = _finite(default=0.0, ge=0, le=1e6)


class HeldGpus(_Strict):
    node: str = Field(pattern=NAME)
    gpus: JsonInt = Field(ge=1, le=MAX_NODE_GPUS)


class Observation(_Strict):
    """A measured epoch time at a GPU count (P2 fits its model to these)."""

    gpus: JsonInt = Field(ge=1, le=MAX_JOB_GPUS)
    epoch_s: float = _finite(gt=0, le=1e9)


class QueueModel(ModelFields):
    """What the caller knows about the job's model; all optional (bounded, unlike the
    placement endpoint's: queue policies compare many jobs' predicted times)."""

    name: str | None = Field(default=None, max_length=128)
    samples_per_s_per_gpu: float | None = _finite(default=None, ge=1e-6, le=1e9)
    comm_gamma: float | None = _finite(default=None, ge=0, le=1.0)
    comm_lambda: float | None = _finite(default=None, ge=0, le=100.0)
    forward_flops: float | None = _finite(default=None, ge=1.0, le=1e15)
    memory_bytes: float | None = _finite(default=None, ge=1.0, le=1e12)
    sync_bytes: float | None = _finite(default=None, ge=1.0, le=1e12)


class QueueJob(_Strict):
    id: str = Field(pattern=NAME, description="unique in the queue")
    gpus: JsonInt = Field(
        ge=1,
        le=MAX_JOB_GPUS,
        description="GPUs asked for: the gang size, or the ask of an elastic policy",
    )
    max_gpus: Annotated[int, Field(ge=1, le=MAX_JOB_GPUS), INTEGRAL] | None = Field(
        None, description="elastic policies may give up to this many (not less than gpus)"
    )
    dataset: str | None = Field(None, pattern=DATASET_NAME, description="cachefs dataset read")
    qos: Literal["urgent", "prior", "normal"] = "normal"
    arrival: float = _finite(
        default=0.0, ge=0, le=MAX_TIME_S, description="when it was queued, on the clock of now"
    )
    placement: list[HeldGpus] = Field(
        default_factory=list,
        max_length=MAX_NODES,
        description="a running job's GPUs per node; empty for a waiting job",
    )
    attained_gpu_s: float = _finite(
        default=0.0, ge=0, le=1e15, description="GPU-seconds received so far (Tiresias LAS)"
    )
    epochs: float = _finite(default=1.0, ge=1e-3, le=1e6)
    epochs_done: float = _finite(default=0.0, ge=0, le=1e6, description="less than epochs")
    samples_per_epoch: JsonInt = Field(default=1_000_000, ge=1, le=10**12)
    batch_size: JsonInt = Field(default=256, ge=1, le=10**6)
    model: QueueModel | None = None
    candidates: list[NodeName] | None = Field(
        None,
        min_length=1,
        max_length=MAX_NODES,
        description="nodes the job may run on (all if absent; names not listed are ignored)",
    )
    observations: list[Observation] = Field(default_factory=list, max_length=64)


class ScheduleRequest(_Strict):
    policy: str = Field(json_schema_extra={"enum": list(POLICY_NAMES)})
    now: float | None = _finite(
        default=None,
        ge=0,
        le=MAX_TIME_S,
        description="the caller's clock, seconds (default: the latest arrival)",
    )
    nodes: list[QueueNode] = Field(min_length=1, max_length=MAX_NODES)
    jobs: list[QueueJob] = Field(max_length=MAX_JOBS, description="queue order breaks ties")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, policy: str) -> str:
        return known_policy(policy)


#: What a decision tells a job to do.
Action = Literal["start", "wait", "keep", "resize", "preempt"]


class JobDecision(BaseModel):
    job: str
    action: Action
    placement: list[NodeGpus] = Field(description="the job's GPUs once the decision is applied")
    gpus: int
    reason: str


class CloneDecision(BaseModel):
    dataset: str
    nodes: list[str]


class DatasetLocality(BaseModel):
    dataset: str
    known: bool = Field(description="false: the coordinator has no such dataset (no locality)")
    size: int
    cached_bytes: dict[str, int]
    cached_fraction: float


class ScheduleResponse(BaseModel):
    policy: str
    now: float
    decisions: list[JobDecision]
    clones: list[CloneDecision]
    locality: list[DatasetLocality]


@dataclass(frozen=True)
class LiveLocality:
    """What the coordinator knows that the caller does not."""

    #: the known datasets among those asked for, with cached bytes on live nodes and copies.
    datasets: Mapping[str, Dataset]
    #: live node -> (cache capacity, cache used), bytes.
    caches: Mapping[str, tuple[int, int]]


#: Reads the live locality of the named datasets (blocking; called in a worker thread).
LocalityReader = Callable[[Collection[str]], LiveLocality]


class QueueConflict(SchedulingError):
    """A well-formed request that contradicts itself or the cluster (409)."""


_SCHEDULE_ERRORS: dict[int | str, dict[str, Any]] = {
    409: {
        "description": "The queue contradicts itself (duplicate ids, a placement on a node not "
        "listed, more GPUs asked, held or free than the nodes have, an arrival after now, more "
        f"than {MAX_JOBS_TIMES_NODES} jobs x nodes) or the policy lacks facts it needs; "
        "`detail` is one line"
    },
    503: {"description": "The live locality cannot be read"},
}

_EXAMPLES = {
    "fifo": {
        "summary": "FIFO with locality: two jobs start, the third waits",
        "value": {
            "policy": "fifo+locality",
            "nodes": [{"name": "n1", "free_gpus": 8}, {"name": "n2", "free_gpus": 8}],
            "jobs": [
                {"id": "resnet-a", "gpus": 8, "dataset": "imagenet", "arrival": 100},
                {"id": "resnet-b", "gpus": 8, "arrival": 110},
                {"id": "bert-c", "gpus": 4, "arrival": 120},
            ],
        },
    },
    "elastic": {
        "summary": "P2 elastic: a running job is shrunk so that a new one starts",
        "value": {
            "policy": "p2-elastic",
            "now": 500,
            "nodes": [{"name": "n1", "free_gpus": 0, "gpus": 8}],
            "jobs": [
                {
                    "id": "big",
                    "gpus": 8,
                    "max_gpus": 8,
                    "arrival": 0,
                    "epochs": 90,
                    "epochs_done": 10,
                    "placement": [{"node": "n1", "gpus": 8}],
                    "model": {"name": "resnet50"},
                },
                {"id": "new", "gpus": 2, "arrival": 450, "model": {"name": "lstm"}},
            ],
        },
    },
}


def schedule_router(read_locality: LocalityReader) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/schedule", responses=_SCHEDULE_ERRORS)
    def schedule(
        request: Annotated[ScheduleRequest, Body(openapi_examples=_EXAMPLES)],
    ) -> ScheduleResponse:
        """Decide for a whole queue with a named policy (``GET /v1/placement/policies``): one
        decision per job, in request order. Waiting jobs ``start`` (nodes and GPUs) or
        ``wait``; running jobs ``keep`` their GPUs, ``resize`` (new GPUs and nodes:
        checkpoint and restart) or are ``preempt``ed back to the queue. Apply a batch by
        releasing the GPUs of every resize and preempt before placing anything. The
        locality (which nodes hold each job's dataset) is the coordinator's, live."""
        try:
            datasets = sorted({job.dataset for job in request.jobs if job.dataset})
            live = read_locality(datasets)
            return decide(request, live)
        except SourceUnavailable as err:
            raise HTTPException(status_code=503, detail=str(err)) from None
        except (SchedulingError, ArithmeticError) as err:
            # Well formed, but inconsistent, or the policy cannot decide with these facts.
            detail = " ".join(str(err).split()) or type(err).__name__
            if not isinstance(err, QueueConflict):
                log.warning("schedule with %s refused: %s", request.policy, detail[:300])
            raise HTTPException(status_code=409, detail=detail) from None

    return router


# --- the request as the policies see it -----------------------------------------------------


def decide(request: ScheduleRequest, live: LiveLocality) -> ScheduleResponse:
    """The policy's decisions for ``request`` on ``live`` locality (pure: no clock, no I/O)."""
    state = cluster_state(request, live)
    if state.total_gpus == 0:
        # No GPU is free and no listed job holds one: nothing can start and nothing can be
        # taken back, whatever the policy (and some policies' models divide by the GPUs).
        decisions: list[Decision] = [
            Wait(job.id, "no free GPUs and no running job in the queue") for job in request.jobs
        ]
    else:
        policy = make_policy(request.policy)
        if not policy.honours_candidates:
            named = next((job.id for job in request.jobs if job.candidates is not None), None)
            if named is not None:
                raise QueueConflict(
                    f"job {named!r} names candidates, which policy {request.policy} does not "
                    "honour (it places by GPU count on every node)"
                )
        decisions = policy.schedule(state)
    return ScheduleResponse(
        policy=request.policy,
        now=state.now,
        decisions=_per_job(request, decisions),
        clones=[
            CloneDecision(dataset=d.dataset, nodes=sorted(d.nodes))
            for d in decisions
            if isinstance(d, Clone)
        ],
        locality=_locality_used(request, live),
    )


def cluster_state(request: ScheduleRequest, live: LiveLocality) -> ClusterState:
    """The :class:`ClusterState` of ``request``; :class:`QueueConflict` when it contradicts
    itself."""
    if len(request.jobs) * len(request.nodes) > MAX_JOBS_TIMES_NODES:
        raise QueueConflict(
            f"{len(request.jobs)} jobs on {len(request.nodes)} nodes: at most "
            f"{MAX_JOBS_TIMES_NODES} jobs x nodes per call (schedule a partition at a time)"
        )
    nodes = {}
    for node in request.nodes:
        if node.name in nodes:
            raise QueueConflict(f"node {node.name!r} is listed twice")
        nodes[node.name] = node
    held = dict.fromkeys(nodes, 0)
    seen: set[str] = set()
    for job in request.jobs:
        if job.id in seen:
            raise QueueConflict(f"job {job.id!r} is listed twice")
        seen.add(job.id)
        on: set[str] = set()
        for part in job.placement:
            if part.node not in nodes:
                raise QueueConflict(f"job {job.id!r} holds GPUs on {part.node!r}, not in nodes")
            if part.node in on:
                raise QueueConflict(f"job {job.id!r} lists node {part.node!r} twice")
            on.add(part.node)
            held[part.node] += part.gpus
    totals = {}
    for name, node in nodes.items():
        used = node.free_gpus + held[name]
        if node.gpus is not None and used > node.gpus:
            raise QueueConflict(
                f"node {name!r}: {node.free_gpus} free + {held[name]} held by running jobs "
                f"> its {node.gpus} GPUs"
            )
        totals[name] = used if node.gpus is None else node.gpus

    now = request.now
    if now is None:
        now = max((job.arrival for job in request.jobs), default=0.0)
    running: list[JobState] = []
    waiting: list[JobState] = []
    for job in request.jobs:
        if job.arrival > now:
            raise QueueConflict(f"job {job.id!r} arrives at {job.arrival:g}, after now ({now:g})")
        _check_sizes(job, totals)
        state = JobState(
            _spec(job),
            {part.node: part.gpus for part in job.placement},
            samples_done=job.epochs_done * job.samples_per_epoch,
            attained_gpu_s=job.attained_gpu_s,
            observations=tuple((o.gpus, o.epoch_s) for o in job.observations),
            first_start=job.arrival if job.placement else None,
        )
        (running if job.placement else waiting).append(state)
    # Arrival order, queue order among equals (sorted is stable).
    running.sort(key=lambda state: state.spec.arrival)
    waiting.sort(key=lambda state: state.spec.arrival)

    policy_nodes = {
        name: Node(
            name,
            node.free_gpus + held[name],
            node.free_gpus,
            peak_flops=node.peak_flops,
            memory_bandwidth=node.memory_bandwidth,
            network_bits_per_s=node.network_bits_per_s,
            overhead_s=node.overhead_s,
            cache_capacity=live.caches.get(name, (0, 0))[0],
            cache_used=min(live.caches.get(name, (0, 0))),
        )
        for name, node in nodes.items()
    }
    return ClusterState(now, policy_nodes, dict(live.datasets), tuple(running), tuple(waiting))


def _check_sizes(job: QueueJob, totals: Mapping[str, int]) -> None:
    if job.max_gpus is not None and job.max_gpus < job.gpus:
        raise QueueConflict(f"job {job.id!r}: max_gpus {job.max_gpus} < gpus {job.gpus}")
    if job.epochs_done >= job.epochs:
        raise QueueConflict(
            f"job {job.id!r}: epochs_done {job.epochs_done:g} >= epochs {job.epochs:g} "
            "(a finished job is not in the queue)"
        )
    allowed = set(totals) if job.candidates is None else set(job.candidates) & set(totals)
    exist = sum(totals[name] for name in allowed)
    if job.gpus > exist:
        where = "the cluster has" if job.candidates is None else "its candidate nodes have"
        raise QueueConflict(f"job {job.id!r} asks for {job.gpus} GPUs; {where} {exist}")
    holds = sum(part.gpus for part in job.placement)
    cap = max(job.gpus, job.max_gpus or 0)
    if holds > cap:
        raise QueueConflict(f"job {job.id!r} holds {holds} GPUs, more than the {cap} it may have")


def _spec(job: QueueJob) -> JobSpec:
    return JobSpec(
        job.id,
        job.arrival,
        job.gpus,
        profile_for(job.model),
        job.epochs * job.samples_per_epoch,
        job.samples_per_epoch,
        job.batch_size,
        dataset=job.dataset,
        qos=QosClass(job.qos),
        max_gpus=job.max_gpus,
        candidates=frozenset(job.candidates) if job.candidates is not None else None,
    )


# --- the answer -----------------------------------------------------------------------------


def _per_job(request: ScheduleRequest, decisions: list[Decision]) -> list[JobDecision]:
    """One decision per job in request order (a job the policy did not mention keeps what it
    has: its GPUs if it runs, its place in the queue if it waits)."""
    by_job: dict[str, Start | Resize | Wait] = {}
    for made in decisions:
        if not isinstance(made, Clone):
            by_job[made.job_id] = made
    answers = []
    for job in request.jobs:
        decision = by_job.get(job.id)
        current = {part.node: part.gpus for part in job.placement}
        action: Action
        if isinstance(decision, Start):
            action, placement, reason = "start", decision.placement, decision.reason
        elif isinstance(decision, Resize) and decision.placement:
            action, placement, reason = "resize", decision.placement, decision.reason
        elif isinstance(decision, Resize):
            action, placement, reason = "preempt", {}, decision.reason
        elif isinstance(decision, Wait):
            action, placement, reason = "wait", {}, decision.reason
        elif job.placement:
            action, placement, reason = "keep", current, "runs on, unchanged"
        else:
            action, placement, reason = "wait", {}, "left in the queue"
        answers.append(
            JobDecision(
                job=job.id,
                action=action,
                placement=[NodeGpus(node=n, gpus=g) for n, g in sorted(placement.items()) if g],
                gpus=sum(placement.values()),
                reason=reason or action,
            )
        )
    return answers


def _locality_used(request: ScheduleRequest, live: LiveLocality) -> list[DatasetLocality]:
    used = []
    for name in sorted({job.dataset for job in request.jobs if job.dataset}):
        dataset = live.datasets.get(name)
        if dataset is None:
            used.append(
                DatasetLocality(
                    dataset=name, known=False, size=0, cached_bytes={}, cached_fraction=0.0
                )
            )
            continue
        fraction = dataset.cached_total / dataset.size if dataset.size else 0.0
        used.append(
            DatasetLocality(
                dataset=name,
                known=True,
                size=dataset.size,
                cached_bytes={n: b for n, b in sorted(dataset.cached.items()) if b > 0},
                cached_fraction=fraction if math.isfinite(fraction) else 0.0,
            )
        )
    return used
