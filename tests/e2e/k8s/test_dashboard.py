"""The Grafana dashboard (k8s/components/monitoring/cachefs-dashboard.json): a valid dashboard
that imports anywhere, whose every PromQL expression is valid PromQL, reads only metrics (and
labels) that a real worker and a real coordinator export, and gets series from a real
Prometheus scraping them.

What is exported is scraped, not listed: a two-node cluster (`cachefs coordinator` and two
`cachefs worker` processes, tests/cluster_process.py) serves a file:// dataset that is
preloaded and read through a mount (blocks of the other node's shards come over the peer
protocol), with a job registered and a second dataset freed by a ttl cleanup; the workers'
/metrics are read through their control sockets, the coordinator's over HTTP. A family
without samples still has its `# TYPE` line (prometheus_client writes one for every family a
collector yields), so its name is known even without series; a test makes sure every family
the dashboard reads had samples, so that its labels are checked too. The metric and label
names an expression reads come from the small tokenizer below (tested beside it); syntax is
Prometheus's own (`promtool check rules`). Then Debian's Prometheus (scripts/setup.sh installs
it) scrapes the same cluster (workers labelled with their node, as the worker ServiceMonitor
does) and evaluates every panel's expression as Grafana sends it with "All" chosen. Doctored
copies of the dashboard, and probes sent to that Prometheus, show each check failing when it
should.

Only a live Grafana shows the panels drawn (the JSON's structure is checked here, not its
rendering), and only a live cluster shows the Prometheus Operator's relabelling at work.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import itertools
import json
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster_process import Cluster, read_all
from tests.fakes.moto import free_port
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[3]
MONITORING = ROOT / "k8s" / "components" / "monitoring"
DASHBOARD_CONFIGMAP = "cachefs-grafana-dashboard"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


builder = _load("cachefs_dashboard_builder", MONITORING / "dashboard.py")
kv = _load("cachefs_k8s_validate_for_dashboard", ROOT / "k8s" / "validate.py")


# --- PromQL: the metric and label names an expression reads -----------------------------------

# Prometheus 2.x functions and aggregation operators: a name followed by "(" must be one.
PROMQL_FUNCTIONS = frozenset(
    """abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes
    clamp clamp_max clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year
    days_in_month deg delta deriv double_exponential_smoothing end exp floor histogram_avg
    histogram_count histogram_fraction histogram_quantile histogram_stddev histogram_stdvar
    histogram_sum holt_winters hour idelta increase info irate label_join label_replace
    last_over_time ln log10 log2 mad_over_time max_over_time min_over_time minute month pi
    predict_linear present_over_time quantile_over_time rad rate resets round scalar sgn sin
    sinh sort sort_by_label sort_by_label_desc sort_desc sqrt start stddev_over_time
    stdvar_over_time sum_over_time tan tanh time timestamp vector year
    avg bottomk count count_values group limit_ratio limitk max min quantile stddev stdvar sum
    topk""".split()  # noqa: SIM905 - a word list reads best as words
)
# Words that are never metric names: binary operators, modifiers, literals.
PROMQL_KEYWORDS = frozenset(
    "and or unless atan2 bool by without on ignoring group_left group_right offset inf nan".split()  # noqa: SIM905
)
# Modifiers whose parenthesised list holds label names, not expressions.
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^{}]*)\}")
_MATCHER = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*\"\"\s*")
_TOKEN = re.compile(
    r"""(?P<duration>\d+(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*\b)
      | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
      | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
      | (?P<other>\S)""",
    re.X,
)


class PromQLError(ValueError):
    pass


def _without_strings(expr: str) -> str:
    """``expr`` with every string literal emptied: label values, label_replace's arguments and
    Grafana variables inside them ("$node") can look like names but are none."""
    return _STRING.sub('""', expr)


def promql_selectors(expr: str) -> list[tuple[str | None, set[str]]]:
    """Each ``name{matchers}`` of ``expr``: the metric name (None if only matchers) and the
    label names its matchers test."""
    found = []
    for match in _SELECTOR.finditer(_without_strings(expr)):
        labels = set()
        for matcher in filter(str.strip, match[2].split(",")):
            parsed = _MATCHER.fullmatch(matcher)
            if parsed is None:
                raise PromQLError(f"not a label matcher: {matcher.strip()!r} in {expr!r}")
            labels.add(parsed[1])
        found.append((match[1], labels))
    return found


def promql_grouping_labels(expr: str) -> set[str]:
    """The label names of ``by``/``without``/``on``/``ignoring``/``group_*`` lists."""
    text = _without_strings(expr)
    return {label.strip() for m in _GROUPING.finditer(text) for label in m[2].split(",")} - {""}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` reads: every name that is not a function or aggregation (a
    name before "("), a keyword, a label (inside {…} or a grouping list), a duration (inside
    […] or after offset) or part of a string. ``{__name__=…}`` selectors are refused: their
    name would be hidden in a string."""
    text = _without_strings(expr)
    if re.search(r"\b__name__\b", text):
        raise PromQLError(f"a __name__ matcher hides the metric name: {expr!r}")
    text = re.sub(r"\{[^{}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\[\]]*\]", " ", text)  # ranges and subqueries: durations, variables
    text = _GROUPING.sub(" ", text).replace('""', " ")  # the emptied strings
    leftover = set(text) & set('{}[]"`$')
    if leftover:
        raise PromQLError(f"{sorted(leftover)} left outside matchers and ranges: {expr!r}")
    names = set()
    for match in _TOKEN.finditer(text):
        word = match["name"]
        if word is None:
            continue
        if text[match.end() :].lstrip().startswith("("):
            if word not in PROMQL_FUNCTIONS:
                raise PromQLError(f"unknown function {word}() in {expr!r}")
        elif word.lower() not in PROMQL_KEYWORDS:
            names.add(word)
    return names


@pytest.mark.parametrize(
    "expr, names",
    [
        ("up", {"up"}),
        ('sum by (le, op) (rate(x_bucket{op="read", node=~"$node"}[$__rate_interval]))',
         {"x_bucket"}),
        ("histogram_quantile(0.99, sum(rate(a_bucket[5m])) by (le))", {"a_bucket"}),
        ('label_replace(a, "dst", "$1", "src", "cachefs_(.*)")', {"a"}),
        ("a / on (node) group_left (tier) b or vector(0)", {"a", "b"}),
        ("a offset 1h30m > bool 1e3", {"a"}),
        ("sum without (instance) (rate(a:b:c[1m:10s]))", {"a:b:c"}),
        ('count(a == 0) unless b{x!~"y"} and Inf > NaN', {"a", "b"}),
        ("sum by (le) (c_total) * 0x1F", {"c_total"}),
        ('{job="x"} + d', {"d"}),
    ],
)  # fmt: skip
def test_the_tokenizer_finds_the_metric_names(expr, names):
    assert promql_metric_names(expr) == names


@pytest.mark.parametrize(
    "read, expr, error",
    [
        (promql_metric_names, "rat(a[5m])", "unknown function rat()"),
        (promql_metric_names, '{__name__="a"}', "__name__"),
        (promql_metric_names, "rate(a[$__rate_interval]) * $scale", "left outside"),
        (promql_selectors, 'a{tier~"ram"}', "not a label matcher"),
    ],
)
def test_the_tokenizer_refuses_what_it_cannot_read(read, expr, error):
    with pytest.raises(PromQLError, match=re.escape(error)):
        read(expr)


def test_the_tokenizer_finds_selector_and_grouping_labels():
    expr = 'sum by (node, le) (rate(a_bucket{op="read",tier=~"r|s"}[5m])) / on(node) b'
    assert promql_selectors(expr) == [("a_bucket", {"op", "tier"})]
    assert promql_grouping_labels(expr) == {"node", "le"}


# --- the dashboard's expressions -------------------------------------------------------------


def panel_targets(dashboard: dict) -> list[tuple[str, str]]:
    """(where, expr) of every panel's targets."""
    return [
        (f"panel {panel['id']} {panel['title']!r} target {t['refId']}", t["expr"])
        for panel in dashboard["panels"]
        for t in panel.get("targets", [])
    ]


def variable_selectors(dashboard: dict) -> list[tuple[str, str, str]]:
    """(where, selector, label) of every ``label_values(selector, label)`` variable query
    (Grafana's, not PromQL: its selector is)."""
    found = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]["query"]
        match = re.fullmatch(r"label_values\((.+),\s*([A-Za-z_][A-Za-z0-9_]*)\)", query)
        assert match, f"variable {variable['name']}: not label_values(selector, label): {query}"
        found.append((f"variable {variable['name']}", match[1], match[2]))
    return found


