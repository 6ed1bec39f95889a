"""`cachefs stats`: a live, top-like view of a worker, or of the whole cluster.

Where the numbers come from. A worker counts what it did since it started (files and bytes
read, block reads by tier, FUSE READs answered in Python, peer and store GETs, FUSE latency
histograms: ``WorkerMetrics.activity`` in cachefs/metrics.py) and puts one sample of these
counters, stamped with its clock, in its status (the control socket) and in every heartbeat
(so the coordinator's ``/v1/nodes`` has them for each node). This view samples them every
interval and shows, per node:

- totals since the worker started, as sampled: the worker's own counters;
- rates: the counter deltas between the node's last two samples, divided by the time between
  them (the worker's own stamps). A cluster node's sample changes once per heartbeat, so its
  rates cover its last heartbeat interval;
- the share of the block reads of that interval served by each tier (and missed), and the
  p50/p90/p99 of the FUSE requests of that interval, interpolated within the histogram's
  buckets as Prometheus's ``histogram_quantile`` does;
- the preload jobs' progress (the worker's or the coordinator's status documents).

A cluster view adds a total row: counters and rates summed, ratios and percentiles over the
summed deltas. ``--once`` takes two samples one interval apart (in a cluster, it waits up to
:data:`ONCE_WAIT_S` for every live node's next heartbeat); ``--json`` prints :func:`view_of`'s
document. On a terminal the view is drawn with rich; elsewhere it is plain lines.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from cachefs.client import ControlClient, ControlError, CoordinatorClient
from cachefs.units import format_size

if TYPE_CHECKING:  # rich is imported where it draws: `cachefs stats --json` never loads it
    from rich.console import Console, Group

#: The default time between two samples, in seconds (`cachefs stats --interval`).
DEFAULT_INTERVAL_S = 1.0
#: The longest `--once` waits, in a cluster, for every live node's next heartbeat.
ONCE_WAIT_S = 30.0
#: The counters whose rate is shown: (counter, the rate's name in the JSON document, label).
RATES = (
    ("files_read", "files_per_s", "files/s"),
    ("bytes_read", "bytes_per_s", "MB/s"),
    ("python_reads", "python_reads_per_s", "python reads/s"),
    ("native_reads", "native_reads_per_s", "native reads/s"),
    ("peer_gets", "peer_gets_per_s", "peer GETs/s"),
    ("store_gets", "store_gets_per_s", "store GETs/s"),
)
#: Counters shown only when a worker reports them: reads its native FUSE fast path answered
#: without Python (a worker without that path has no such counter, and no column is shown).
OPTIONAL_COUNTERS = frozenset({"native_reads"})
#: The tiers of block reads, in the order shown ("hits_<tier>" counters; "miss": ``misses``).
TIERS = ("ram", "ssd", "recent")
PERCENTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
#: Fields of a preload job's status document that the view carries.
PRELOAD_FIELDS = (
    "id", "dataset", "state", "planned", "objects", "objects_done", "bytes", "bytes_done",
    "rate_bytes_per_s", "eta_s", "failed_count",
)  # fmt: skip
#: Preload answers meaning "no preload job for this dataset" (the worker: 404, the coordinator:
#: 404 or 409): that dataset shows no job.
_NO_PRELOAD = (404, 409)


# --- samples -------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeSample:
    """One node's counters as reported once (``WorkerMetrics.activity``)."""

    node: str
    up: bool
    sampled_at: float | None  # the worker's clock; None: it reported no counters yet
    counters: dict[str, int]
    latency_bounds: tuple[float, ...]
    latency: dict[str, tuple[int, ...]]  # FUSE op -> requests per bucket (+Inf last)

    @classmethod
    def of(cls, node: str, up: bool, activity: dict[str, Any] | None) -> NodeSample:
        if not activity:
            return cls(node, up, None, {}, (), {})
        return cls(
            node,
            up,
            activity["sampled_at"],
            dict(activity["counters"]),
            tuple(activity["fuse_latency_bounds"]),
            {op: tuple(counts) for op, counts in activity["fuse_latency"].items()},
        )


@dataclass(frozen=True)
class Sample:
    scope: str  # "worker" or "cluster"
    source: str  # what was asked, for the header
    nodes: list[NodeSample]
    preloads: list[dict[str, Any]]
    notes: list[str]  # lines shown under the tables


class Source(Protocol):
    scope: str

    def sample(self) -> Sample: ...


