"""The CacheScaler's decisions, as pure functions: Kubernetes objects and coordinator documents in,
a :class:`Plan` out. No I/O and no clock here (``now`` is an argument), so every rule — which
pods count, which copy a pod reads, which nodes join or leave a copy, when the metric trigger
acts, when a node's worker label may go — is tested without a cluster.

The controller (:mod:`coordinator.scaler.controller`) gathers the inputs, calls :func:`plan`
and carries the plan out in this order: label nodes, drop stale ownership records, then per
copy record ownership of the nodes it adds, scale, forget ownership of the nodes it removed;
unlabel last. A node is unlabelled only when no copy of any dataset includes it and no running
hand-off still reads from it, so its worker (which the label keeps on the node) outlives the
data it serves.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator.pods import DATASET_KEY, job_id, setting

# --- the names the scaler reads and writes on Kubernetes objects ----------------------------------

# Pods name their dataset (DATASET_KEY) and job (cachefs.io/job) as the scheduler extender reads
# them (coordinator.pods). The job's copy is the pod's copy when the pod names no copy itself.
#: Pod annotation (or label; the annotation wins) naming the copy of the dataset the pod reads
#: (optional).
COPY_KEY = "cachefs.io/copy"
#: Node label the worker DaemonSet selects on.
WORKER_LABEL = "cachefs.io/worker"
WORKER_LABEL_VALUE = "true"
#: Node annotation: the copies the scaler added the node to, and which trigger did,
#: ``"imagenet/A=event,coco/B=metric"``. The scaler only ever removes nodes it added.
ADDED_KEY = "cachefs.io/scaler-added"
#: Node annotation ``"true"``: the scaler set the worker label (it never removes a label an
#: operator set).
LABELED_KEY = "cachefs.io/scaler-labeled"

EVENT = "event"
METRIC = "metric"
SCALE_OUT = "out"
SCALE_IN = "in"

#: Pods in these phases hold no node any more.
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
#: cachefs node names (the coordinator's API pattern); a Kubernetes node name is a DNS
#: subdomain of up to 253 characters, so not every node can be a cachefs node.
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

CopyKey = tuple[str, str]  # (dataset, copy id)


def copy_name(key: CopyKey) -> str:
    return f"{key[0]}/{key[1]}"


# --- pods -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingPod:
    """A pod that reads a cachefs dataset and holds a node now."""

    namespace: str
    name: str
    node: str
    dataset: str
    copy: str | None  # the copy the pod names, if any
    job: str | None  # the pod's cachefs job id (named or derived from its owner)


def training_pod(pod: Mapping[str, Any]) -> TrainingPod | None:
    """The pod as a training pod of a dataset, or None when it names no dataset or does not hold
    a node: not scheduled yet (no ``spec.nodeName``), finished (Succeeded/Failed) or being
    deleted (``deletionTimestamp``). A Pending pod already bound to a node counts: its node
    needs the worker before the pod can read."""
    meta = pod.get("metadata") or {}
    dataset = setting(meta, DATASET_KEY)
    if dataset is None or meta.get("deletionTimestamp"):
        return None
    node = (pod.get("spec") or {}).get("nodeName")
    if not node:
        return None
    if (pod.get("status") or {}).get("phase") in TERMINAL_PHASES:
        return None
    namespace, name = meta.get("namespace", ""), meta.get("name", "")
    return TrainingPod(
        namespace=namespace,
        name=name,
        node=node,
        dataset=dataset,
        copy=setting(meta, COPY_KEY),
        job=job_id(meta, namespace, name),
    )


# --- the coordinator's view -----------------------------------------------------------------------


@dataclass(frozen=True)
class CopyView:
    dataset: str
    copy: str
    nodes: frozenset[str]
    used_ratio: float
    #: Nodes a running fill reads from or is about to free (its sources and leaving nodes):
    #: they serve the hand-off, so their workers must stay.
    fill_nodes: frozenset[str] = frozenset()
    filling: bool = False

    @property
    def key(self) -> CopyKey:
        return (self.dataset, self.copy)


def copies_of(datasets: Iterable[Mapping[str, Any]]) -> dict[str, list[CopyView]]:
    """Each dataset's copies in creation order (the first is the dataset's primary copy), from
    ``GET /v1/datasets``."""
    result: dict[str, list[CopyView]] = {}
    for dataset in datasets:
        views = []
        for copy in dataset.get("copies", []):
            fill = copy.get("fill") or None
            fill_nodes = (
                frozenset(fill.get("sources", []) + fill.get("leaving", [])) if fill else ()
            )
            views.append(
                CopyView(
                    dataset=dataset["name"],
                    copy=copy["id"],
                    nodes=frozenset(copy.get("nodes", [])),
                    used_ratio=float(copy.get("used_ratio", 0.0)),
                    fill_nodes=frozenset(fill_nodes),
                    filling=fill is not None,
                )
            )
        result[dataset["name"]] = views
    return result


@dataclass(frozen=True)
class WorkerView:
    """A cachefs node as the coordinator sees it (``GET /v1/nodes``)."""

    up: bool
    free_bytes: int = 0
    cached: Mapping[str, int] = field(default_factory=dict)  # dataset -> cached bytes


def workers_of(nodes: Iterable[Mapping[str, Any]]) -> dict[str, WorkerView]:
    result = {}
    for doc in nodes:
        tiers = doc.get("tiers", [])
        free = sum(t.get("capacity", 0) for t in tiers) - sum(t.get("used", 0) for t in tiers)
        cached = {d["dataset"]: d.get("cached_bytes", 0) for d in doc.get("datasets", [])}
        result[doc["node"]] = WorkerView(doc.get("state") == "up", max(0, free), cached)
    return result


def job_copies(jobs: Iterable[Mapping[str, Any]]) -> dict[str, CopyKey]:
    """Running cachefs jobs (``GET /v1/jobs``) -> the copy each was placed on."""
    return {
        job["id"]: (job["dataset"], job["copy"])
        for job in jobs
        if job.get("state") == "running" and job.get("copy")
    }


# --- Kubernetes nodes -----------------------------------------------------------------------------


def parse_added(value: str | None) -> dict[CopyKey, str]:
    """``"imagenet/A=event,coco/B=metric"`` -> {("imagenet", "A"): "event", …}. Entries that do
    not parse are dropped (dataset and copy names cannot hold ``/``, ``=`` or ``,``)."""
    owned: dict[CopyKey, str] = {}
    for entry in (value or "").split(","):
        where, _, trigger = entry.strip().partition("=")
        dataset, _, copy = where.partition("/")
        if dataset and copy and trigger in (EVENT, METRIC):
            owned[(dataset, copy)] = trigger
    return owned


def format_added(owned: Mapping[CopyKey, str]) -> str | None:
    """The annotation value for ``owned``; None (remove the annotation) when empty."""
    if not owned:
        return None
    return ",".join(f"{copy_name(key)}={owned[key]}" for key in sorted(owned))


@dataclass(frozen=True)
class KubeNode:
    name: str
    labeled: bool  # carries cachefs.io/worker=true
    labeled_by_scaler: bool
    added: Mapping[CopyKey, str] = field(default_factory=dict)  # copies the scaler added it to


def kube_node(obj: Mapping[str, Any]) -> KubeNode:
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    return KubeNode(
        name=meta.get("name", ""),
        labeled=labels.get(WORKER_LABEL) == WORKER_LABEL_VALUE,
        labeled_by_scaler=annotations.get(LABELED_KEY) == "true",
        added=parse_added(annotations.get(ADDED_KEY)),
    )


# --- which copy a pod reads, and the node sets the pods ask for ----------------------------------


def copy_for(
    pod: TrainingPod, copies: Mapping[str, list[CopyView]], jobs: Mapping[str, CopyKey]
) -> CopyKey | None:
    """The copy the pod reads: the one it names (``cachefs.io/copy``), else its cachefs job's
    (``cachefs.io/job``), else the dataset's primary (first) copy. None for a dataset the
    coordinator does not know."""
    views = copies.get(pod.dataset)
    if not views:
        return None
    ids = [view.copy for view in views]
    if pod.copy in ids:
        return (pod.dataset, pod.copy)
    job_copy = jobs.get(pod.job) if pod.job else None
    if job_copy is not None and job_copy[0] == pod.dataset and job_copy[1] in ids:
        return job_copy
    return (pod.dataset, ids[0])


def pods_per_copy(
    pods: Iterable[TrainingPod],
    copies: Mapping[str, list[CopyView]],
    jobs: Mapping[str, CopyKey],
) -> dict[CopyKey, dict[str, int]]:
    """For each copy, the nodes running its training pods and how many."""
    wanted: dict[CopyKey, dict[str, int]] = {}
    for pod in pods:
        key = copy_for(pod, copies, jobs)
        if key is not None:
            per_node = wanted.setdefault(key, {})
            per_node[pod.node] = per_node.get(pod.node, 0) + 1
    return wanted


def track_idle(
    idle_since: Mapping[tuple[str, CopyKey], float],
    kube_nodes: Mapping[str, KubeNode],
    copies: Mapping[str, list[CopyView]],
    wanted: Mapping[CopyKey, Mapping[str, int]],
    now: float,
) -> dict[tuple[str, CopyKey], float]:
    """Since when each node the event trigger added to a copy has had no training pod of that
    copy. A node whose pods come back (a pod replaced, a job restarted) starts over."""
    members = {view.key: view.nodes for views in copies.values() for view in views}
    result = {}
    for node in kube_nodes.values():
        for key, trigger in node.added.items():
            if trigger != EVENT or node.name not in members.get(key, ()):
                continue
            if node.name in wanted.get(key, {}):
                continue
            result[(node.name, key)] = idle_since.get((node.name, key), now)
    return result


# --- the metric trigger ---------------------------------------------------------------------------


@dataclass
class MetricHistory:
    """A copy's used-ratio samples (oldest first) and when the scaler last acted on it."""

    samples: list[tuple[float, float]] = field(default_factory=list)  # (time, ratio)
    last_action_at: float | None = None