def grafana_to_promql(expr: str) -> str:
    """What Grafana sends: its interval variables become durations, the others (used inside
    regex matchers) match everything, as "All" does."""
    expr = re.sub(r"\$__(rate_interval|interval|range)\b", "1m", expr)
    return re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", ".*", expr)


def promtool_problems(expressions: list[str], scratch: Path) -> str:
    """What `promtool check rules` says of ``expressions`` as recording rules ("" if they
    all parse)."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: apt-get install prometheus (scripts/setup.sh does)"
    rules = [
        {"record": f"dashboard:expression_{index}", "expr": grafana_to_promql(expr)}
        for index, expr in enumerate(expressions)
    ]
    path = scratch / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=120
    )
    return "" if done.returncode == 0 else (done.stdout + done.stderr).strip()


# --- what the code exports ---------------------------------------------------------------------


def exported_series(texts: list[str]) -> dict[str, set[str] | None]:
    """Every sample name the /metrics ``texts`` declare, with the label names seen on its
    samples (None: declared, no sample). A family counts from its ``# TYPE`` line: a histogram
    ``h`` gives ``h_bucket``, ``h_sum`` and ``h_count`` (the only names PromQL can read of
    it), any other family its own name."""
    series: dict[str, set[str] | None] = {}
    for text in texts:
        for kind_line in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.M):
            name, kind = kind_line[1], kind_line[2]
            if kind == "histogram":
                names = [f"{name}_bucket", f"{name}_sum", f"{name}_count"]
            elif kind == "summary":
                names = [name, f"{name}_sum", f"{name}_count"]
            else:
                names = [name]
            for sample_name in names:
                series.setdefault(sample_name, None)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                series[sample.name] = (series.get(sample.name) or set()) | set(sample.labels)
    return series


def scrape_labels(objects: list[dict]) -> set[str]:
    """Labels Prometheus puts on every series it scrapes (``job``, ``instance``) and those
    the ServiceMonitors add by relabelling (``node`` on the workers')."""
    added = {
        relabel["targetLabel"]
        for monitor in objects
        if monitor["kind"] == "ServiceMonitor"
        for endpoint in monitor["spec"]["endpoints"]
        for relabel in endpoint.get("relabelings", [])
        if "targetLabel" in relabel
    }
    return {"job", "instance"} | added


def metric_problems(dashboard: dict, series: dict, scrape: set[str]) -> list[str]:
    """Each metric or label an expression of ``dashboard`` reads that ``series`` (of
    :func:`exported_series`) lacks. Labels are known from samples only: a test below makes
    sure that every name the dashboard reads had some."""
    problems = []
    checks = [(where, expr, set()) for where, expr in panel_targets(dashboard)]
    checks += [
        (where, selector, {label}) for where, selector, label in variable_selectors(dashboard)
    ]
    for where, expr, extra_labels in checks:
        try:
            names = promql_metric_names(expr)
            selectors = promql_selectors(expr)
        except PromQLError as exc:
            problems.append(f"{where}: {exc}")
            continue
        for name in sorted(names - series.keys()):
            problems.append(f"{where}: no exported metric {name}")
        known = set(scrape)
        for name in names & series.keys():
            known |= (series[name] or set()) | ({"le"} if name.endswith("_bucket") else set())
        for name, labels in selectors:
            if series.get(name) is not None:
                own = series[name] | scrape | ({"le"} if name.endswith("_bucket") else set())
                for label in sorted(labels - own):
                    problems.append(f"{where}: {name} has no label {label}")
        for label in sorted((promql_grouping_labels(expr) | extra_labels) - known):
            problems.append(f"{where}: no metric it reads has the label {label}")
    return problems


# Sent to the live Prometheus beside the dashboard's: a tier no series has, and bad syntax.
EMPTY_PROBE = 'cachefs_block_hits_total{tier="floppy"}'
BROKEN_PROBE = "sum(rate(cachefs_block_hits_total[1m])"


@dataclass
class LiveCluster:
    texts: list[str]  # the /metrics of the two workers and of the coordinator
    # a dashboard expression -> the series Prometheus answered, or why it refused it
    answers: dict[str, list[dict] | str]
    probes: dict[str, list[dict] | str]  # the same for expressions that must fail


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> LiveCluster:
    """A real coordinator and two real workers after preloads, reads through a mount
    (byte-exact, some blocks from the other node), a failed lookup, a job, and a ttl cleanup
    that freed a second dataset's copy: their /metrics, and what a real Prometheus scraping
    them answers to every dashboard expression."""
    base = tmp_path_factory.mktemp("dashboard")
    source = base / "source"
    files = {f"train/{index:02d}.bin": os.urandom((1 << 20) + index) for index in range(8)}
    for path, data in files.items():
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        (source / path).write_bytes(data)
    cluster = Cluster(str(base / "cluster"), 2)
    targets = {}
    for worker in cluster.workers:  # /metrics on TCP too, for Prometheus (the last flag wins)
        host = worker.address.rsplit(":", 1)[0]
        targets[worker.node] = f"{host}:{free_port(host)}"
        worker.args += ["--metrics", targets[worker.node]]
    prometheus = None
    try:
        cluster.start()
        cluster.add_dataset("ds", f"file://{source}")
        cluster.add_dataset("old", f"file://{source}", cleanup="ttl:1s")
        assert cluster.preload("ds")["state"] == "completed"
        assert cluster.preload("old")["state"] == "completed"
        wait_for(lambda: cluster.client.dataset("old")["freed_bytes"] > 0, "ttl cleanup of old")
        cluster.client.submit_job("train-1", "ds", 1)
        reader = cluster.worker("n1")
        assert read_all(reader.mount, files) == [], "bytes differ from the source"
        # A read that misses (the preloads cached everything else): the read path's store GET,
        # which "Store GETs by outcome" shows, happens whatever the timing.
        cluster.add_dataset("cold", f"file://{source}")
        cold_path = reader.path("cold", "train/00.bin")
        wait_for(lambda: os.path.exists(cold_path), "the cold dataset on n1's mount")
        with open(cold_path, "rb") as cold:
            assert cold.read() == files["train/00.bin"]
        with pytest.raises(FileNotFoundError):  # an error reply, for cachefs_fuse_errors
            os.stat(reader.path("ds", "missing"))
        texts = [worker.client.metrics() for worker in cluster.workers]
        texts.append(httpx.get(f"{cluster.coordinator.url}/metrics", timeout=30).text)
        coordinator = cluster.coordinator.url.removeprefix("http://")
        prometheus = PrometheusProcess(base / "prometheus", targets, coordinator).start()
        dashboard = json.loads(builder.DASHBOARD_JSON.read_text())
        answers = prometheus.answers([expr for _, expr in panel_targets(dashboard)])
        probes = {}
        for probe in (EMPTY_PROBE, BROKEN_PROBE):
            try:
                probes[probe] = prometheus.query(probe)
            except PromQLRefused as refused:
                probes[probe] = str(refused)
    finally:
        if prometheus is not None:
            prometheus.stop()
        cluster.cleanup()
    return LiveCluster(texts, answers, probes)


class PromQLRefused(RuntimeError):
    pass


class PrometheusProcess:
    """A real Prometheus (Debian's, scripts/setup.sh installs it) scraping the workers every
    second, each target labelled with its node as the worker ServiceMonitor does, and the
    coordinator."""

    def __init__(self, base: Path, workers: dict[str, str], coordinator: str):
        self.base = base
        self.address = f"127.0.0.1:{free_port()}"
        scrape = {"scrape_interval": "1s", "scrape_timeout": "1s"}
        self.config = {
            "global": scrape,
            "scrape_configs": [
                {
                    "job_name": "cachefs-worker",
                    "static_configs": [
                        {"targets": [target], "labels": {"node": node}}
                        for node, target in workers.items()
                    ],
                },
                {"job_name": "cachefs-coordinator", "static_configs": [{"targets": [coordinator]}]},
            ],
        }
        self.targets = len(workers) + 1
        self.proc: subprocess.Popen | None = None

    def start(self) -> PrometheusProcess:
        binary = shutil.which("prometheus")
        assert binary, "prometheus is missing: apt-get install prometheus (scripts/setup.sh does)"
        self.base.mkdir(parents=True)
        config = self.base / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config))
        log = open(self.base / "prometheus.log", "wb")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={self.base / 'data'}",
             f"--web.listen-address={self.address}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        wait_for(self._ready, "prometheus ready")
        # Every target scraped successfully twice at least (a rate needs two samples): until then
        # an answer could hold some nodes' series and not the others'.
        scraped_twice = 'sum_over_time(up{job=~"cachefs-.*"}[1m]) >= 2'
        wait_for(lambda: len(self.query(scraped_twice)) == self.targets, "two scrapes of each")
        return self

    def _ready(self) -> bool:
        assert self.proc.poll() is None, (self.base / "prometheus.log").read_text()[-3000:]
        return httpx.get(f"http://{self.address}/-/ready", timeout=5).status_code == 200

    def query(self, expr: str) -> list[dict]:
        """The instant vector ``expr`` gives now (Grafana's variables as "All" sends them)."""
        answer = httpx.get(
            f"http://{self.address}/api/v1/query",
            params={"query": grafana_to_promql(expr)},
            timeout=30,
        ).json()
        if answer["status"] != "success":
            raise PromQLRefused(f"{answer['errorType']}: {answer['error']}")
        return answer["data"]["result"]

    def answers(self, expressions: list[str]) -> dict[str, list[dict] | str]:
        """Each expression's series, once every one has some (rates need two scrapes of a
        counter), or as they stand after the suite's bound on waits; a refusal's message."""
        answers: dict[str, list[dict] | str] = {}

        def every_panel_has_series() -> bool:
            for expr in expressions:
                if not answers.get(expr):
                    try:
                        answers[expr] = self.query(expr)
                    except PromQLRefused as refused:
                        answers[expr] = str(refused)
            return all(answers.values())

        with contextlib.suppress(AssertionError):
            wait_for(every_panel_has_series, "series for every dashboard expression")
        return answers

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def scraped(live) -> list[str]:
    return live.texts


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {target: kv.render(target) for target in kv.TARGETS}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(builder.DASHBOARD_JSON.read_text())