class WorkerSource:
    """The local worker, through its control socket."""

    scope = "worker"

    def __init__(self, client: ControlClient):
        self.client = client

    def sample(self) -> Sample:
        status = self.client.status()
        node = NodeSample.of(status["node"], bool(status["mounted"]), status.get("activity"))
        cluster = status.get("cluster")
        notes, preloads = [], []
        if cluster is None:  # a single node runs its preload jobs itself
            names = [d["name"] for d in status["datasets"]]
            preloads = _preload_jobs(self.client, names)
        else:  # a cluster's preload jobs are the coordinator's: this node's part of them
            fetched = cluster["preload"]
            if fetched["jobs"]:
                notes.append(
                    f"preload: fetching for {', '.join(fetched['jobs'])}: "
                    f"{fetched['fetched_blocks']} blocks, {format_size(fetched['fetched_bytes'])}"
                    f" fetched here, {fetched['failures']} failed (the jobs: `cachefs stats "
                    "--coordinator URL`)"
                )
        source = f"worker {status['node']} ({status['mount']})"
        return Sample(self.scope, source, [node], preloads, notes)


class ClusterSource:
    """Every node, as of its last heartbeat, and the preload jobs: from the coordinator."""

    scope = "cluster"

    def __init__(self, client: CoordinatorClient):
        self.client = client

    def sample(self) -> Sample:
        nodes = [
            NodeSample.of(doc["node"], doc["state"] == "up", doc.get("activity"))
            for doc in self.client.nodes()
        ]
        names = [d["name"] for d in self.client.datasets()]
        preloads = _preload_jobs(self.client, names)
        return Sample(self.scope, f"cluster {self.client.url}", nodes, preloads, [])


def _preload_jobs(
    client: ControlClient | CoordinatorClient, datasets: list[str]
) -> list[dict[str, Any]]:
    """The latest preload job of each dataset that has one (the fields the view shows)."""
    jobs = []
    for name in datasets:
        try:
            job = client.preload_status(name)
        except ControlError as exc:
            if exc.status in _NO_PRELOAD:
                continue
            raise
        jobs.append({field: job.get(field) for field in PRELOAD_FIELDS})
    return jobs


# --- from samples to what is shown ---------------------------------------------------------


class Tracker:
    """Keeps each node's last two distinct samples: its rates are over the time between them."""

    def __init__(self) -> None:
        self._latest: dict[str, NodeSample] = {}
        self._previous: dict[str, NodeSample] = {}

    def update(self, sample: Sample) -> None:
        for node in sample.nodes:
            latest = self._latest.get(node.node)
            if latest is not None and latest.sampled_at != node.sampled_at:
                self._previous[node.node] = latest
            self._latest[node.node] = node  # the same counters, or newer; its state is now's

    def pair(self, node: str) -> tuple[NodeSample | None, NodeSample]:
        return self._previous.get(node), self._latest[node]

    def has_rates(self, sample: Sample) -> bool:
        """Whether every live node that reports counters has two samples to compare."""
        return all(
            node.node in self._previous
            for node in sample.nodes
            if node.up and node.sampled_at is not None
        )


@dataclass
class _Deltas:
    """What happened between two samples of a node (or of several, summed)."""

    seconds: float
    counters: dict[str, float]
    latency_bounds: tuple[float, ...]
    latency: dict[str, list[int]]


def _deltas(older: NodeSample | None, newer: NodeSample) -> _Deltas | None:
    """None when there is no interval to speak of: one sample only, or the worker restarted
    (a counter went down) between the two."""
    if older is None or older.sampled_at is None or newer.sampled_at is None:
        return None
    seconds = newer.sampled_at - older.sampled_at
    counters: dict[str, float] = {
        name: n - older.counters.get(name, 0) for name, n in newer.counters.items()
    }
    if seconds <= 0 or any(n < 0 for n in counters.values()):
        return None
    latency = {}
    if older.latency_bounds == newer.latency_bounds:
        for op, counts in newer.latency.items():
            before = older.latency.get(op, (0,) * len(counts))
            latency[op] = [n - m for n, m in zip(counts, before, strict=True)]
    return _Deltas(seconds, counters, newer.latency_bounds, latency)