def add_sample(history: MetricHistory, at: float, ratio: float, window_s: float) -> None:
    """Keep the samples of the last ``window_s`` plus the newest one before it: that one shows
    whether the ratio was already where it is when the window began."""
    history.samples.append((at, ratio))
    start = at - window_s
    older = [i for i, (t, _) in enumerate(history.samples) if t <= start]
    if older:
        del history.samples[: older[-1]]


def metric_verdict(
    history: MetricHistory,
    now: float,
    *,
    window_s: float,
    high: float,
    low: float,
    cooldown_s: float,
) -> str | None:
    """``"out"`` when every sample since at least ``window_s`` ago is above ``high``, ``"in"``
    when every one is below ``low``, else None. Hysteresis: between ``low`` and ``high`` nothing
    happens, and a verdict needs a whole window of agreeing samples; after an action the samples
    start over (:func:`record_action`) and none count for ``cooldown_s``."""
    if history.last_action_at is not None and now - history.last_action_at < cooldown_s:
        return None
    samples = history.samples
    if not samples or samples[0][0] > now - window_s:
        return None  # not watched for a whole window yet
    if history.last_action_at is not None and samples[0][0] < history.last_action_at + cooldown_s:
        return None  # a sample taken during the cooldown cannot start the window
    ratios = [ratio for _, ratio in samples]
    if all(ratio > high for ratio in ratios):
        return SCALE_OUT
    if all(ratio < low for ratio in ratios):
        return SCALE_IN
    return None