# --- tests: the metrics -----------------------------------------------------------------------


def test_every_expression_reads_metrics_and_labels_the_code_exports(dashboard, scraped, rendered):
    series = exported_series(scraped)
    assert "cachefs_fuse_op_seconds_bucket" in series and "cachefs_jobs" in series  # both sides
    scrape = scrape_labels(rendered["overlays/production"])
    assert "node" in scrape  # the worker ServiceMonitor's relabelling: the node variable's label
    assert metric_problems(dashboard, series, scrape) == []


def test_every_family_the_dashboard_reads_had_samples(dashboard, scraped):
    """The label checks above cover every series the dashboard reads: none is bare."""
    series = exported_series(scraped)
    read = set().union(*(promql_metric_names(expr) for _, expr in panel_targets(dashboard)))
    assert {name for name in read if series.get(name) is None} == set()


def test_a_real_prometheus_answers_every_panel_with_series(dashboard, live):
    """Every expression, sent as Grafana sends it with "All" chosen, evaluates on Prometheus's
    own engine to at least one series over what it scraped from the cluster."""
    empty = [
        f"{where}: {live.answers[expr] or 'no series'}"
        for where, expr in panel_targets(dashboard)
        if isinstance(live.answers[expr], str) or not live.answers[expr]
    ]
    assert empty == []
    # What the check above looks for does happen: a query can come back empty, or refused.
    assert live.probes[EMPTY_PROBE] == []
    assert "parse error" in live.probes[BROKEN_PROBE]


