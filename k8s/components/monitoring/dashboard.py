"""The cachefs Grafana dashboard, written to cachefs-dashboard.json beside this file.

    .venv/bin/python k8s/components/monitoring/dashboard.py          # rewrite the JSON
    .venv/bin/python k8s/components/monitoring/dashboard.py --check  # exit 1 if it is stale

The JSON is what Grafana imports (by hand, or through the ConfigMap this component generates
for Grafana's dashboard sidecar); this file is its source, one call per panel. It imports into
any Grafana with a Prometheus data source: the data source is the `datasource` variable, and
worker panels follow the `node` and `instance` variables. `node` is the label the worker
ServiceMonitor adds (servicemonitors.yaml); a scrape configuration of your own should set it
too (or choose "All").

tests/e2e/k8s/test_dashboard.py checks that the JSON is this file's output, that it is a valid
dashboard, and that every metric an expression names is one a real worker or coordinator
exports (docs: README.md "Grafana dashboard").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DASHBOARD_JSON = Path(__file__).resolve().with_name("cachefs-dashboard.json")
UID = "cachefs"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24  # Grafana's grid

# Worker series: those of the workers chosen in the variables. Coordinator series (preloads,
# jobs, copies) follow `dataset` only: the coordinator is one target.
WORKERS = 'node=~"$node", instance=~"$instance"'
DATASETS = 'dataset=~"$dataset"'
RATE = "$__rate_interval"
TIER_HITS = 'tier=~"ram|ssd"'  # hits of a cache tier (not of the read-through buffer)
READ_OP = 'op="read"'
GET_OP = 'op="get"'


def rate(metric: str, matchers: str = "") -> str:
    """The per-second rate of a worker counter, over the chosen workers."""
    inner = f"{WORKERS}, {matchers}" if matchers else WORKERS
    return f"rate({metric}{{{inner}}}[{RATE}])"


def quantile(q: float, histogram: str, by: str, matchers: str = "") -> str:
    """The q-quantile of a worker histogram, interpolated within its buckets."""
    return f"histogram_quantile({q}, sum by (le{by}) ({rate(histogram + '_bucket', matchers)}))"


# Share of block reads served by RAM or SSD: reads from the small read-through buffer
# ("recent", the tail of a block just fetched) count as reads, not hits, as the worker's own
# hit ratio does (cachefs/metrics.py WorkerMetrics.hit_ratio).
HITS, MISSES = rate("cachefs_block_hits_total"), rate("cachefs_block_misses_total")
BLOCK_READS = f"sum({HITS}) + sum({MISSES})"
HIT_RATIO = f"sum({rate('cachefs_block_hits_total', TIER_HITS)}) / ({BLOCK_READS})"


def target(expr: str, legend: str = "", *, instant: bool = False) -> dict:
    return {"expr": expr, "legendFormat": legend, "instant": instant, "range": not instant}


class Layout:
    """Panels placed left to right, in rows, on Grafana's 24-column grid."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.x = self.y = self.row_height = 0

    def row(self, title: str) -> None:
        self._newline()
        self._add({"type": "row", "title": title, "collapsed": False, "panels": []}, GRID_WIDTH, 1)
        self._newline()

    def panel(self, kind: str, title: str, description: str, targets: list[dict], *,
              unit: str, width: int = 12, height: int = 8, **fields) -> None:  # fmt: skip
        if self.x + width > GRID_WIDTH:
            self._newline()
        for index, t in enumerate(targets):
            t.update(refId=chr(ord("A") + index), datasource=DATASOURCE)
        defaults = {"unit": unit, **fields.pop("defaults", {})}
        self._add(
            {
                "type": kind,
                "title": title,
                "description": description,
                "datasource": DATASOURCE,
                "targets": targets,
                "fieldConfig": {"defaults": defaults, "overrides": fields.pop("overrides", [])},
                "options": fields.pop("options"),
            },
            width,
            height,
        )

    def timeseries(self, title, description, targets, *, unit, stacked=False, **kw) -> None:
        custom = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 20 if stacked else 5,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if stacked else "none", "group": "A"},
        }
        options = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
        defaults = {"custom": custom, "min": 0, **kw.pop("defaults", {})}
        self.panel("timeseries", title, description, targets, unit=unit, options=options,
                   defaults=defaults, **kw)  # fmt: skip

    def stat(self, title, description, expr, *, unit, width=3, height=4, **kw) -> None:
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": "auto",
        }
        self.panel("stat", title, description, [target(expr)], unit=unit, width=width,
                   height=height, options=options, **kw)  # fmt: skip

    def bargauge(self, title, description, targets, *, unit, maximum=None, **kw) -> None:
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "displayMode": "gradient",
            "orientation": "horizontal",
            "showUnfilled": True,
            "valueMode": "color",
            "minVizHeight": 16,
            "minVizWidth": 8,
        }
        defaults = {"min": 0, **({"max": maximum} if maximum is not None else {})}
        defaults.update(kw.pop("defaults", {}))
        self.panel("bargauge", title, description, targets, unit=unit, options=options,
                   defaults=defaults, **kw)  # fmt: skip

    def _add(self, panel: dict, width: int, height: int) -> None:
        panel["id"] = len(self.panels) + 1
        panel["gridPos"] = {"h": height, "w": width, "x": self.x, "y": self.y}
        self.panels.append(panel)
        self.x += width
        self.row_height = max(self.row_height, height)

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_height
        self.x = self.row_height = 0