def record_action(history: MetricHistory, now: float) -> None:
    history.samples.clear()
    history.last_action_at = now


def scale_out_node(
    key: CopyKey,
    copies: Mapping[str, list[CopyView]],
    kube_nodes: Mapping[str, KubeNode],
    workers: Mapping[str, WorkerView],
    pods_of_dataset: Mapping[str, int],
    exclude: Iterable[str] = (),
) -> str | None:
    """The node the metric trigger adds: one whose worker runs (worker label, up at the
    coordinator) outside every copy of the dataset — nodes running the dataset's training pods
    first, then the most free cache, then by name."""
    dataset = key[0]
    in_dataset = {n for view in copies.get(dataset, []) for n in view.nodes}
    skip = set(exclude)
    candidates = [
        name
        for name, node in kube_nodes.items()
        if node.labeled
        and name not in in_dataset
        and name not in skip
        and name in workers
        and workers[name].up
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda n: (-pods_of_dataset.get(n, 0), -workers[n].free_bytes, n))


def scale_in_node(
    view: CopyView,
    kube_nodes: Mapping[str, KubeNode],
    workers: Mapping[str, WorkerView],
    pods_of_dataset: Mapping[str, int],
    exclude: Iterable[str] = (),
) -> str | None:
    """The node the metric trigger removes: one it added itself that runs no training pod of
    the dataset, holding the fewest cached bytes of it (the least to hand off), then by name."""
    skip = set(exclude)
    candidates = [
        name
        for name in view.nodes
        if name in kube_nodes
        and kube_nodes[name].added.get(view.key) == METRIC
        and not pods_of_dataset.get(name)
        and name not in skip
    ]
    if not candidates:
        return None

    def cached(name: str) -> int:
        worker = workers.get(name)
        return worker.cached.get(view.dataset, 0) if worker else 0

    return min(candidates, key=lambda n: (cached(n), n))