def values(live: LiveCluster, dashboard: dict, title: str) -> list[float]:
    """The values Prometheus gave the queries of the panel titled ``title``."""
    (panel,) = [p for p in dashboard["panels"] if p["title"] == title and p["type"] != "row"]
    return [
        float(series["value"][1]) for t in panel["targets"] for series in live.answers[t["expr"]]
    ]


def test_the_panels_show_what_the_cluster_did(dashboard, live):
    assert values(live, dashboard, "Nodes up") == [2]
    assert values(live, dashboard, "Nodes down") == [0]
    assert values(live, dashboard, "Jobs suspended") == [0]
    assert sum(values(live, dashboard, "Jobs by state")) == 1  # train-1, running
    assert values(live, dashboard, "Preload progress") == [1.0, 1.0]  # ds and old, completed
    capacity = sum(values(live, dashboard, "Tier usage vs capacity"))
    assert capacity >= 2 * (256 << 20)  # two RAM tiers of 256 MiB, plus what they hold
    for panel in dashboard["panels"]:  # shares stay shares
        if panel.get("fieldConfig", {}).get("defaults", {}).get("unit") == "percentunit":
            for value in values(live, dashboard, panel["title"]):
                assert math.isnan(value) or 0 <= value <= 1, (panel["title"], value)