FILL_THRESHOLDS = {
    "thresholds": {
        "mode": "absolute",
        "steps": [
            {"color": "green", "value": None},
            {"color": "orange", "value": 0.85},
            {"color": "red", "value": 0.95},
        ],
    }
}


def dashed(last_word: str) -> list[dict]:
    """Series whose legend ends in ``last_word`` (a bound: capacity, bytes selected) drawn
    dashed and unfilled, beside the series they bound."""
    return [
        {
            "matcher": {"id": "byRegexp", "options": f".* {last_word}$"},
            "properties": [
                {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                {"id": "custom.fillOpacity", "value": 0},
            ],
        }
    ]


def panels() -> list[dict]:
    d = Layout()

    d.row("Overview")
    d.stat("Read throughput", "Bytes returned to readers through the mounts, per second.",
           f"sum({rate('cachefs_bytes_served_total')})", unit="Bps")  # fmt: skip
    d.stat("Files read", "READs at offset 0 per second: files read through the mounts.",
           f"sum({rate('cachefs_fuse_files_read_total')})", unit="suffix: files/s")  # fmt: skip
    d.stat("Hit ratio", "Share of block reads served by the RAM or SSD tier.", HIT_RATIO,
           unit="percentunit")  # fmt: skip
    d.stat("FUSE READ p99", "99th percentile of FUSE READ latency (Python-served READs).",
           quantile(0.99, "cachefs_fuse_op_seconds", "", READ_OP), unit="s")  # fmt: skip
    d.stat("Nodes up", "Nodes the coordinator hears heartbeats from.",
           'sum(cachefs_node_up{node=~"$node"})', unit="short")  # fmt: skip
    d.stat("Nodes down", "Registered nodes without a recent heartbeat.",
           'count(cachefs_node_up{node=~"$node"} == 0) or vector(0)', unit="short",
           defaults={"thresholds": {"mode": "absolute", "steps": [
               {"color": "green", "value": None}, {"color": "red", "value": 1}]}})  # fmt: skip
    d.stat("Jobs suspended", "Jobs queued because every copy of their dataset is full.",
           f'sum(cachefs_jobs{{state="suspended", {DATASETS}}})', unit="short")  # fmt: skip
    d.stat("Preloads running", "Preload jobs running now (coordinator).",
           f'sum(cachefs_preload_jobs{{state="running", {DATASETS}}})', unit="short")  # fmt: skip

    d.row("Throughput")
    d.timeseries(
        "Bytes read by source",
        "Bytes returned to readers, by where they came from: a tier (ram, ssd), the "
        "read-through buffer (recent), another node (peer) or the object store (store).",
        [target(f"sum by (source) ({rate('cachefs_bytes_served_total')})", "{{source}}")],
        unit="Bps", stacked=True,
    )  # fmt: skip
    d.timeseries(
        "Bytes read per node",
        "Bytes returned to readers through each node's mount.",
        [target(f"sum by (node) ({rate('cachefs_bytes_served_total')})", "{{node}}")],
        unit="Bps", stacked=True,
    )  # fmt: skip
    d.timeseries(
        "Files read per node",
        "READs at offset 0 per second: a file's first bytes asked for through the mount.",
        [target(f"sum by (node) ({rate('cachefs_fuse_files_read_total')})", "{{node}}")],
        unit="suffix: files/s", stacked=True,
    )  # fmt: skip
    d.timeseries(
        "FUSE READs per node",
        "FUSE READ requests answered in Python per second (reads served by the native fast "
        "path never reach the worker and are not counted).",
        [target(f"sum by (node) ({rate('cachefs_fuse_op_seconds_count', READ_OP)})",
                "{{node}}")],
        unit="reqps", stacked=True,
    )  # fmt: skip

    d.row("Hit ratio")
    d.timeseries(
        "Block reads by tier",
        "Share of block reads served by each tier and missed (read from a peer or the store). "
        "ram + ssd is the hit ratio; recent (the tail of a block just fetched) is not a hit.",
        [
            target(f"sum by (tier) ({HITS}) / scalar({BLOCK_READS})", "{{tier}}"),
            target(f"sum({MISSES}) / scalar({BLOCK_READS})", "miss"),
        ],
        unit="percentunit", stacked=True, defaults={"max": 1},
    )  # fmt: skip
    by_node_hits = rate("cachefs_block_hits_total", TIER_HITS)
    by_node_reads = (
        f"sum by (node) ({rate('cachefs_block_hits_total')}) + "
        f"sum by (node) ({rate('cachefs_block_misses_total')})"
    )
    d.timeseries(
        "Hit ratio per node",
        "Share of each node's block reads served by its RAM or SSD tier.",
        [target(f"sum by (node) ({by_node_hits}) / ({by_node_reads})", "{{node}}")],
        unit="percentunit", defaults={"max": 1},
    )  # fmt: skip

    d.row("Tiers")
    d.timeseries(
        "Tier usage vs capacity",
        "Bytes cached in each tier (solid) and the tier's capacity (dashed).",
        [
            target(f"sum by (node, tier) (cachefs_tier_used_bytes{{{WORKERS}}})",
                   "{{node}} {{tier}} used"),
            target(f"sum by (node, tier) (cachefs_tier_capacity_bytes{{{WORKERS}}})",
                   "{{node}} {{tier}} capacity"),
        ],
        unit="bytes", overrides=dashed("capacity"),
    )  # fmt: skip
    d.bargauge(
        "Tier fill",
        "Used / capacity of each tier now. A full tier with admission avoid-eviction refuses "
        "new blocks (see Admissions refused).",
        [target(f"sum by (node, tier) (cachefs_tier_used_bytes{{{WORKERS}}}) / sum by (node, "
                f"tier) (cachefs_tier_capacity_bytes{{{WORKERS}}})", "{{node}} {{tier}}",
                instant=True)],
        unit="percentunit", maximum=1, defaults=FILL_THRESHOLDS,
    )  # fmt: skip
    d.timeseries(
        "Cache used ratio per dataset copy",
        "Cache used / capacity over each copy's live nodes: the autoscaling signal of the "
        "CacheScaler and the elastic overlay's HPA (coordinator).",
        [target(f"cachefs_cache_used_ratio{{{DATASETS}}}", "{{dataset}} {{copy}}")],
        unit="percentunit", defaults={"max": 1},
    )  # fmt: skip
    d.timeseries(
        "Cached fraction per dataset",
        "Share of each dataset's bytes cached on live nodes (coordinator).",
        [target(f"cachefs_dataset_cluster_cached_fraction{{{DATASETS}}}", "{{dataset}}")],
        unit="percentunit", defaults={"max": 1},
    )  # fmt: skip
    d.timeseries(
        "Admissions, evictions, refusals",
        "Blocks admitted to a tier, evicted (admission lru), refused (full, avoid-eviction) "
        "and dropped for failing verification, per second.",
        [
            target(f"sum({rate('cachefs_admissions_total')})", "admitted"),
            target(f"sum({rate('cachefs_evictions_total')})", "evicted"),
            target(f"sum({rate('cachefs_admissions_refused_total')})", "refused"),
            target(f"sum({rate('cachefs_corrupt_blocks_total')})", "corrupt"),
        ],
        unit="ops",
    )  # fmt: skip
    d.timeseries(
        "Worker memory",
        "Resident memory of each worker process (the RAM tier's tmpfs pages are not in it).",
        [target(f"sum by (node) (cachefs_worker_rss_bytes{{{WORKERS}}})", "{{node}}")],
        unit="bytes",
    )  # fmt: skip

    d.row("Peers and object store")
    d.timeseries(
        "Store GETs by outcome",
        "Object-store GET requests per second, by outcome (ok, or the error's name).",
        [target(f"sum by (outcome) ({rate('cachefs_store_requests_total', GET_OP)})",
                "{{outcome}}")],
        unit="reqps", stacked=True,
    )  # fmt: skip
    d.timeseries(
        "Store bytes per node",
        "Bytes fetched from the object store per second.",
        [target(f"sum by (node) ({rate('cachefs_store_bytes_total')})", "{{node}}")],
        unit="Bps", stacked=True,
    )  # fmt: skip
    d.timeseries(
        "Store request latency",
        "Median and 99th percentile of object-store requests, retries included.",
        [
            target(quantile(0.5, "cachefs_store_request_seconds", ", op"), "p50 {{op}}"),
            target(quantile(0.99, "cachefs_store_request_seconds", ", op"), "p99 {{op}}"),
        ],
        unit="s",
    )  # fmt: skip
    d.timeseries(
        "Peer reads by outcome",
        "Block reads asked of other nodes per second: ok, failed (then read from the store), "
        "cooling (a peer recently failed), refused; fill_* for a copy being filled.",
        [target(f"sum by (outcome) ({rate('cachefs_peer_requests_total')})", "{{outcome}}")],
        unit="reqps", stacked=True,
    )  # fmt: skip
    d.timeseries(
        "Blocks served to peers",
        "Blocks each node served to other nodes per second.",
        [target(f"sum by (node) ({rate('cachefs_peer_blocks_served_total')})", "{{node}}")],
        unit="ops", stacked=True,
    )  # fmt: skip
    d.timeseries(
        "Fills",
        "Bytes copied into the cache by fills (a new copy, a hand-off) per second; copies "
        "being filled (coordinator).",
        [
            target(f"sum by (node) ({rate('cachefs_fill_bytes_total')})", "{{node}}"),
            target(f"sum(cachefs_copy_filling{{{DATASETS}}})", "copies filling"),
        ],
        unit="Bps",
        overrides=[{"matcher": {"id": "byName", "options": "copies filling"},
                    "properties": [{"id": "unit", "value": "short"},
                                   {"id": "custom.axisPlacement", "value": "right"}]}],
    )  # fmt: skip

    d.row("FUSE latency")
    d.timeseries(
        "FUSE READ latency",
        "Percentiles of FUSE READ requests answered in Python, interpolated within the buckets "
        "of cachefs_fuse_op_seconds.",
        [
            target(quantile(q, "cachefs_fuse_op_seconds", "", READ_OP), f"p{round(q * 100)}")
            for q in (0.5, 0.9, 0.99)
        ],
        unit="s",
    )  # fmt: skip
    d.timeseries(
        "FUSE p99 by operation",
        "99th percentile latency of each FUSE operation (lookup, getattr, open, read, ...).",
        [target(quantile(0.99, "cachefs_fuse_op_seconds", ", op"), "{{op}}")],
        unit="s",
    )  # fmt: skip
    d.timeseries(
        "FUSE READ p99 per node",
        "99th percentile of FUSE READ latency on each node.",
        [target(quantile(0.99, "cachefs_fuse_op_seconds", ", node", READ_OP), "{{node}}")],
        unit="s",
    )  # fmt: skip
    d.timeseries(
        "FUSE requests and errors",
        "FUSE requests per second by operation, and replies with an error by errno.",
        [
            target(f"sum by (op) ({rate('cachefs_fuse_op_seconds_count')})", "{{op}}"),
            target(f"sum by (errno) ({rate('cachefs_fuse_errors_total')})", "error {{errno}}"),
        ],
        unit="reqps",
    )  # fmt: skip

    d.row("Preloads")
    d.bargauge(
        "Preload progress",
        "Bytes cached and verified / bytes selected, per preload job that runs, waits or ended "
        "within the hour (coordinator).",
        [target(f"cachefs_preload_bytes_done{{{DATASETS}}} / "
                f"(cachefs_preload_bytes{{{DATASETS}}} > 0)", "{{dataset}} {{preload}}",
                instant=True)],
        unit="percentunit", maximum=1,
    )  # fmt: skip
    d.timeseries(
        "Preload bytes cached",
        "Bytes of each preload job cached and verified, and the bytes it selected (dashed).",
        [
            target(f"cachefs_preload_bytes_done{{{DATASETS}}}", "{{dataset}} {{preload}}"),
            target(f"cachefs_preload_bytes{{{DATASETS}}}", "{{dataset}} {{preload}} selected"),
        ],
        unit="bytes", overrides=dashed("selected"),
    )  # fmt: skip
    d.timeseries(
        "Preload objects",
        "Objects of each preload job cached and verified, and those it could not load.",
        [
            target(f"cachefs_preload_objects_done{{{DATASETS}}}", "{{preload}} done"),
            target(f"cachefs_preload_failed_objects{{{DATASETS}}}", "{{preload}} failed"),
        ],
        unit="short",
    )  # fmt: skip
    d.timeseries(
        "Preload jobs by state",
        "Preload jobs per state: scheduled, running, completed, failed, cancelled.",
        [target(f"sum by (state) (cachefs_preload_jobs{{{DATASETS}}})", "{{state}}")],
        unit="short", stacked=True,
    )  # fmt: skip

    d.row("Jobs")
    d.timeseries(
        "Jobs by state",
        "Registered training jobs: running on a copy, or suspended in their dataset's queue.",
        [target(f"sum by (state) (cachefs_jobs{{{DATASETS}}})", "{{state}}")],
        unit="short", stacked=True,
    )  # fmt: skip
    d.bargauge(
        "Suspended queue per dataset",
        "Jobs waiting for a slot on a copy of each dataset (its overflow policy is suspend).",
        [target(f'sum by (dataset) (cachefs_jobs{{state="suspended", {DATASETS}}})',
                "{{dataset}}", instant=True)],
        unit="short",
    )  # fmt: skip
    d.timeseries(
        "Node liveness",
        "1 while the coordinator hears a node's heartbeats.",
        [target('cachefs_node_up{node=~"$node"}', "{{node}}")],
        unit="short", defaults={"max": 1},
    )  # fmt: skip
    d.timeseries(
        "Freed by cleanup",
        "Bytes workers freed on the coordinator's request (free: a copy released; trim: "
        "shards handed off), per second.",
        [target(f"sum by (dataset, kind) (rate(cachefs_cleanup_freed_bytes_total{{{DATASETS}}}"
                f"[{RATE}]))", "{{dataset}} {{kind}}")],
        unit="Bps",
    )  # fmt: skip
    return d.panels


def variable(name: str, label: str, query: str) -> dict:
    """A multi-value variable from a label's values; "All" matches every series, also those
    without the label."""
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query,
        "refresh": 2,  # on time range change: nodes come and go
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "sort": 1,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "hide": 0,
        "regex": "",
        "options": [],
    }