# --- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    min_nodes: int = 1  # a copy never shrinks below this (nor below 1: the API refuses 0)
    max_nodes: int | None = None  # a copy never grows past this
    release_grace_s: float = 0.0  # how long a node keeps no training pod before it leaves


@dataclass
class CopyChange:
    """One scale call: nodes to add (each with the trigger that wants it) and to remove."""

    key: CopyKey
    add: dict[str, str] = field(default_factory=dict)  # node -> trigger
    remove: list[str] = field(default_factory=list)
    metric: str | None = None  # the metric verdict this change carries out, if any
    reasons: dict[str, str] = field(default_factory=dict)  # node -> why it joins or leaves


@dataclass
class Plan:
    label: list[str] = field(default_factory=list)
    #: Nodes whose ADDED_KEY annotation loses stale entries (copies gone, or the node is no
    #: longer in them): node -> the records to keep.
    retag: dict[str, dict[CopyKey, str]] = field(default_factory=dict)
    changes: list[CopyChange] = field(default_factory=list)
    unlabel: list[str] = field(default_factory=list)
    #: Why something wanted is not done yet (a worker not registered, a bound reached, …).
    waiting: list[str] = field(default_factory=list)


def plan(
    *,
    pods: Iterable[TrainingPod],
    copies: Mapping[str, list[CopyView]],
    jobs: Mapping[str, CopyKey],
    kube_nodes: Mapping[str, KubeNode],
    workers: Mapping[str, WorkerView],
    idle_since: Mapping[tuple[str, CopyKey], float],
    metric: Mapping[CopyKey, str],
    limits: Limits,
    now: float,
) -> Plan:
    """Compose both triggers into one plan.

    - **event**: a copy gains the nodes running its training pods that are in no copy of the
      dataset, as soon as their worker is up at the coordinator; it loses the nodes the event
      trigger added once they have run none of its pods for ``release_grace_s``.
    - **metric**: ``metric[copy]`` (see :func:`metric_verdict`) adds one node
      (:func:`scale_out_node`) or removes one the metric trigger added (:func:`scale_in_node`).

    The event trigger never removes a node the metric trigger added, and the metric trigger
    never removes a node running the dataset's pods. Bounds: a copy grows to at most
    ``max_nodes`` (the metric's addition is dropped first, then the event's additions with the
    fewest pods) and shrinks to no fewer than ``max(1, min_nodes)`` nodes.
    """
    result = Plan()
    training = list(pods)
    wanted = pods_per_copy(training, copies, jobs)
    members_of = {view.key: view for views in copies.values() for view in views}

    # Nodes running training pods of known datasets need the worker label first.
    pod_nodes = {pod.node for pod in training if pod.dataset in copies}
    for name in sorted(pod_nodes):
        if not _NODE_NAME.match(name):
            result.waiting.append(f"{name}: not a valid cachefs node name; left alone")
        elif name not in kube_nodes:
            result.waiting.append(f"{name}: no such Kubernetes node (yet)")
        elif not kube_nodes[name].labeled:
            result.label.append(name)

    pods_of: dict[str, dict[str, int]] = {}  # dataset -> node -> pods of any of its copies
    for pod in training:
        per_node = pods_of.setdefault(pod.dataset, {})
        per_node[pod.node] = per_node.get(pod.node, 0) + 1

    for dataset, views in copies.items():
        in_dataset = {n for view in views for n in view.nodes}
        for view in views:
            change = _copy_change(
                view,
                in_dataset,
                wanted.get(view.key, {}),
                pods_of.get(dataset, {}),
                copies,
                kube_nodes,
                workers,
                idle_since,
                metric.get(view.key),
                limits,
                now,
                result.waiting,
            )
            if change.add or change.remove:
                result.changes.append(change)
            # A node joins at most one copy of a dataset (the API refuses an overlap), also
            # when pods of two copies land on it in the same pass.
            in_dataset |= set(change.add)

    adding = {(change.key, node) for change in result.changes for node in change.add}
    for name, node in sorted(kube_nodes.items()):
        keep = {
            key: trigger
            for key, trigger in node.added.items()
            if (key in members_of and name in members_of[key].nodes) or (key, name) in adding
        }
        if keep != dict(node.added):
            result.retag[name] = keep

    serving = {node for _, node in adding}
    for view in members_of.values():
        serving |= view.nodes | view.fill_nodes
    for name, node in sorted(kube_nodes.items()):
        if not (node.labeled and node.labeled_by_scaler):
            continue
        if name in pod_nodes or name in serving:
            continue
        result.unlabel.append(name)
    return result