def test_the_metric_check_catches(dashboard, scraped, rendered):
    series = exported_series(scraped)
    scrape = scrape_labels(rendered["overlays/production"])
    breakages = {
        "a misspelled metric": (
            lambda expr: expr.replace("cachefs_block_hits_total", "cachefs_block_hit_total"),
            "no exported metric cachefs_block_hit_total",
        ),
        "a histogram suffix on a gauge": (
            lambda expr: expr.replace("cachefs_jobs{", "cachefs_jobs_count{"),
            "no exported metric cachefs_jobs_count",
        ),
        "a histogram read by its family name": (
            lambda expr: expr.replace("cachefs_fuse_op_seconds_bucket", "cachefs_fuse_op_seconds"),
            "no exported metric cachefs_fuse_op_seconds",
        ),
        "a counter without _total": (
            lambda expr: expr.replace("cachefs_bytes_served_total", "cachefs_bytes_served"),
            "no exported metric cachefs_bytes_served",
        ),
        "a misspelled matcher label": (
            lambda expr: expr.replace('tier=~"ram|ssd"', 'tiers=~"ram|ssd"'),
            "cachefs_block_hits_total has no label tiers",
        ),
        "a grouping label no metric has": (
            lambda expr: expr.replace("by (outcome)", "by (outcomes)"),
            "no metric it reads has the label outcomes",
        ),
        "an unknown function": (
            lambda expr: expr.replace("histogram_quantile(", "histogram_quantil("),
            "unknown function histogram_quantil()",
        ),
    }
    for what, (doctor, message) in breakages.items():
        broken = copy.deepcopy(dashboard)
        changed = 0
        for panel in broken["panels"]:
            for t in panel.get("targets", []):
                changed += doctor(t["expr"]) != t["expr"]
                t["expr"] = doctor(t["expr"])
        assert changed, f"{what}: the doctoring changed nothing"
        problems = metric_problems(broken, series, scrape)
        assert any(message in p for p in problems), (what, problems)
    broken = copy.deepcopy(dashboard)
    (node,) = [v for v in broken["templating"]["list"] if v["name"] == "node"]
    node["query"]["query"] = "label_values(cachefs_worker_rss_byte, node)"
    assert metric_problems(broken, series, scrape) == [
        "variable node: no exported metric cachefs_worker_rss_byte"
    ]


