"""Cheap in-process counters and histograms, exported in Prometheus text format.

The FUSE hot path runs ~100k operations per second on one core, so instrumentation must cost
well under a microsecond: plain integer attributes and a bisect into fixed buckets, no locks (the
trio loop is single-threaded; counters touched from worker threads are only ever incremented
under the GIL by one thread at a time per field, which is good enough for monitoring).
prometheus_client is used only at scrape time, through a custom collector.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

# Seconds; spans 10 µs (a page-cache-cold FUSE getattr) to 30 s (a store retry budget).
LATENCY_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


class Histogram:
    __slots__ = ("bounds", "bucket_counts", "count", "total")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS):
        self.bounds = bounds
        self.bucket_counts = [0] * (len(bounds) + 1)  # last = +Inf
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.bucket_counts[bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.total += value

    def prometheus_buckets(self) -> list[tuple[str, float]]:
        cumulative = 0
        out: list[tuple[str, float]] = []
        for bound, n in zip((*self.bounds, float("inf")), self.bucket_counts, strict=True):
            cumulative += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        return out


class LabeledHistograms:
    """One Histogram per label value, created on first use."""

    def __init__(self) -> None:
        self.by_label: dict[str, Histogram] = {}

    def get(self, label: str) -> Histogram:
        hist = self.by_label.get(label)
        if hist is None:
            hist = self.by_label[label] = Histogram()
        return hist


class WorkerMetrics:
    """Every number the worker exports. Fields are bumped directly by the code that knows."""

    def __init__(self) -> None:
        # read path, counted per block request
        self.hits = {"ram": 0, "ssd": 0, "recent": 0}
        self.misses = 0
        self.bytes_served = {"ram": 0, "ssd": 0, "recent": 0, "peer": 0, "store": 0}
        self.fetch_coalesced = 0
        self.readahead_blocks = 0  # blocks fetched ahead of sequential readers
        # object store
        self.store_requests: dict[tuple[str, str], int] = {}  # (op, outcome) -> count
        # The preload's GETs (its fetcher processes), by outcome: the worker points this at
        # the preloader's counters; they count in cachefs_store_requests too.
        self.preload_gets: Callable[[], dict[str, int]] = dict
        self.store_latency = LabeledHistograms()  # op -> seconds (including retries)
        self.store_bytes = 0
        # Block GETs of reads that the GET loop's thread completed (cachefs/fs/blocks.py); the
        # others ran on threads of their own.
        self.store_gets_in_loop = 0
        # Adaptive store concurrency per purpose ("read", "preload"): a function returning the
        # limit's report (cachefs/store/concurrency.py: limit, peak, in_flight, throttled, ...)
        self.store_concurrency: dict[str, Callable[[], dict[str, int]]] = {}
        # peers: blocks this node asked other nodes for, by outcome ("ok", "failed" — then the
        # store was read instead —, "cooling", "refused"), and blocks it served to them
        # ("fill_ok", "fill_refused", … : cached-only requests to the fill source of a block
        # this node owns while its copy is being filled)
        self.peer_requests: dict[str, int] = {}
        self.peer_served = 0
        self.peer_serve_errors = 0
        # background fills: blocks tried, by outcome, and bytes copied into the cache
        self.fill_blocks = {"copied": 0, "absent": 0, "failed": 0}
        self.fill_bytes = 0
        # cleanup tasks: bytes freed per (dataset, task kind)
        self.freed_bytes: dict[tuple[str, str], int] = {}
        # FUSE
        self.fuse_latency = LabeledHistograms()  # op -> seconds
        self.fuse_errors: dict[str, int] = {}  # errno name -> count
        # READs at offset 0: a file's first bytes asked for through the mount (files/s)
        self.files_read = 0
        # The native READ path's counters (cachefs_fast_read.h: reads, first_reads, bytes,
        # fallbacks, vanished, corrupt, blocks, ...); the worker points this at its table.
        self.native_reads: Callable[[], dict[str, int]] = dict
        # The serving processes of --fuse-processes (cachefs/fs/serving.py, stats()); the mount
        # points this at them when there are any.
        self.serving: Callable[[], dict[str, Any]] = dict

    def store_request(self, op: str, outcome: str, seconds: float) -> None:
        key = (op, outcome)
        self.store_requests[key] = self.store_requests.get(key, 0) + 1
        self.store_latency.get(op).observe(seconds)

    def store_request_counts(self) -> dict[tuple[str, str], int]:
        """Object-store requests by (op, outcome): the read path's and the preload's."""
        counts = dict(self.store_requests)
        for outcome, n in self.preload_gets().items():
            counts[("get", outcome)] = counts.get(("get", outcome), 0) + n
        return counts

    def cache_freed(self, dataset: str, kind: str, nbytes: int) -> None:
        key = (dataset, kind)
        self.freed_bytes[key] = self.freed_bytes.get(key, 0) + nbytes

    def peer_request(self, outcome: str) -> None:
        self.peer_requests[outcome] = self.peer_requests.get(outcome, 0) + 1

    def peer_request_counts(self) -> dict[str, int]:
        """Block reads asked of other nodes by outcome: the Python client's, and as
        ``native_ok`` the READs the native path sent to their owners and answered (a READ it
        handed back is asked again by the Python client, and counted there)."""
        counts = dict(self.peer_requests)
        native_ok = self.native_reads().get("peer_reads", 0)
        if native_ok:
            counts["native_ok"] = native_ok
        return counts

    def served_hits(self) -> dict[str, int]:
        """Block reads served per tier (``hits``) with the native path's READs counted as RAM
        hits: they read RAM-tier blocks, only not in Python."""
        hits = dict(self.hits)
        hits["ram"] += self.native_reads().get("reads", 0)
        return hits

    def served_bytes(self) -> dict[str, int]:
        """Bytes returned to readers per source (``bytes_served``), the native path's in "ram"."""
        served = dict(self.bytes_served)
        native = self.native_reads()
        served["ram"] += native.get("bytes", 0)
        served["peer"] = served.get("peer", 0) + native.get("peer_read_bytes", 0)
        return served

    def activity(self) -> dict[str, Any]:
        """The counters `cachefs stats` shows (cachefs/stats.py), sampled now and stamped with
        this machine's clock: in the worker's status and in every heartbeat, so the coordinator
        shows them for the whole cluster. Totals since the start only: readers compute rates
        from the deltas between two samples. A counter added here is shown by name; the native
        fast path's reads go in as ``native_reads``."""
        native = self.native_reads()
        counters = {
            "files_read": self.files_read + native.get("first_reads", 0),
            "bytes_read": sum(self.served_bytes().values()),
            **{f"hits_{tier}": n for tier, n in self.served_hits().items()},
            "misses": self.misses,
            "python_reads": self.fuse_latency.get("read").count,  # FUSE READs served here
            "peer_gets": sum(self.peer_request_counts().values()),
            "store_gets": sum(
                n for (op, _), n in self.store_request_counts().items() if op == "get"
            ),
        }
        if native:  # only while the native path serves (`cachefs stats` shows it then)
            counters["native_reads"] = native.get("reads", 0)
        return {
            "sampled_at": time.time(),
            "counters": counters,
            "fuse_latency_bounds": list(LATENCY_BUCKETS),
            "fuse_latency": {
                op: list(hist.bucket_counts)
                for op, hist in sorted(self.fuse_latency.by_label.items())
            },
        }

    def hit_ratio(self) -> float | None:
        """Share of block reads served by a cache tier. Reads served from the small
        read-through buffer ("recent") count as requests but not as hits: they are the tail of a
        block that was just fetched, not the cache working."""
        hits = self.served_hits()
        tier_hits = hits["ram"] + hits["ssd"]
        total = sum(hits.values()) + self.misses
        return tier_hits / total if total else None