def dashboard() -> dict:
    return {
        "uid": UID,
        "title": "cachefs",
        "description": "cachefs workers and coordinator: throughput, hit ratio, tiers, peers "
        "and store, FUSE latency, preloads, jobs. Source: k8s/components/monitoring/dashboard.py",
        "tags": ["cachefs"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "links": [],
        "annotations": {"list": []},
        "templating": {
            "list": [
                {
                    "type": "datasource",
                    "name": "datasource",
                    "label": "Data source",
                    "query": "prometheus",
                    "refresh": 1,
                    "regex": "",
                    "hide": 0,
                    "current": {},
                    "options": [],
                },
                variable("node", "Node", "label_values(cachefs_worker_rss_bytes, node)"),
                variable(
                    "instance",
                    "Instance",
                    'label_values(cachefs_worker_rss_bytes{node=~"$node"}, instance)',
                ),
                variable(
                    "dataset", "Dataset", "label_values(cachefs_dataset_cached_bytes, dataset)"
                ),
            ]
        },
        "panels": panels(),
    }


def dashboard_text() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the JSON is stale")
    args = parser.parse_args(argv)
    text = dashboard_text()
    if args.check:
        if DASHBOARD_JSON.read_text() != text:
            print(f"{DASHBOARD_JSON} is stale: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    DASHBOARD_JSON.write_text(text)
    print(f"wrote {DASHBOARD_JSON}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