def test_every_expression_is_valid_promql(dashboard, tmp_path):
    expressions = [expr for _, expr in panel_targets(dashboard)]
    expressions += [selector for _, selector, _ in variable_selectors(dashboard)]
    assert promtool_problems(expressions, tmp_path) == ""
    assert "parse error" in promtool_problems(["sum(rate(a[5m])"], tmp_path)  # it does check


def test_the_dashboard_covers_what_operators_watch(dashboard):
    """Throughput, hit ratio, tier usage vs capacity, peer and store traffic, FUSE latency
    percentiles, preload progress, jobs and the suspended queue."""
    exprs = " ".join(expr for _, expr in panel_targets(dashboard))
    for needle in (
        "cachefs_fuse_files_read_total",
        "cachefs_bytes_served_total",
        "cachefs_block_hits_total",
        "cachefs_block_misses_total",
        "cachefs_tier_used_bytes",
        "cachefs_tier_capacity_bytes",
        "cachefs_peer_requests_total",
        "cachefs_store_requests_total",
        "histogram_quantile(0.99, sum by (le) (rate(cachefs_fuse_op_seconds_bucket",
        "cachefs_preload_bytes_done",
        'cachefs_jobs{state="suspended"',
    ):
        assert needle in exprs, needle


# --- tests: the dashboard ---------------------------------------------------------------------


