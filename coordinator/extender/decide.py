"""The extender's decisions: pure functions of the parsed request and a snapshot of what the
coordinator knows (the dataset's locality, the pod's job), the answers' shapes, and
:class:`Extender`, which takes the snapshot and never fails a scheduling attempt (see
:mod:`coordinator.extender`'s docstring)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cachefs.errors import DatasetNotFound

from ..errors import JobNotFound
from ..scheduling.http import DEFAULT_SAMPLES_PER_EPOCH
from ..scheduling.model import ClusterState, Dataset, JobSpec, Node, NodeScore, SchedulingError
from ..scheduling.profiles import UNKNOWN
from ..scheduling.registry import make_policy
from .request import LOCALITY_KEY, ExtenderArgs, MalformedArgs, PodRequest, parse_extender_args

if TYPE_CHECKING:
    from ..service import Coordinator

log = logging.getLogger("coordinator.extender")

MAX_EXTENDER_PRIORITY = 10  # extenderv1.MaxExtenderPriority
# A running job's copy members score COPY_FLOOR..10 and other nodes 0..COPY_FLOOR-1.
COPY_FLOOR = 5


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
    """Answers filter and prioritize from the coordinator's state (blocking: call in a
    thread)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator
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
            for node in self._coordinator.cluster.list_nodes()
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
                job = JobStatus.from_job(self._coordinator.manager.jobs.job(pod.job))
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
            locality = DatasetLocality.from_locality(self._coordinator.cluster.locality(dataset))
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
