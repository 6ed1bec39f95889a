"""The CacheScaler's I/O loop: Kubernetes list+watch and node patches through the ``kubernetes``
client, the coordinator's scale API through :class:`~cachefs.client.CoordinatorClient`; every
decision is made by :func:`coordinator.scaler.decide.plan`.

Threads (the ``kubernetes`` client blocks): one :class:`Informer` per watched collection (the
pods of each namespace, or of all; the nodes) keeps a cache of its objects, and the thread that
calls :meth:`Scaler.run` reconciles — on a relevant change, every ``resync_s`` and every metric
interval. :meth:`Scaler.stop` ends the watches (their sockets are shut) and ``run`` joins every
thread it started before it returns.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from cachefs.client import ControlError, CoordinatorClient, CoordinatorUnavailable

from .decide import (
    ADDED_KEY,
    LABELED_KEY,
    WORKER_LABEL,
    WORKER_LABEL_VALUE,
    CopyChange,
    CopyKey,
    CopyView,
    KubeNode,
    Limits,
    MetricHistory,
    Plan,
    WorkerView,
    add_sample,
    copies_of,
    copy_name,
    format_added,
    job_copies,
    kube_node,
    metric_verdict,
    plan,
    pods_per_copy,
    record_action,
    track_idle,
    training_pod,
    workers_of,
)

log = logging.getLogger("coordinator.scaler")

#: A Kubernetes object as its JSON (the client's "object" return type, no model classes).
KubeObject = dict[str, Any]

HTTP_GONE = 410


@dataclass(frozen=True)
class Settings:
    """The command line's options (``python -m coordinator.scaler --help``) and the loop's
    timings, which the tests shorten."""

    namespaces: tuple[str, ...] = ()  # the namespaces whose pods count; empty: all
    metric_high: float = 0.9
    metric_low: float = 0.5
    metric_window_s: float = 300.0
    metric_interval_s: float = 30.0
    metric_cooldown_s: float = 300.0
    min_nodes: int = 1
    max_nodes: int | None = None
    release_grace_s: float = 60.0
    resync_s: float = 10.0  # reconcile at least this often (retries of refused scale calls)
    settle_s: float = 0.2  # after a change, wait this long for more before reconciling
    watch_timeout_s: int = 300  # the API server ends each watch after this; we re-watch
    request_timeout_s: float = 60.0  # lists and patches
    backoff_s: float = 0.5  # first wait after a failed list/watch; doubles up to backoff_max_s
    backoff_max_s: float = 30.0
    dry_run: bool = False

    @property
    def limits(self) -> Limits:
        return Limits(self.min_nodes, self.max_nodes, self.release_grace_s)


def _key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    namespace = meta.get("namespace")
    return f"{namespace}/{meta.get('name')}" if namespace else str(meta.get("name"))


class Informer:
    """A list+watch cache of one Kubernetes collection (a reflector, in client-go's words).

    It lists, then watches from the list's ``resourceVersion``; a watch the server ends (its
    ``timeoutSeconds``) resumes from the last version seen; ``410 Gone`` (the version was
    compacted away) lists again; any other failure waits (exponential backoff with jitter) and
    resumes. ``relevant`` projects an object onto what the scaler reads: ``on_change`` is
    called only when that projection changes, so unrelated pod churn wakes nobody.
    """

    def __init__(
        self,
        what: str,
        list_call: Callable[..., Any],
        args: tuple[Any, ...] = (),
        *,
        relevant: Callable[[Mapping[str, Any]], object],
        on_change: Callable[[], None],
        settings: Settings,
        stopping: threading.Event,
    ):
        self.what = what
        self._list_call = list_call
        self._args = args
        self._relevant = relevant
        self._on_change = on_change
        self._settings = settings
        self._stopping = stopping
        self._lock = threading.Lock()
        self._objects: dict[str, KubeObject] = {}
        self._watch: watch.Watch | None = None
        self.synced = threading.Event()
        self.stats: Counter[str] = Counter()

    def objects(self) -> list[KubeObject]:
        with self._lock:
            return list(self._objects.values())

    def get(self, key: str) -> KubeObject | None:
        with self._lock:
            return self._objects.get(key)

    def put(self, obj: KubeObject) -> None:
        """Store an object the scaler just wrote (the watch brings the same change later)."""
        self._update(obj)

    def stop(self) -> None:
        current = self._watch
        if current is not None:
            # kubernetes ships no type information (its calls are untyped to mypy).
            current.stop()  # type: ignore[no-untyped-call]  # shuts the socket down

    def run(self) -> None:
        failures = 0
        resource_version: str | None = None
        while not self._stopping.is_set():
            try:
                if resource_version is None:
                    resource_version = self._list()
                    self.synced.set()
                started = time.monotonic()
                resource_version, events = self._watch_from(resource_version)
                if events or time.monotonic() - started >= 1.0:
                    failures = 0
                else:
                    # Ended at once with nothing (a proxy closing every stream, say): back off
                    # rather than spin re-watching.
                    failures += 1
                    self._back_off(failures, "the watch ended at once")
            except ApiException as exc:
                if self._stopping.is_set():
                    break
                if exc.status == HTTP_GONE:
                    # Our version is older than what the server keeps: only a list catches up.
                    self.stats["expired"] += 1
                    log.info(
                        "%s: resourceVersion %s is gone (410); listing again",
                        self.what,
                        resource_version,
                    )
                    resource_version = None
                    continue
                failures += 1
                self._back_off(failures, f"HTTP {exc.status} {exc.reason}")
            except Exception as exc:  # a reset connection, a timeout, a server restarting
                if self._stopping.is_set():
                    break
                failures += 1
                self._back_off(failures, f"{type(exc).__name__}: {exc}")

    def _back_off(self, failures: int, why: str) -> None:
        self.stats["errors"] += 1
        base = self._settings.backoff_s * 2 ** min(failures - 1, 16)
        delay = min(self._settings.backoff_max_s, base) * random.uniform(0.5, 1.0)
        log.warning("%s: list/watch failed (%s); retrying in %.1f s", self.what, why, delay)
        self._stopping.wait(delay)

    def _list(self) -> str:
        self.stats["lists"] += 1
        response = self._list_call(
            *self._args, _preload_content=False, _request_timeout=self._settings.request_timeout_s
        )
        try:
            body = json.loads(response.data)
        finally:
            response.release_conn()
        fresh = {_key(obj): obj for obj in body.get("items") or []}
        with self._lock:
            old, self._objects = self._objects, fresh
        changed = {
            k
            for k in old.keys() | fresh.keys()
            if self._projection(old.get(k)) != self._projection(fresh.get(k))
        }
        if changed or not self.synced.is_set():
            self._on_change()
        return str(body["metadata"]["resourceVersion"])

    def _watch_from(self, resource_version: str) -> tuple[str, int]:
        """Watch until the server ends the stream; the last version seen, and how many events
        came."""
        self.stats["watches"] += 1
        events = 0
        # "object": hand back the JSON as dicts (no model classes), resourceVersion still kept.
        # kubernetes ships no type information (its calls are untyped to mypy).
        stream = watch.Watch(return_type="object")  # type: ignore[no-untyped-call]
        self._watch = stream
        if self._stopping.is_set():  # stop() ran before this watch existed
            return resource_version, events
        try:
            for event in stream.stream(  # type: ignore[no-untyped-call]  # as Watch() above
                self._list_call,
                *self._args,
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self._settings.watch_timeout_s,
                # A read timeout past the server's own: a silently dead connection ends too.
                _request_timeout=(10, self._settings.watch_timeout_s + 30),
            ):
                events += 1
                kind, obj = event["type"], event["raw_object"]
                if kind == "ADDED" or kind == "MODIFIED":
                    self._update(obj)
                elif kind == "DELETED":
                    self._remove(obj)
                # BOOKMARK: only the version moves (the Watch keeps it).
                if stream.resource_version:
                    resource_version = stream.resource_version
                if self._stopping.is_set():
                    break
        finally:
            self._watch = None
        return resource_version, events

    def _projection(self, obj: Mapping[str, Any] | None) -> object:
        return None if obj is None else self._relevant(obj)

    def _update(self, obj: KubeObject) -> None:
        key = _key(obj)
        with self._lock:
            old = self._objects.get(key)
            self._objects[key] = obj
        if self._projection(old) != self._projection(obj):
            self._on_change()

    def _remove(self, obj: KubeObject) -> None:
        with self._lock:
            old = self._objects.pop(_key(obj), None)
        if self._projection(old) is not None:
            self._on_change()


class Scaler:
    """The CacheScaler: both triggers over one reconcile loop (see :mod:`coordinator.scaler`)."""

    def __init__(
        self,
        core: Any,  # kubernetes.client.CoreV1Api
        coordinator: CoordinatorClient,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.settings = settings
        self._core = core
        self._coordinator = coordinator
        self._clock = clock
        self._stopping = threading.Event()
        self._wake = threading.Event()

        def informer(
            what: str,
            list_call: Callable[..., Any],
            args: tuple[Any, ...],
            relevant: Callable[[Mapping[str, Any]], object],
        ) -> Informer:
            return Informer(
                what,
                list_call,
                args,
                relevant=relevant,
                on_change=self._wake.set,
                settings=settings,
                stopping=self._stopping,
            )

        if settings.namespaces:
            self.pod_informers = [
                informer(f"pods of {ns}", core.list_namespaced_pod, (ns,), training_pod)
                for ns in settings.namespaces
            ]
        else:
            self.pod_informers = [
                informer("pods", core.list_pod_for_all_namespaces, (), training_pod)
            ]
        self.node_informer = informer("nodes", core.list_node, (), kube_node)
        self._idle_since: dict[tuple[str, CopyKey], float] = {}
        self._metrics: dict[CopyKey, MetricHistory] = {}
        self._next_sample = clock()
        self._notes: set[str] = set()
        self._coordinator_error: str | None = None
        self.stats: Counter[str] = Counter()

    @property
    def informers(self) -> list[Informer]:
        return [*self.pod_informers, self.node_informer]

    def metric_history(self, key: CopyKey) -> MetricHistory | None:
        """The used-ratio samples the metric trigger holds for a copy (a copy of them)."""
        history = self._metrics.get(key)
        if history is None:
            return None
        return MetricHistory(list(history.samples), history.last_action_at)

    # --- lifecycle -----------------------------------------------------------------------------

    def run(self) -> None:
        """Reconcile until :meth:`stop`; returns once every thread it started has ended."""
        threads = [
            threading.Thread(target=informer.run, name=f"scaler {informer.what}")
            for informer in self.informers
        ]
        for thread in threads:
            thread.start()
        try:
            # Never plan from a partial view: before the first lists every node would look idle.
            while not self._stopping.is_set() and not all(
                i.synced.is_set() for i in self.informers
            ):
                self._wake.wait(1.0)
                self._wake.clear()
            while not self._stopping.is_set():
                self._wake.clear()  # before reading: a change during the pass wakes the next one
                timeout = self.settings.resync_s
                if self.reconcile_once() is not None:  # else the coordinator is down: no hurry
                    timeout = min(timeout, max(0.0, self._next_sample - self._clock()))
                if self._wake.wait(timeout):
                    # Let a burst settle (a job's pods scheduled together): one pass for all.
                    self._stopping.wait(self.settings.settle_s)
        finally:
            self.stop()
            for informer, thread in zip(self.informers, threads, strict=True):
                # A stop that lands while a watch is still connecting finds no socket to shut
                # down (the client sets it only once the response starts): stop it again.
                while thread.is_alive():
                    informer.stop()
                    thread.join(0.5)

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        for informer in self.informers:
            informer.stop()

    # --- one pass ------------------------------------------------------------------------------

    def reconcile_once(self) -> Plan | None:
        """Read both sides, plan, carry the plan out. None when the coordinator could not be
        read (the next pass tries again)."""
        now = self._clock()
        pods = [
            p for inf in self.pod_informers for obj in inf.objects() if (p := training_pod(obj))
        ]
        kube_nodes = {n.name: n for n in map(kube_node, self.node_informer.objects())}
        try:
            copies = copies_of(self._coordinator.datasets())
            workers = workers_of(self._coordinator.nodes())
            # A pod's cachefs job, when registered, says which copy it reads.
            jobs = job_copies(self._coordinator.jobs()) if pods else {}
        except (CoordinatorUnavailable, ControlError) as exc:
            self._coordinator_failed(f"cannot read the coordinator: {exc}")
            return None
        self._coordinator_error = None
        s = self.settings
        if now >= self._next_sample:
            self._sample(copies, workers, now)
            self._next_sample = now + s.metric_interval_s
        verdicts = {}
        for key, history in self._metrics.items():
            verdict = metric_verdict(
                history,
                now,
                window_s=s.metric_window_s,
                high=s.metric_high,
                low=s.metric_low,
                cooldown_s=s.metric_cooldown_s,
            )
            if verdict is not None:
                verdicts[key] = verdict
        wanted_pods = pods_per_copy(pods, copies, jobs)
        self._idle_since = track_idle(self._idle_since, kube_nodes, copies, wanted_pods, now)
        result = plan(
            pods=pods,
            copies=copies,
            jobs=jobs,
            kube_nodes=kube_nodes,
            workers=workers,
            idle_since=self._idle_since,
            metric=verdicts,
            limits=s.limits,
            now=now,
        )
        self._log_waiting(result.waiting)
        try:
            self._apply(result, now)
        except CoordinatorUnavailable as exc:
            self._coordinator_failed(f"cannot reach the coordinator: {exc}")
        self.stats["passes"] += 1
        return result

    def _sample(
        self, copies: dict[str, list[CopyView]], workers: dict[str, WorkerView], now: float
    ) -> None:
        """One used-ratio sample per copy that has a live worker (with none, the ratio is 0
        because nothing reports capacity, not because the cache is empty)."""
        seen = set()
        for views in copies.values():
            for view in views:
                if not any(workers.get(n) and workers[n].up for n in view.nodes):
                    continue
                seen.add(view.key)
                history = self._metrics.setdefault(view.key, MetricHistory())
                add_sample(history, now, view.used_ratio, self.settings.metric_window_s)
        for key in list(self._metrics):
            if key not in seen and not any(v.key == key for vs in copies.values() for v in vs):
                del self._metrics[key]  # the copy is gone

    def _apply(self, result: Plan, now: float) -> None:
        for name in result.label:
            # Before the node joins a copy: the DaemonSet needs the label to start the worker,
            # and the node joins only once that worker has registered.
            self._patch_node(
                name,
                f"label {WORKER_LABEL}={WORKER_LABEL_VALUE}",
                labels={WORKER_LABEL: WORKER_LABEL_VALUE},
                annotations={LABELED_KEY: "true"},
            )
        for name, keep in result.retag.items():
            self._patch_node(
                name, "drop stale scaler-added records", annotations={ADDED_KEY: format_added(keep)}
            )
        for change in result.changes:
            self.apply_change(change, now)
        for name in result.unlabel:
            # Last: the node is in no copy and no hand-off reads from it any more.
            self._patch_node(
                name,
                f"remove label {WORKER_LABEL}",
                labels={WORKER_LABEL: None},
                annotations={LABELED_KEY: None},
            )

    def apply_change(self, change: CopyChange, now: float) -> bool:
        """One scale call. Ownership of the added nodes is recorded on them first, so a crash
        between the two leaves a record of a node outside the copy (dropped by the next pass),
        never a node in the copy that the scaler would not know it may remove. A refusal (409
        CopyBusy: the copy is still filling; 404: a node or the dataset is not known yet; any
        other, e.g. a 409 for a node in another copy) is left for the next pass to retry."""
        dataset, copy = change.key
        where = copy_name(change.key)
        add, remove = sorted(change.add), sorted(change.remove)
        why = "; ".join(f"{n}: {r}" for n, r in sorted(change.reasons.items()))
        if self.settings.dry_run:
            log.info(
                "dry run: would scale %s: add %s, remove %s (%s)",
                where,
                add or "-",
                remove or "-",
                why,
            )
            self._acted(change, now)
            return True
        for name in add:
            node = self._current(name)
            records = dict(node.added) if node is not None else {}
            if records.get(change.key) == change.add[name]:
                continue  # recorded by an earlier attempt (refused, retried now)
            records[change.key] = change.add[name]
            if not self._patch_node(
                name,
                f"record {where}={change.add[name]}",
                annotations={ADDED_KEY: format_added(records)},
            ):
                return False
        try:
            self._coordinator.scale(dataset, copy, add=add, remove=remove)
        except ControlError as exc:
            busy = exc.status == 409 and exc.kind == "CopyBusy"
            outcome = "busy" if busy else {404: "not_found"}.get(exc.status, "refused")
            self.stats[f"scale_{outcome}"] += 1
            level = logging.WARNING if outcome == "refused" else logging.INFO
            log.log(
                level,
                "scaling %s (add %s, remove %s) refused (%s): %s; retrying later",
                where,
                add or "-",
                remove or "-",
                exc.status,
                exc,
            )
            return False
        self.stats["scaled"] += 1
        log.info("scaled %s: added %s, removed %s (%s)", where, add or "-", remove or "-", why)
        for name in remove:
            node = self._current(name)
            if node is not None and change.key in node.added:
                records = {k: v for k, v in node.added.items() if k != change.key}
                self._patch_node(
                    name, f"forget {where}", annotations={ADDED_KEY: format_added(records)}
                )
        self._acted(change, now)
        return True

    def _acted(self, change: CopyChange, now: float) -> None:
        if change.metric is not None:
            record_action(self._metrics.setdefault(change.key, MetricHistory()), now)

    # --- Kubernetes nodes ----------------------------------------------------------------------

    def _current(self, name: str) -> KubeNode | None:
        obj = self.node_informer.get(name)
        return kube_node(obj) if obj is not None else None

    def _patch_node(
        self,
        name: str,
        what: str,
        *,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> bool:
        """A merge of labels/annotations into the node (``None`` deletes a key). The client
        sends a dict body as a strategic merge patch, which for these string maps is the same
        as a JSON merge patch."""
        metadata: dict[str, Any] = {}
        if labels:
            metadata["labels"] = dict(labels)
        if annotations:
            metadata["annotations"] = dict(annotations)
        if self.settings.dry_run:
            log.info("dry run: would patch node %s: %s", name, what)
            return True
        try:
            response = self._core.patch_node(
                name,
                {"metadata": metadata},
                _preload_content=False,
                _request_timeout=self.settings.request_timeout_s,
            )
            try:
                self.node_informer.put(json.loads(response.data))
            finally:
                response.release_conn()
        except ApiException as exc:
            self.stats["patch_errors"] += 1
            log.warning("cannot patch node %s (%s): HTTP %s %s", name, what, exc.status, exc.reason)
            return False
        except Exception as exc:  # the API server unreachable: the next pass tries again
            self.stats["patch_errors"] += 1
            log.warning("cannot patch node %s (%s): %s", name, what, exc)
            return False
        self.stats["patches"] += 1
        log.info("node %s: %s", name, what)
        return True

    # --- logging -------------------------------------------------------------------------------

    def _log_waiting(self, waiting: list[str]) -> None:
        """Log each reason for waiting once, when it first appears (a pass runs every few
        seconds; the same line each time would bury everything else)."""
        for note in waiting:
            if note not in self._notes:
                log.info("waiting: %s", note)
        self._notes = set(waiting)

    def _coordinator_failed(self, message: str) -> None:
        """Warn once per outage, not once per pass."""
        self.stats["coordinator_errors"] += 1
        if self._coordinator_error is None:
            log.warning("%s; retrying every %g s", message, self.settings.resync_s)
        self._coordinator_error = message