def check_dashboard(dashboard: dict) -> None:
    """What Grafana needs to import it anywhere: identity, a Prometheus datasource variable
    that every panel and query uses, the node/instance variables, a grid without overlaps."""
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dashboard["uid"]), "uid"
    assert dashboard["title"] and dashboard.get("id") is None, "title, no id"
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    datasource = variables.get("datasource")
    assert datasource and datasource["type"] == "datasource", "no datasource variable"
    assert datasource["query"] == "prometheus", "the datasource variable lists Prometheus"
    for name in ("node", "instance"):
        assert name in variables, f"no {name} variable"
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*", name
    reference = {"type": "prometheus", "uid": "${datasource}"}
    for where, value in _datasources(dashboard):
        assert value == reference, f"{where}: datasource {value}, not the variable"
    ids, titles, cells = set(), set(), {}
    for panel in dashboard["panels"]:
        where = f"panel {panel.get('id')} {panel.get('title')!r}"
        assert isinstance(panel["id"], int) and panel["id"] not in ids, f"{where}: id"
        ids.add(panel["id"])
        assert panel["title"] and panel["type"] in {"row", "timeseries", "stat", "bargauge"}
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in "xywh"), f"{where}: gridPos"
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["h"] > 0, f"{where}: gridPos"
        assert grid["x"] + grid["w"] <= builder.GRID_WIDTH, f"{where}: wider than the grid"
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{where} overlaps {cells[(x, y)]}"
                cells[(x, y)] = where
        if panel["type"] == "row":
            continue
        assert panel["title"] not in titles, f"{where}: a second panel of that title"
        titles.add(panel["title"])
        targets = panel["targets"]
        assert targets, f"{where}: no query"
        assert len({t["refId"] for t in targets}) == len(targets), f"{where}: refIds"
        for t in targets:
            assert t["expr"].strip(), f"{where}: empty expression"
            used = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", t["expr"]))
            unknown = {v for v in used if not v.startswith("__")} - variables.keys()
            assert not unknown, f"{where}: undefined variables {unknown}"
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    assert rows and dashboard["panels"][0]["type"] == "row"
    for row, after in itertools.pairwise([*dashboard["panels"], {"type": "row"}]):
        assert not (row["type"] == "row" and after["type"] == "row"), f"empty row {row['title']}"