def percentile(bounds: tuple[float, ...], counts: list[int], q: float) -> float | None:
    """The ``q`` quantile of a histogram (``counts`` per bucket, the last one +Inf), linear
    within its bucket as Prometheus's histogram_quantile; None when it holds nothing."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    below = 0
    for index, count in enumerate(counts):
        if below + count >= rank and count:
            if index == len(bounds):  # the +Inf bucket: its lower bound is all one can say
                return bounds[-1]
            lower = bounds[index - 1] if index else 0.0
            return lower + (bounds[index] - lower) * (rank - below) / count
        below += count
    return bounds[-1]


def _latency_view(deltas: _Deltas | None) -> dict[str, dict[str, Any]]:
    if deltas is None:
        return {}
    by_op = dict(deltas.latency)
    if by_op:
        by_op["all"] = [sum(column) for column in zip(*deltas.latency.values(), strict=True)]
    view = {}
    for op, counts in sorted(by_op.items()):
        if op != "all" and not any(counts):
            continue  # an op the kernel did not send in this interval
        row: dict[str, Any] = {"requests": sum(counts)}
        row.update((name, percentile(deltas.latency_bounds, counts, q)) for name, q in PERCENTILES)
        view[op] = row
    return view


def _node_view(
    name: str, state: str, counters: dict[str, int], deltas: _Deltas | None
) -> dict[str, Any]:
    totals = {
        "files_read": counters.get("files_read", 0),
        "bytes_read": counters.get("bytes_read", 0),
        "hits": {tier: counters.get(f"hits_{tier}", 0) for tier in TIERS},
        "misses": counters.get("misses", 0),
        **{
            counter: counters.get(counter, 0)
            for counter, _, _ in RATES
            if counter not in ("files_read", "bytes_read")
            and (counter not in OPTIONAL_COUNTERS or counter in counters)
        },
    }
    rates: dict[str, float | None] = {}
    for counter, rate, _ in RATES:
        if counter in OPTIONAL_COUNTERS and counter not in counters:
            continue
        rates[rate] = None if deltas is None else deltas.counters.get(counter, 0) / deltas.seconds
    hit_ratio: dict[str, float | None] = dict.fromkeys((*TIERS, "miss"))
    if deltas is not None:
        served = {tier: deltas.counters.get(f"hits_{tier}", 0) for tier in TIERS}
        served["miss"] = deltas.counters.get("misses", 0)
        block_reads = sum(served.values())
        if block_reads:
            hit_ratio = {tier: n / block_reads for tier, n in served.items()}
    return {
        "node": name,
        "state": state,
        "interval_s": None if deltas is None else deltas.seconds,
        "totals": totals,
        "rates": rates,
        "hit_ratio": hit_ratio,
        "fuse_latency_s": _latency_view(deltas),
    }


def _summed(parts: list[_Deltas]) -> _Deltas | None:
    """Several nodes' deltas as one (their rates add up: each is over its own interval)."""
    if not parts:
        return None
    counters: dict[str, float] = {}
    latency: dict[str, list[int]] = {}
    bounds = parts[0].latency_bounds
    for part in parts:
        for name, n in part.counters.items():  # per second, so that rates add up
            counters[name] = counters.get(name, 0) + n / part.seconds
        if part.latency_bounds == bounds:
            for op, counts in part.latency.items():
                into = latency.setdefault(op, [0] * len(counts))
                latency[op] = [a + b for a, b in zip(into, counts, strict=True)]
    return _Deltas(1.0, counters, bounds, latency)


def view_of(sample: Sample, tracker: Tracker, interval_s: float) -> dict[str, Any]:
    """What is shown, as the JSON document `cachefs stats --json` prints."""
    nodes: list[dict[str, Any]] = []
    parts: list[_Deltas] = []
    summed_counters: dict[str, int] = {}
    for node in sample.nodes:
        older, newer = tracker.pair(node.node)
        deltas = _deltas(older, newer)
        state = "up" if node.up else "down"
        nodes.append(_node_view(node.node, state, newer.counters, deltas))
        if deltas is not None:
            parts.append(deltas)
        for name, n in newer.counters.items():
            summed_counters[name] = summed_counters.get(name, 0) + n
    total = _node_view("TOTAL", "", summed_counters, _summed(parts))
    if not parts:
        total["interval_s"] = None
    else:  # each node's own interval is in its row; the total's rates are per second
        total["interval_s"] = max(part.seconds for part in parts)
    return {
        "scope": sample.scope,
        "source": sample.source,
        "at": time.time(),
        "interval_s": interval_s,
        "nodes": nodes,
        "total": total,
        "preloads": sample.preloads,
        "notes": sample.notes,
    }


# --- text ------------------------------------------------------------------------------------