class _WorkerCollector(Collector):
    def __init__(self, metrics: WorkerMetrics, extra: Callable[[], Iterable[Metric]]):
        self._metrics = metrics
        self._extra = extra

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        hits = CounterMetricFamily(
            "cachefs_block_hits", "Block reads served from the cache", labels=["tier"]
        )
        for tier, n in m.served_hits().items():
            hits.add_metric([tier], n)
        yield hits
        yield CounterMetricFamily(
            "cachefs_block_misses", "Block reads that went to the store", value=m.misses
        )
        served = CounterMetricFamily(
            "cachefs_bytes_served", "Bytes returned to readers", labels=["source"]
        )
        for source, n in m.served_bytes().items():
            served.add_metric([source], n)
        yield served
        yield CounterMetricFamily(
            "cachefs_fetch_coalesced",
            "Block misses that joined an in-flight fetch",
            value=m.fetch_coalesced,
        )
        yield CounterMetricFamily(
            "cachefs_readahead_blocks",
            "Blocks fetched ahead of sequential readers",
            value=m.readahead_blocks,
        )
        requests = CounterMetricFamily(
            "cachefs_store_requests", "Object-store requests", labels=["op", "outcome"]
        )
        for (op, outcome), n in sorted(m.store_request_counts().items()):
            requests.add_metric([op, outcome], n)
        yield requests
        yield CounterMetricFamily(
            "cachefs_store_bytes", "Bytes fetched from the object store", value=m.store_bytes
        )
        concurrency = {purpose: report() for purpose, report in m.store_concurrency.items()}
        yield gauge(
            "cachefs_store_concurrency",
            "Object-store requests allowed in flight now (adaptive: AIMD on throttling answers)",
            ["purpose"],
            [([purpose], r["limit"]) for purpose, r in sorted(concurrency.items())],
        )
        yield gauge(
            "cachefs_store_in_flight",
            "Object-store requests in flight now",
            ["purpose"],
            [([purpose], r["in_flight"]) for purpose, r in sorted(concurrency.items())],
        )
        yield labelled_counter(
            "cachefs_store_throttled",
            "Store requests answered 'slow down' (503, 429, SlowDown) on some try",
            ["purpose"],
            [([purpose], r["throttled"]) for purpose, r in sorted(concurrency.items())],
        )
        peers = CounterMetricFamily(
            "cachefs_peer_requests", "Block reads asked of other nodes", labels=["outcome"]
        )
        for outcome, n in sorted(m.peer_request_counts().items()):
            peers.add_metric([outcome], n)
        yield peers
        yield CounterMetricFamily(
            "cachefs_peer_blocks_served", "Blocks served to other nodes", value=m.peer_served
        )
        fills = CounterMetricFamily(
            "cachefs_fill_blocks",
            "Blocks a fill tried to copy from the nodes that held them",
            labels=["outcome"],
        )
        for outcome, n in m.fill_blocks.items():
            fills.add_metric([outcome], n)
        yield fills
        yield CounterMetricFamily(
            "cachefs_fill_bytes", "Bytes copied into the cache by fills", value=m.fill_bytes
        )
        freed = CounterMetricFamily(
            "cachefs_cache_freed_bytes",
            "Bytes freed by cleanup tasks (free: a copy released; trim: shards handed off)",
            labels=["dataset", "kind"],
        )
        for (dataset, kind), n in sorted(m.freed_bytes.items()):
            freed.add_metric([dataset, kind], n)
        yield freed
        yield _histogram_family(
            "cachefs_store_request_seconds", "Object-store request latency", "op", m.store_latency
        )
        yield _histogram_family(
            "cachefs_fuse_op_seconds", "FUSE operation latency", "op", m.fuse_latency
        )
        errors = CounterMetricFamily(
            "cachefs_fuse_errors", "FUSE replies with an error", labels=["errno"]
        )
        for name, n in sorted(m.fuse_errors.items()):
            errors.add_metric([name], n)
        yield errors
        native = m.native_reads()
        yield CounterMetricFamily(
            "cachefs_fuse_files_read",
            "FUSE READs at offset 0 (a file's first bytes asked for)",
            value=m.files_read + native.get("first_reads", 0),
        )
        yield CounterMetricFamily(
            "cachefs_fuse_fast_reads",
            "FUSE READs answered natively (in C, from RAM-tier blocks) instead of in Python",
            value=native.get("reads", 0),
        )
        yield CounterMetricFamily(
            "cachefs_fuse_fast_read_bytes",
            "Bytes returned by natively answered READs",
            value=native.get("bytes", 0),
        )
        yield CounterMetricFamily(
            "cachefs_fuse_fast_read_fallbacks",
            "READs of a natively served file handed to Python (a block not in the table)",
            value=native.get("fallbacks", 0),
        )
        yield CounterMetricFamily(
            "cachefs_fuse_fast_lookups",
            "FUSE LOOKUPs answered natively from remembered replies instead of in Python",
            value=native.get("lookups", 0),
        )
        dropped = CounterMetricFamily(
            "cachefs_fuse_fast_read_dropped",
            "Blocks the native path dropped from its table on a READ (the READ went to Python)",
            labels=["reason"],
        )
        for reason in ("vanished", "corrupt"):
            dropped.add_metric([reason], native.get(reason, 0))
        yield dropped
        yield GaugeMetricFamily(
            "cachefs_fuse_fast_read_blocks",
            "Blocks the native READ path can serve now",
            value=native.get("blocks", 0),
        )
        yield GaugeMetricFamily(
            "cachefs_fuse_fast_read_open_files",
            "Block files the native READ path holds open now (bounded; closed before removal)",
            value=native.get("open_files", 0),
        )
        serving = m.serving()
        yield GaugeMetricFamily(
            "cachefs_fuse_processes",
            "Processes reading the mount's FUSE connection now: the worker and its serving "
            "processes (--fuse-processes)",
            value=1 + len(serving.get("pids", ())),
        )
        yield CounterMetricFamily(
            "cachefs_fuse_serving_process_deaths",
            "Serving processes that ended while the mount was served (each replaced)",
            value=serving.get("deaths", 0),
        )
        yield CounterMetricFamily(
            "cachefs_fuse_fast_reads_by_serving_processes",
            "FUSE READs the serving processes answered natively; also counted in "
            "cachefs_fuse_fast_reads",
            value=native.get("serving_reads", 0),
        )
        yield GaugeMetricFamily(
            "cachefs_fuse_serving_peer_connections",
            "Connections to other workers the serving processes send READs on now (the worker "
            "opens and hands them over)",
            value=serving.get("peer_connections", 0),
        )
        forwarded = CounterMetricFamily(
            "cachefs_fuse_forwarded_requests",
            "FUSE requests a serving process read and handed to the worker, by operation",
            labels=["op"],
        )
        for op, count in sorted(serving.get("forwarded", {}).items()):
            forwarded.add_metric([op], count)
        yield forwarded
        yield CounterMetricFamily(
            "cachefs_peer_fast_answers",
            "Peer block requests answered natively (in C, from the native READ table) "
            "instead of in Python; also counted in cachefs_peer_blocks_served",
            value=native.get("peer_answers", 0),
        )
        yield CounterMetricFamily(
            "cachefs_fuse_fast_reads_spliced",
            "READs answered natively by splicing chunks checked before from their block file "
            "(--fuse-passthrough: no copy through the worker)",
            value=native.get("spliced", 0),
        )
        yield CounterMetricFamily(
            "cachefs_fuse_passthrough_opens",
            "FUSE OPENs answered with the file's block file handed to the kernel "
            "(--fuse-passthrough: the kernel reads it, no READ reaches the worker)",
            value=native.get("pt_opens", 0),
        )
        yield GaugeMetricFamily(
            "cachefs_fuse_passthrough_backing_files",
            "Backing files registered with the kernel now (passthrough)",
            value=native.get("backing_files", 0),
        )
        yield CounterMetricFamily(
            "cachefs_fuse_loop_returns",
            "Times the FUSE session loop went back to trio (requests per return: "
            "cachefs_fuse_loop_requests_total / this)",
            value=native.get("batches", 0),
        )
        yield CounterMetricFamily(
            "cachefs_fuse_loop_requests",
            "Requests the FUSE session loop took from /dev/fuse",
            value=native.get("batched", 0),
        )
        yield CounterMetricFamily(
            "cachefs_fuse_loop_unwaited_requests",
            "Requests a FUSE session task read at once, already queued, without waiting for "
            "/dev/fuse through trio",
            value=native.get("unwaited", 0),
        )
        yield from self._extra()


def _histogram_family(
    name: str, doc: str, label: str, hists: LabeledHistograms
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=[label])
    for value, hist in sorted(hists.by_label.items()):
        family.add_metric([value], hist.prometheus_buckets(), sum_value=hist.total)
    return family


def make_registry(
    metrics: WorkerMetrics, extra: Callable[[], Iterable[Metric]] = lambda: ()
) -> CollectorRegistry:
    """A registry exporting ``metrics`` plus whatever ``extra()`` yields (gauges from the cache)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_WorkerCollector(metrics, extra))
    return registry


def gauge(
    name: str, doc: str, labels: list[str], rows: Iterable[tuple[list[str], float]]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=labels)
    for label_values, value in rows:
        family.add_metric(label_values, value)
    return family


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def labelled_counter(
    name: str, doc: str, labels: list[str], rows: Iterable[tuple[list[str], float]]
) -> CounterMetricFamily:
    """A counter per label value (exported as ``<name>_total``): what only ever grows is a
    counter, so that ``rate()`` handles the worker's restarts."""
    family = CounterMetricFamily(name, doc, labels=labels)
    for label_values, value in rows:
        family.add_metric(label_values, value)
    return family
