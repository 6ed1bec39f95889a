"""The kube-scheduler extender: ``POST /scheduler/filter`` and ``POST /scheduler/prioritize``.

kube-scheduler calls an HTTP extender (``extenders:`` in its KubeSchedulerConfiguration) with an
``ExtenderArgs`` body for every pod it schedules; the wire types are those of
``k8s.io/kube-scheduler/extender/v1`` (``types.go``). They carry no json tags, so the keys are
the Go field names: ``{"Pod": {v1.Pod}, "Nodes": {v1.NodeList} | null, "NodeNames": [..] |
null}``. With ``nodeCacheCapable: true`` it sends ``NodeNames`` and reads ``NodeNames`` back;
with ``false`` it sends ``Nodes`` and reads ``Nodes`` back. An answer without the list the
scheduler reads leaves the pod with no node at all, so every answer repeats the form (or both
forms) of its request. Go's decoder matches keys case-insensitively, so ``pod``/``nodeNames``
from other clients are accepted too; answers use the exact Go names.

What a pod asks for (labels or annotations; an annotation wins when both are set, since it is
the free-form, per-pod setting, while a label may be kept for selectors):

- ``cachefs.io/dataset``: the dataset it reads. Pods without it pass untouched (every pod of
  the cluster comes through an extender that manages no resources, so this path takes no lock).
- ``cachefs.io/locality``: ``preferred`` (default) only scores; ``required`` also filters out
  nodes that hold none of the dataset.
- ``cachefs.io/policy``: a placement policy (``GET /v1/placement/policies``) whose node ranking
  prioritize uses instead of cached bytes alone (see below); an unknown name is logged once and
  ignored.
- ``cachefs.io/job``: the id of the cachefs job (``POST /v1/jobs``) the pod belongs to. Without
  it the id is ``<namespace>.<owner>``: the owner is the Job controller's ``job-name`` label,
  else the controlling owner reference, else the pod itself. cachefs job ids are cluster-wide
  and Kubernetes names are per namespace; a namespace never holds a ``.``, so the id is
  unambiguous.

Node identity: a kube-scheduler node name is the cachefs node id (the DaemonSet runs the worker
with ``--node $(NODE_NAME)``); a node object labelled ``cachefs.io/node`` maps to that id
instead, which only works with ``nodeCacheCapable: false`` (names alone carry no labels).

Answers:

- **filter**: a pod whose cachefs job is *suspended* (the CacheManager queued it) fails on every
  node with the queue position and why, so it stays Pending with that reason and kube-scheduler
  retries it; once the job is promoted the next attempt passes. ``required`` locality fails the
  nodes that hold none of the dataset, even when that fails them all: required means "never run
  this reading from the object store", and a Pending pod whose event says "holds none of dataset
  X" tells the user to preload, where a silent fallback would hide it. Failed nodes are listed
  in ``FailedAndUnresolvableNodes`` (preempting other pods cannot make a node hold a dataset or
  promote a job; kube-scheduler ≥ 1.20 then skips preemption) and in ``FailedNodes`` (what
  older schedulers read); the reason is the same text for every node so that the pod's event
  reads "3 cachefs: …" instead of listing nodes.
- **prioritize**: 0..10 (``MaxExtenderPriority``) from each node's cached bytes of the dataset,
  relative to the node holding the most (which scores 10; any cached byte scores at least 1).
  kube-scheduler multiplies by the extender's ``weight``, so the weight alone says how much
  locality counts. A *running* job's copy comes first, as in TDCS: the copy's nodes score 5..10
  and the others 0..4, each band by cached bytes. With ``cachefs.io/policy`` the nodes are
  ranked by that policy's ``place()`` for a job of the pod's GPUs (``nvidia.com/gpu`` limits
  of its containers, at least 1) reading the dataset, on the coordinator's nodes with all their
  GPUs free (kube-scheduler, not the extender, knows what is allocated): the policy's best
  nodes score 10, each lower distinct score one step less (never below 1), nodes it does not
  rank (no cachefs worker, no GPUs) 0. A policy that cannot rank (P4 without node hardware, a
  job that fits nowhere) falls back to the cached-bytes scores, logged once.
- Pods without a dataset, unknown datasets, unregistered jobs and any internal error pass every
  node (filter) and score 0 (prioritize): cachefs never blocks scheduling, and each such case
  is logged once. A body that is no ExtenderArgs at all cannot be passed through (the node list
  is unknown): filter answers ``Error`` (kube-scheduler skips an ``ignorable`` extender whose
  answer has one, and logs the message), prioritize answers an empty list (prioritize errors
  never fail scheduling). The status is 200 either way: a non-200 reaches the scheduler's log
  only as a status code.

The routes need no bearer token: kube-scheduler's extender client sends none (its config has
no header settings). They only read: filter never registers a job, since kube-scheduler calls
it on every scheduling attempt of every pod and never says when a pod ends, so a job
registered here would hold its copy's slot until its lease ran out. Jobs are registered by
whoever launches them (``POST /v1/jobs``). Anyone who can reach the coordinator can learn
from them which nodes hold a dataset (relative scores) and whether a job they name is queued;
a NetworkPolicy limits who that is, where it matters.

The decisions are pure functions of the parsed request and a snapshot (the locality document
of the dataset, the job's status); :class:`Extender` takes the snapshot and
:func:`extender_router` is the HTTP layer. Parsing, the cluster lock and JSON encoding run in a
worker thread, never on the event loop.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import anyio
from fastapi import APIRouter, Request, Response

from cachefs.errors import DatasetNotFound

from .manager import JobNotFound
from .pods import DATASET_KEY, JOB_KEY, job_id, setting, strings
from .scheduling.http import DEFAULT_SAMPLES_PER_EPOCH
from .scheduling.model import ClusterState, Dataset, JobSpec, Node, NodeScore, SchedulingError
from .scheduling.profiles import UNKNOWN
from .scheduling.registry import POLICY_NAMES, make_policy

if TYPE_CHECKING:
    from .cluster import Cluster

log = logging.getLogger("coordinator.extender")

LOCALITY_KEY = "cachefs.io/locality"
POLICY_KEY = "cachefs.io/policy"
GPU_RESOURCE = "nvidia.com/gpu"
MAX_POD_GPUS = 4096
NODE_LABEL = "cachefs.io/node"
MAX_EXTENDER_PRIORITY = 10  # extenderv1.MaxExtenderPriority
# A running job's copy members score COPY_FLOOR..10 and other nodes 0..COPY_FLOOR-1.
COPY_FLOOR = 5

LocalityMode = Literal["preferred", "required"]


class MalformedArgs(ValueError):
    """The body is no ExtenderArgs: no node list can be read from it."""


# --- the request ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PodRequest:
    """What a pod asks of cachefs."""

    namespace: str
    name: str
    dataset: str | None
    locality: LocalityMode
    job: str | None  # the cachefs job id to look up; None when the pod names no dataset or job
    notes: tuple[str, ...] = ()  # settings that were ignored, worth one log line
    policy: str | None = None  # a policy of POLICY_NAMES whose ranking prioritize uses
    gpus: int = 1  # GPUs the pod asks for (its containers' nvidia.com/gpu), at least 1


@dataclass(frozen=True)
class ExtenderArgs:
    pod: PodRequest
    node_names: tuple[str, ...] | None  # the NodeNames form, as sent
    node_list: Mapping[str, Any] | None  # the Nodes form: the v1.NodeList as sent
    cachefs_ids: Mapping[str, str]  # kube-scheduler node name -> cachefs node id

    @property
    def candidates(self) -> list[str]:
        """Every node name of the request, in request order."""
        names = list(self.node_names or ())
        seen = set(names)
        for item in self.node_list["items"] if self.node_list else ():
            name = item["metadata"]["name"]
            if name not in seen:
                seen.add(name)
                names.append(name)
        return names


def parse_extender_args(body: bytes | str) -> ExtenderArgs:
    """Read an ExtenderArgs body; :class:`MalformedArgs` when no node list can be read."""
    try:
        doc = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise MalformedArgs(f"the body is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise MalformedArgs("the body is not a JSON object (ExtenderArgs)")
    pod = _field(doc, "Pod")
    if pod is not None and not isinstance(pod, dict):
        raise MalformedArgs("Pod is not an object")
    node_names = _field(doc, "NodeNames")
    if node_names is not None and not (
        isinstance(node_names, list) and all(isinstance(n, str) and n for n in node_names)
    ):
        raise MalformedArgs("NodeNames is not a list of node names")
    node_list = _field(doc, "Nodes")
    cachefs_ids = {name: name for name in node_names or ()}
    if node_list is not None:
        if not isinstance(node_list, dict):
            raise MalformedArgs("Nodes is not a NodeList object")
        # Go marshals an empty NodeList's items as null.
        items = _field(node_list, "items")
        items = [] if items is None else items
        if not isinstance(items, list):
            raise MalformedArgs("Nodes.items is not a list")
        for item in items:
            name = _node_name(item)
            if name is None:
                raise MalformedArgs("a node in Nodes.items has no metadata.name")
            labels = strings(item["metadata"].get("labels"))
            cachefs_ids[name] = labels.get(NODE_LABEL, "").strip() or name
        node_list = {**node_list, "items": items}
    if node_names is None and node_list is None:
        raise MalformedArgs("neither Nodes nor NodeNames is given")
    return ExtenderArgs(
        parse_pod(pod or {}),
        tuple(node_names) if node_names is not None else None,
        node_list,
        cachefs_ids,
    )


def parse_pod(pod: Mapping[str, Any]) -> PodRequest:
    """The dataset, locality and job a v1.Pod names (see the module's docstring)."""
    meta = pod.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    namespace = meta.get("namespace") if isinstance(meta.get("namespace"), str) else ""
    name = meta.get("name") if isinstance(meta.get("name"), str) else ""
    namespace = namespace or "default"

    dataset = setting(meta, DATASET_KEY)
    notes = []
    wanted = (setting(meta, LOCALITY_KEY) or "preferred").lower()
    locality: LocalityMode = "required" if wanted == "required" else "preferred"
    if wanted not in ("required", "preferred"):
        notes.append(
            f"{LOCALITY_KEY}={wanted[:64]!r} is neither required nor preferred; using preferred"
        )
    policy = setting(meta, POLICY_KEY)
    if policy is not None and policy not in POLICY_NAMES:
        notes.append(f"{POLICY_KEY}={policy[:64]!r} is no known policy; scoring by cached bytes")
        policy = None
    # A job is looked up when the pod names one, or names a dataset (then it is derived).
    job = setting(meta, JOB_KEY)
    if job is None and dataset is not None:
        job = job_id(meta, namespace, name)
    return PodRequest(
        namespace, name, dataset, locality, job, tuple(notes), policy, pod_gpus(pod.get("spec"))
    )


def pod_gpus(spec: Any) -> int:
    """GPUs a v1.PodSpec asks for: the sum of its containers' ``nvidia.com/gpu`` limits (else
    requests; an extended resource's request equals its limit), at least 1."""
    total = 0
    containers = spec.get("containers") if isinstance(spec, dict) else None
    for container in containers if isinstance(containers, list) else ():
        resources = container.get("resources") if isinstance(container, dict) else None
        if not isinstance(resources, dict):
            continue
        for kind in ("limits", "requests"):
            amounts = resources.get(kind)
            value = amounts.get(GPU_RESOURCE) if isinstance(amounts, dict) else None
            # A quantity is a string ("2") or, from some clients, a number.
            if isinstance(value, int) and not isinstance(value, bool):
                total += max(0, value)
                break
            if isinstance(value, str) and value.strip().isdigit():
                total += int(value.strip())
                break
    return max(1, min(total, MAX_POD_GPUS))


def _field(obj: Mapping[str, Any], name: str) -> Any:
    """``obj[name]``, matched the way Go's encoding/json matches a field without a json tag:
    the exact key first, else any key equal under case folding."""
    if name in obj:
        return obj[name]
    folded = name.casefold()
    for key, value in obj.items():
        if key.casefold() == folded:
            return value
    return None


def _node_name(item: Any) -> str | None:
    meta = item.get("metadata") if isinstance(item, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) and name else None


def _reject_constant(name: str) -> Any:
    # Python's json reads NaN and Infinity; Go's does not, and an answer echoing one (a node
    # object's field) would be no JSON to the scheduler.
    raise ValueError(f"{name} is not JSON")


# --- the snapshot ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetLocality:
    """Where a dataset is cached, as the locality API reports it."""

    dataset: str
    cached_bytes: Mapping[str, int]  # cachefs node id -> cached bytes, nodes that are up
    down: frozenset[str]  # nodes whose worker is down (their bytes are not readable)
    copies: Mapping[str, frozenset[str]]  # copy id -> its nodes
    size: int = 0  # the dataset's bytes

    @classmethod
    def from_locality(cls, doc: Mapping[str, Any]) -> DatasetLocality:
        """From a ``GET /v1/datasets/{name}/locality`` answer."""
        rows = doc["nodes"]
        return cls(
            doc["dataset"],
            {row["node"]: row["cached_bytes"] for row in rows if row["state"] == "up"},
            frozenset(row["node"] for row in rows if row["state"] != "up"),
            {copy["id"]: frozenset(copy["nodes"]) for copy in doc["copies"]},
            doc["bytes"],
        )


@dataclass(frozen=True)
class JobStatus:
    id: str
    dataset: str
    state: str  # running | suspended
    position: int | None  # in the dataset's suspend queue, 1 = next
    copy: str | None
    explanation: str

    @classmethod
    def from_job(cls, doc: Mapping[str, Any]) -> JobStatus:
        """From a ``GET /v1/jobs/{id}`` answer."""
        return cls(
            doc["id"], doc["dataset"], doc["state"], doc["position"], doc["copy"],
            doc["explanation"],
        )  # fmt: skip


# --- the decisions --------------------------------------------------------------------------


@dataclass(frozen=True)
class FilterDecision:
    passed: tuple[str, ...]  # node names, request order
    failed: Mapping[str, str]  # node name -> reason (preemption would not help)


def pass_all(args: ExtenderArgs) -> FilterDecision:
    return FilterDecision(tuple(args.candidates), {})


def decide_filter(
    args: ExtenderArgs, locality: DatasetLocality | None, job: JobStatus | None
) -> FilterDecision:
    """Which nodes the pod may run on (see the module's docstring)."""
    nodes = args.candidates
    if job is not None and job.state == "suspended":
        reason = suspended_reason(job)
        return FilterDecision((), {node: reason for node in nodes})
    if locality is None or args.pod.locality != "required":
        return FilterDecision(tuple(nodes), {})
    passed, failed = [], {}
    for node in nodes:
        cachefs_id = args.cachefs_ids.get(node, node)
        if locality.cached_bytes.get(cachefs_id, 0) > 0:
            passed.append(node)
        elif cachefs_id in locality.down:
            failed[node] = (
                f"cachefs: the node's cachefs worker is down, so none of dataset "
                f"{locality.dataset} is readable there ({LOCALITY_KEY}: required)"
            )
        else:
            failed[node] = (
                f"cachefs: the node holds none of dataset {locality.dataset} "
                f"({LOCALITY_KEY}: required; preload it or use preferred)"
            )
    return FilterDecision(tuple(passed), failed)


def suspended_reason(job: JobStatus) -> str:
    why = job.explanation.removeprefix("suspended: ").removeprefix("suspended ")
    return (
        f"cachefs: job {job.id} is suspended, position {job.position} in the queue of dataset "
        f"{job.dataset} ({why}); it runs once the CacheManager promotes it"
    )


def decide_priorities(
    args: ExtenderArgs, locality: DatasetLocality | None, job: JobStatus | None
) -> list[tuple[str, int]]:
    """A 0..10 score per node, request order (see the module's docstring)."""
    nodes = args.candidates
    if locality is None or (job is not None and job.state != "running"):
        return [(node, 0) for node in nodes]
    held = {node: locality.cached_bytes.get(args.cachefs_ids.get(node, node), 0) for node in nodes}
    most = max(held.values(), default=0)

    def scaled(nbytes: int, top: int) -> int:
        # ceil(top * nbytes / most) in integers: any cached byte counts, the most scores top.
        return -(-top * nbytes // most) if most else 0

    copy_nodes = locality.copies.get(job.copy) if job is not None and job.copy else None
    if copy_nodes is None:
        return [(node, scaled(held[node], MAX_EXTENDER_PRIORITY)) for node in nodes]
    scores = []
    for node in nodes:
        if args.cachefs_ids.get(node, node) in copy_nodes:
            score = COPY_FLOOR + scaled(held[node], MAX_EXTENDER_PRIORITY - COPY_FLOOR)
        else:
            score = scaled(held[node], COPY_FLOOR - 1)
        scores.append((node, score))
    return scores


def policy_job(pod: PodRequest, dataset: str) -> JobSpec:
    """The job a policy ranks nodes for: the pod's GPUs reading ``dataset`` (a neutral model,
    one epoch: the extender knows nothing more of the training)."""
    return JobSpec(
        pod.job or f"{pod.namespace}.{pod.name}",
        0.0,
        pod.gpus,
        UNKNOWN,
        float(DEFAULT_SAMPLES_PER_EPOCH),
        DEFAULT_SAMPLES_PER_EPOCH,
        dataset=dataset,
    )


def policy_state(locality: DatasetLocality, gpus: Mapping[str, int]) -> ClusterState:
    """What a policy sees: ``gpus`` (cachefs node id -> GPUs, all free) and the dataset."""
    nodes = {node: Node(node, count, count) for node, count in gpus.items()}
    copies = tuple(members for _, members in sorted(locality.copies.items()) if members)
    dataset = Dataset(locality.dataset, locality.size, dict(locality.cached_bytes), copies)
    return ClusterState(0.0, nodes, {dataset.name: dataset})


def ranked_priorities(args: ExtenderArgs, ranking: tuple[NodeScore, ...]) -> list[tuple[str, int]]:
    """A policy's ranking as 0..10 per node, request order: its best score 10, each lower
    distinct score one step less, never below 1; nodes it does not rank 0."""
    levels = sorted({row.score for row in ranking}, reverse=True)
    step = {score: index for index, score in enumerate(levels)}
    scores = {
        row.node: MAX_EXTENDER_PRIORITY - MAX_EXTENDER_PRIORITY * step[row.score] // len(levels)
        for row in ranking
    }
    return [(node, scores.get(args.cachefs_ids.get(node, node), 0)) for node in args.candidates]


# --- the answers ----------------------------------------------------------------------------


def filter_result(args: ExtenderArgs, decision: FilterDecision) -> dict[str, Any]:
    """The ExtenderFilterResult, in the form(s) of the request."""
    passed = set(decision.passed)
    node_list = None
    if args.node_list is not None:
        items = [item for item in args.node_list["items"] if item["metadata"]["name"] in passed]
        node_list = {**args.node_list, "items": items}
    node_names = None
    if args.node_names is not None:
        node_names = [name for name in args.node_names if name in passed]
    failed = dict(decision.failed)
    return {
        "Nodes": node_list,
        "NodeNames": node_names,
        "FailedNodes": failed,
        "FailedAndUnresolvableNodes": failed,
        "Error": "",
    }


def error_filter_result(message: str) -> dict[str, Any]:
    return {
        "Nodes": None,
        "NodeNames": None,
        "FailedNodes": {},
        "FailedAndUnresolvableNodes": {},
        "Error": message,
    }


def host_priority_list(priorities: list[tuple[str, int]]) -> list[dict[str, Any]]:
    return [{"Host": node, "Score": score} for node, score in priorities]


# --- the service ----------------------------------------------------------------------------


class _LogOnce:
    """Warn once per key: kube-scheduler retries a pod every few seconds, and one line per
    attempt would bury the log. Only the keys' hashes are kept (keys hold pod-supplied text
    of any length), at most ``limit`` of them."""

    def __init__(self, limit: int = 4096) -> None:
        self._seen: set[int] = set()
        self._limit = limit
        self._lock = threading.Lock()

    def first(self, key: Any) -> bool:
        with self._lock:
            digest = hash(key)
            if digest in self._seen:
                return False
            if len(self._seen) >= self._limit:
                self._seen.clear()
            self._seen.add(digest)
            return True


class Extender:
    """Answers filter and prioritize from the cluster's state (blocking: call in a thread)."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._once = _LogOnce()

    def filter(self, body: bytes | str) -> dict[str, Any]:
        try:
            args = parse_extender_args(body)
        except MalformedArgs as exc:
            self._warn(("malformed", "filter"), "filter: %s; answering an error", exc)
            return error_filter_result(f"cachefs extender: {exc}")
        try:
            return filter_result(args, decide_filter(args, *self.snapshot(args.pod)))
        except Exception:
            self._failed("filter")
            return filter_result(args, pass_all(args))

    def prioritize(self, body: bytes | str) -> list[dict[str, Any]]:
        try:
            args = parse_extender_args(body)
        except MalformedArgs as exc:
            self._warn(("malformed", "prioritize"), "prioritize: %s; answering no scores", exc)
            return []
        try:
            locality, job = self.snapshot(args.pod)
            ranked = self.policy_priorities(args, locality, job)
            if ranked is None:
                ranked = decide_priorities(args, locality, job)
            return host_priority_list(ranked)
        except Exception:
            self._failed("prioritize")
            return host_priority_list([(node, 0) for node in args.candidates])

    def policy_priorities(
        self, args: ExtenderArgs, locality: DatasetLocality | None, job: JobStatus | None
    ) -> list[tuple[str, int]] | None:
        """Scores from the ranking of the pod's ``cachefs.io/policy``; None when it names none,
        or where the cached-bytes scores apply anyway (no locality, a job not running), or when
        the policy cannot rank."""
        pod = args.pod
        if pod.policy is None or locality is None:
            return None
        if job is not None and job.state != "running":
            return None
        wanted = {args.cachefs_ids.get(node, node) for node in args.candidates}
        gpus = {
            node["node"]: node["gpus"]
            for node in self._cluster.list_nodes()
            if node["state"] == "up" and node["node"] in wanted
        }
        try:
            policy = make_policy(pod.policy)
            choice = policy.place(policy_job(pod, locality.dataset), policy_state(locality, gpus))
        except SchedulingError as exc:
            why = " ".join(str(exc).split())
            self._warn(("policy", pod.policy, why), "prioritize with %s: %s; scoring by cached "
                       "bytes", pod.policy, why)  # fmt: skip
            return None
        if choice is None:
            return None  # fits nowhere now: kube-scheduler's own filters will say so
        return ranked_priorities(args, choice.ranking)

    def snapshot(self, pod: PodRequest) -> tuple[DatasetLocality | None, JobStatus | None]:
        """The dataset's locality and the pod's job, as far as the coordinator knows them."""
        for note in pod.notes:
            where = (pod.namespace, pod.name)
            self._warn(("note", note), "pod %.80s/%.80s: %s", *where, note)
        if pod.dataset is None and pod.job is None:
            return None, None
        job = None
        if pod.job is not None:
            try:
                job = JobStatus.from_job(self._cluster.manager.job(pod.job))
            except JobNotFound:
                pass  # not registered (yet): locality alone decides
        dataset = pod.dataset or (job.dataset if job else None)
        if job is not None and dataset != job.dataset:
            self._warn(
                ("job-dataset", job.id, dataset),
                "pod %.80s/%.80s names dataset %.80r but its job %.80r reads %s; "
                "using the job's state",
                pod.namespace, pod.name, dataset, job.id, job.dataset,
            )  # fmt: skip
        if dataset is None:
            return None, job
        try:
            locality = DatasetLocality.from_locality(self._cluster.locality(dataset))
        except DatasetNotFound:
            self._warn(
                ("unknown-dataset", dataset),
                "pod %.80s/%.80s names dataset %.80r, which the coordinator does not know; "
                "its nodes pass unscored",
                pod.namespace, pod.name, dataset,
            )  # fmt: skip
            return None, job
        return locality, job

    def _warn(self, key: Any, message: str, *args: Any) -> None:
        if self._once.first(key):
            log.warning(message, *args)

    def _failed(self, verb: str) -> None:
        # A bug, not a request problem: the traceback once, then pass-through answers.
        if self._once.first(("error", verb)):
            log.exception("%s failed; every node passes unscored (logged once)", verb)


# --- HTTP -----------------------------------------------------------------------------------

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
_FILTER_ANSWER = {
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
_PRIORITIZE_ANSWER = {
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


def extender_router(cluster: Cluster) -> APIRouter:
    """The extender's routes; no bearer token (see the module's docstring)."""
    extender = Extender(cluster)
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
        return {"ok": True, "cluster_id": cluster.cluster_id}

    return router