def _copy_change(
    view: CopyView,
    in_dataset: set[str],
    pods_of_copy: Mapping[str, int],
    pods_of_dataset: Mapping[str, int],
    copies: Mapping[str, list[CopyView]],
    kube_nodes: Mapping[str, KubeNode],
    workers: Mapping[str, WorkerView],
    idle_since: Mapping[tuple[str, CopyKey], float],
    verdict: str | None,
    limits: Limits,
    now: float,
    waiting: list[str],
) -> CopyChange:
    where = copy_name(view.key)
    change = CopyChange(view.key)
    # Event: add nodes running the copy's pods (outside every copy of the dataset: a node in
    # another copy already reads the dataset locally, and the API refuses the overlap).
    for name in sorted(pods_of_copy, key=lambda n: (-pods_of_copy[n], n)):
        if name in in_dataset or not _NODE_NAME.match(name):
            continue
        worker = workers.get(name)
        if worker is None or not worker.up:
            waiting.append(f"{where}: {name} waits for its cachefs worker to register")
            continue
        change.add[name] = EVENT
        change.reasons[name] = f"runs {pods_of_copy[name]} training pod(s) of {where}"
    # Event: remove nodes it added whose pods are gone (after the grace period).
    for name in sorted(view.nodes):
        kube = kube_nodes.get(name)
        if kube is None or kube.added.get(view.key) != EVENT or name in pods_of_copy:
            continue
        idle_for = now - idle_since.get((name, view.key), now)
        if idle_for < limits.release_grace_s:
            waiting.append(f"{where}: {name} has no training pod; released after the grace period")
            continue
        change.remove.append(name)
        change.reasons[name] = f"runs no training pod of {where} any more"
    # Metric: one node more or one fewer.
    if verdict == SCALE_OUT:
        node = scale_out_node(
            view.key,
            copies,
            kube_nodes,
            workers,
            pods_of_dataset,
            exclude=in_dataset | set(change.add),
        )
        if node is None:
            waiting.append(
                f"{where}: used ratio high, but no labelled node with an up worker "
                "is outside the dataset's copies"
            )
        else:
            change.add[node] = METRIC
            change.metric = SCALE_OUT
            change.reasons[node] = f"{where}'s used ratio stayed above --metric-high"
    elif verdict == SCALE_IN:
        node = scale_in_node(view, kube_nodes, workers, pods_of_dataset, exclude=change.remove)
        if node is None:
            waiting.append(f"{where}: used ratio low, but no node the metric trigger added is idle")
        else:
            change.remove.append(node)
            change.metric = SCALE_IN
            change.reasons[node] = f"{where}'s used ratio stayed below --metric-low"
    _bound(change, len(view.nodes), pods_of_copy, limits, waiting)
    return change


def _bound(
    change: CopyChange,
    size: int,
    pods_of_copy: Mapping[str, int],
    limits: Limits,
    waiting: list[str],
) -> None:
    """Trim ``change`` so the copy stays within [max(1, min_nodes), max_nodes]."""
    where = copy_name(change.key)
    if limits.max_nodes is not None:
        # Most worth keeping first: the event's additions with the most pods (then by name),
        # the metric's last; the additions past the bound are dropped from the end.
        keep = sorted(
            change.add, key=lambda n: (change.add[n] == METRIC, -pods_of_copy.get(n, 0), n)
        )
        while change.add and size + len(change.add) - len(change.remove) > limits.max_nodes:
            name = keep.pop()
            if change.add.pop(name) == METRIC:
                change.metric = None
            change.reasons.pop(name, None)
            waiting.append(f"{where}: {name} not added: the copy is at --max-nodes")
    floor = max(1, limits.min_nodes)
    while change.remove and size + len(change.add) - len(change.remove) < floor:
        name = change.remove.pop()
        if change.metric == SCALE_IN:
            change.metric = None  # the metric's removal is the last one appended
        change.reasons.pop(name, None)
        waiting.append(f"{where}: {name} not removed: the copy is at --min-nodes")