def _datasources(node, where="dashboard"):
    """(where, value) of every "datasource" key, but the datasource variable's own query."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                yield where, value
            else:
                yield from _datasources(value, f"{where}.{key}")
    elif isinstance(node, list):
        for index, item in enumerate(node):
            yield from _datasources(item, f"{where}[{index}]")


def test_the_dashboard_is_valid_and_imports_anywhere(dashboard):
    check_dashboard(dashboard)


def test_the_json_is_the_builders_output():
    """cachefs-dashboard.json is written by dashboard.py; edit that, then run it."""
    assert builder.DASHBOARD_JSON.read_text() == builder.dashboard_text()
    assert builder.main(["--check"]) == 0


@pytest.mark.parametrize(
    "breakage",
    ["no datasource variable", "a fixed datasource", "overlapping panels", "no node variable",
     "too wide", "a duplicate id", "an undefined variable", "no uid"],
)  # fmt: skip
def test_the_dashboard_check_catches(dashboard, breakage):
    broken = copy.deepcopy(dashboard)
    panels, variables = broken["panels"], broken["templating"]["list"]
    if breakage == "no datasource variable":
        variables[:] = [v for v in variables if v["name"] != "datasource"]
    elif breakage == "a fixed datasource":
        panels[3]["targets"][0]["datasource"] = {"type": "prometheus", "uid": "P1809F7CD0C75ACF3"}
    elif breakage == "overlapping panels":
        panels[2]["gridPos"] = dict(panels[1]["gridPos"], x=panels[1]["gridPos"]["x"] + 1)
    elif breakage == "no node variable":
        variables[:] = [v for v in variables if v["name"] != "node"]
    elif breakage == "too wide":
        panels[1]["gridPos"]["w"] = builder.GRID_WIDTH + 1
    elif breakage == "a duplicate id":
        panels[2]["id"] = panels[1]["id"]
    elif breakage == "an undefined variable":
        panels[1]["targets"][0]["expr"] = panels[1]["targets"][0]["expr"].replace("$node", "$nodes")
    elif breakage == "no uid":
        broken["uid"] = ""
    with pytest.raises(AssertionError):
        check_dashboard(broken)


# --- tests: the ConfigMap for Grafana's sidecar -------------------------------------------------


@pytest.mark.parametrize("target", ("overlays/production", "overlays/elastic"))
def test_overlays_with_monitoring_ship_the_dashboard_to_grafanas_sidecar(rendered, target):
    maps = [
        o
        for o in rendered[target]
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == DASHBOARD_CONFIGMAP
    ]
    assert len(maps) == 1, f"{target}: {len(maps)} dashboard ConfigMaps"
    (configmap,) = maps
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "cachefs"
    (text,) = configmap["data"].values()
    assert json.loads(text) == json.loads(builder.DASHBOARD_JSON.read_text())
    # `kubectl apply` keeps the whole object in an annotation, which must stay under 256 KiB.
    assert len(text.encode()) < 200_000


def test_trees_without_monitoring_ship_no_dashboard(rendered):
    for target in ("base", "overlays/dev"):
        names = {o["metadata"]["name"] for o in rendered[target] if o["kind"] == "ConfigMap"}
        assert DASHBOARD_CONFIGMAP not in names, target