def _rate_text(value: float | None, counter: str) -> str:
    if value is None:
        return "-"
    if counter == "bytes_read":
        return f"{value / 1e6:.2f}"
    return f"{value:.1f}"


def _share_text(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _seconds_text(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1e-3:
        return f"{value * 1e6:.0f} µs"
    if value < 1:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s"


def _shown_rates(view: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The rate columns: every node's, the optional ones when some node reports them."""
    return [entry for entry in RATES if entry[1] in view["total"]["rates"]]


#: The request counters of the "since the start" table: (counter, label).
_REQUEST_TOTALS = (
    ("python_reads", "python reads"),
    ("native_reads", "native reads"),
    ("peer_gets", "peer GETs"),
    ("store_gets", "store GETs"),
)


def _total_counters(view: dict[str, Any], row: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) of a row's totals since the start, in the order shown: the optional
    counters when some node reports them ("-" for a node that does not)."""
    totals = row["totals"]
    shown = [("files", str(totals["files_read"])), ("bytes", format_size(totals["bytes_read"]))]
    shown += [(f"{tier} hits", str(totals["hits"][tier])) for tier in TIERS]
    shown.append(("misses", str(totals["misses"])))
    for counter, label in _REQUEST_TOTALS:
        if counter in view["total"]["totals"]:
            shown.append((label, str(totals.get(counter, "-"))))
    return shown


def _preload_text(job: dict[str, Any]) -> str:
    total, done = job["bytes"] or 0, job["bytes_done"] or 0
    fraction = done / total if total else (1.0 if job["planned"] else 0.0)
    eta = f"  ETA {job['eta_s']:.0f}s" if job.get("eta_s") is not None else ""
    return (
        f"{100 * fraction:5.1f}%  {job['objects_done']}/{job['objects']} objects  "
        f"{format_size(done)}/{format_size(total)}  "
        f"{format_size(int(job['rate_bytes_per_s'] or 0))}/s{eta}  failed {job['failed_count']}"
    )


def plain_lines(view: dict[str, Any]) -> list[str]:
    """The view as plain lines (stdout is not a terminal): one per node, the total in a
    cluster, one per preload job."""
    stamp = time.strftime("%H:%M:%S", time.localtime(view["at"]))
    rows = view["nodes"] + ([view["total"]] if view["scope"] == "cluster" else [])
    lines = []
    for row in rows:
        rates = "  ".join(
            f"{label} {_rate_text(row['rates'].get(rate), counter)}"
            for counter, rate, label in _shown_rates(view)
        )
        shares = " ".join(
            f"{tier} {_share_text(share)}" for tier, share in row["hit_ratio"].items()
        )
        latency = row["fuse_latency_s"].get("all", {})
        percentiles = " ".join(
            f"{name} {_seconds_text(latency.get(name))}" for name, _ in PERCENTILES
        )
        totals = "  ".join(f"{label} {value}" for label, value in _total_counters(view, row))
        state = f" ({row['state']})" if row["state"] == "down" else ""
        lines.append(
            f"{stamp} {row['node']}{state}  {rates}  block reads: {shares}  "
            f"fuse {percentiles}  | since start: {totals}"
        )
    for job in view["preloads"]:
        lines.append(f"{stamp} preload {job['id']} of {job['dataset']}: {job['state']}  "
                     f"{_preload_text(job)}")  # fmt: skip
    lines += [f"{stamp} {note}" for note in view["notes"]]
    return lines


def render(view: dict[str, Any]) -> Group:
    """The view as rich renderables (a terminal)."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    rows = view["nodes"]
    cluster = view["scope"] == "cluster"
    header = Text.assemble(
        ("cachefs stats", "bold"),
        f"  {view['source']}  every {view['interval_s']:g} s  "
        f"{time.strftime('%H:%M:%S', time.localtime(view['at']))}\n",
        ("rates and shares: counter deltas between the last two samples of each node"
         + ("" if not cluster else " (one per heartbeat)"), "dim"),
    )  # fmt: skip

    rates = _shown_rates(view)
    now = Table(title="last interval: rates, block reads by tier", title_justify="left")
    now.add_column("NODE")
    for _, _, label in rates:
        now.add_column(label.upper(), justify="right")
    for tier in (*TIERS, "miss"):
        now.add_column(tier.upper(), justify="right")
    for name, _ in PERCENTILES:
        now.add_column(f"FUSE {name.upper()}", justify="right")

    def add_now(row: dict[str, Any], *, end_section: bool = False) -> None:
        latency = row["fuse_latency_s"].get("all", {})
        node = row["node"] + (" (down)" if row["state"] == "down" else "")
        now.add_row(
            node,
            *(_rate_text(row["rates"].get(rate), counter) for counter, rate, _ in rates),
            *(_share_text(share) for share in row["hit_ratio"].values()),
            *(_seconds_text(latency.get(name)) for name, _ in PERCENTILES),
            end_section=end_section,
        )

    for index, row in enumerate(rows):
        add_now(row, end_section=cluster and index == len(rows) - 1)
    if cluster:
        add_now(view["total"])

    since = Table(title="since the worker started", title_justify="left")
    since.add_column("NODE")
    for label, _ in _total_counters(view, view["total"]):
        since.add_column(label.upper(), justify="right")
    for index, row in enumerate(rows):
        since.add_row(
            row["node"],
            *(value for _, value in _total_counters(view, row)),
            end_section=cluster and index == len(rows) - 1,
        )
    if cluster:
        since.add_row("TOTAL", *(value for _, value in _total_counters(view, view["total"])))

    parts: list[Any] = [header, now, since]
    latency = view["total"]["fuse_latency_s"] if cluster else rows[0]["fuse_latency_s"]
    if latency:
        ops = Table(title="last interval: FUSE requests", title_justify="left")
        for column in ("OP", "REQUESTS", *(name.upper() for name, _ in PERCENTILES)):
            ops.add_column(column, justify="left" if column == "OP" else "right")
        for op, row in latency.items():
            ops.add_row(
                op, str(row["requests"]), *(_seconds_text(row[name]) for name, _ in PERCENTILES)
            )
        parts.append(ops)
    if view["preloads"]:
        preloads = Table(title="preload", title_justify="left")
        for column in ("DATASET", "JOB", "STATE", "", "PROGRESS"):
            preloads.add_column(column)
        for job in view["preloads"]:
            total = job["bytes"] or 0
            done = job["bytes_done"] or 0
            if not total:
                total, done = 1, (1 if job["planned"] else 0)
            bar = ProgressBar(total=total, completed=done, width=24)
            preloads.add_row(job["dataset"], job["id"], job["state"], bar, _preload_text(job))
        parts.append(preloads)
    parts += [Text(note) for note in view["notes"]]
    return Group(*parts)


# --- the command -----------------------------------------------------------------------------


def _sleep_until(at: float) -> None:
    time.sleep(max(0.0, at - time.monotonic()))


def run_once(source: Source, interval_s: float) -> dict[str, Any]:
    """Two samples one interval apart (in a cluster, until every live node has reported
    again, at most :data:`ONCE_WAIT_S`): the view of the second."""
    tracker = Tracker()
    sample = source.sample()
    tracker.update(sample)
    deadline = time.monotonic() + max(ONCE_WAIT_S, interval_s)
    while True:
        _sleep_until(time.monotonic() + interval_s)
        sample = source.sample()
        tracker.update(sample)
        if tracker.has_rates(sample) or time.monotonic() >= deadline:
            return view_of(sample, tracker, interval_s)


def run(source: Source, *, interval_s: float, once: bool, json_output: bool) -> None:
    """Print the view: once, or every interval until Ctrl-C (KeyboardInterrupt, the caller's)."""
    terminal = sys.stdout.isatty() and not json_output
    if once:
        view = run_once(source, interval_s)
        if json_output:
            print(json.dumps(view, indent=2))
        elif terminal:
            _console().print(render(view))
        else:
            print("\n".join(plain_lines(view)))
        return
    tracker = Tracker()
    if terminal:
        from rich.live import Live

        with Live(console=_console(), auto_refresh=False) as live:
            for view in _views(source, tracker, interval_s):
                live.update(render(view), refresh=True)
        return
    for view in _views(source, tracker, interval_s):
        if json_output:
            print(json.dumps(view), flush=True)
        else:
            print("\n".join(plain_lines(view)), flush=True)


def _views(source: Source, tracker: Tracker, interval_s: float) -> Iterator[dict[str, Any]]:
    """A view every interval, forever (the first one has no rates yet)."""
    next_at = time.monotonic()
    while True:
        sample = source.sample()
        tracker.update(sample)
        yield view_of(sample, tracker, interval_s)
        next_at += interval_s
        if next_at < time.monotonic():  # a slow answer: the next sample now, not a burst
            next_at = time.monotonic()
        _sleep_until(next_at)


def _console() -> Console:
    from rich.console import Console

    return Console(highlight=False)
