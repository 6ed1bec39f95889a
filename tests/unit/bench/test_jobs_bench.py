"""bench/jobs_bench.py and bench/delay_proxy.py without a cluster: the trace, the summary math
on synthetic records, the verified reader (real files), the report, and the delay proxy in
front of a small local HTTP server. No timing assertions beyond "the delay was added"; no
cachefs process started."""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy
import pytest
import xxhash

from bench.delay_proxy import (
    DelayProxy,
    build_parser,
    fetch_stats,
    pacing_chunk,
    request_kind,
    stats_delta,
    write_paced,
)
from bench.jobs_bench import (
    CONFIGS,
    BenchmarkFailure,
    DatasetFiles,
    ReaderResult,
    TraceJob,
    config_notes,
    first_copies,
    job_order,
    job_record,
    make_trace,
    parse_configs,
    peak_concurrency,
    percentile,
    ratios,
    read_share,
    render_markdown,
    summarize,
    write_results,
)

NODES = ["n1", "n2", "n3", "n4"]


# --- the trace ---------------------------------------------------------------------------------


def test_trace_is_deterministic_and_depends_on_the_seed():
    assert make_trace(10, 90.0, NODES, seed=1) == make_trace(10, 90.0, NODES, seed=1)
    assert make_trace(10, 90.0, NODES, seed=1) != make_trace(10, 90.0, NODES, seed=2)


@pytest.mark.parametrize("jobs", [1, 7, 10, 40])
def test_trace_arrivals_are_spread_over_the_span(jobs):
    span = 90.0
    trace = make_trace(jobs, span, NODES, seed=3)
    arrivals = [job.arrival_s for job in trace]
    assert arrivals == sorted(arrivals)
    slot = span / jobs
    for i, arrival in enumerate(arrivals):  # job i arrives within the i-th slot
        assert i * slot - 1e-3 <= arrival <= (i + 1) * slot + 1e-3
    assert arrivals[0] >= 0 and arrivals[-1] <= span
    if jobs >= 10:  # spread, not bunched at the start
        assert arrivals[-1] >= span * (jobs - 1) / jobs


def test_trace_jobs_have_the_hot_share_and_one_or_two_distinct_nodes():
    trace = make_trace(10, 90.0, NODES, seed=1)
    assert sum(job.dataset == "hot" for job in trace) == 7
    assert {job.dataset for job in trace} == {"hot", "cold"}
    assert len({job.id for job in trace}) == 10
    for job in trace:
        assert job.nodes_wanted in (1, 2)
        assert len(job.random_nodes) == job.nodes_wanted
        assert len(set(job.random_nodes)) == job.nodes_wanted
        assert set(job.random_nodes) <= set(NODES)
    many = make_trace(200, 10.0, NODES, seed=5)
    assert {job.nodes_wanted for job in many} == {1, 2}
    assert {n for job in many for n in job.random_nodes} == set(NODES)  # random over all nodes
    assert all(job.nodes_wanted == 1 for job in make_trace(20, 10.0, ["n1"], seed=1))


def test_trace_rejects_nothing_to_do():
    with pytest.raises(ValueError):
        make_trace(0, 10.0, NODES, seed=1)
    with pytest.raises(ValueError):
        make_trace(3, 10.0, [], seed=1)


def test_job_order_is_a_deterministic_permutation():
    job = make_trace(3, 10.0, NODES, seed=1)[0]
    order = job_order(job, 50)
    assert sorted(order) == list(range(50))
    assert order == job_order(job, 50)
    assert order != list(range(50))


def test_first_copies_split_the_nodes_in_halves():
    assert first_copies(NODES) == {"hot": ["n1", "n2"], "cold": ["n3", "n4"]}
    assert first_copies(["n1", "n2", "n3"]) == {"hot": ["n1"], "cold": ["n2", "n3"]}
    assert first_copies(["n1"]) == {"hot": ["n1"], "cold": ["n1"]}


# --- the summary -------------------------------------------------------------------------------


@pytest.mark.parametrize("q", [0.0, 0.5, 0.9, 0.95, 1.0])
def test_percentile_matches_numpy(q):
    values = [random.Random(i).uniform(0, 10) for i in range(23)]
    assert percentile(values, q) == pytest.approx(float(numpy.percentile(values, 100 * q)))
    assert percentile([], q) == 0.0
    assert percentile([4.0], q) == 4.0


def test_peak_concurrency_counts_overlaps_not_touching_intervals():
    assert peak_concurrency([]) == 0
    assert peak_concurrency([(0, 1), (1, 2), (2, 3)]) == 1
    assert peak_concurrency([(0, 5), (1, 2), (1.5, 3), (4, 6)]) == 3


def _job(i: int, dataset: str = "hot", wanted: int = 1) -> TraceJob:
    return TraceJob(f"j{i}", float(i), dataset, wanted, tuple(NODES[:wanted]), i)


def _record(i, dataset, arrival, start, finish, waits, **flags):
    readers = [ReaderResult(f"n{k + 1}", 10, 1000, w, finish - start) for k, w in enumerate(waits)]
    return job_record(
        _job(i, dataset, len(waits)),
        arrival_s=arrival,
        start_s=start,
        finish_s=finish,
        readers=readers,
        copy="A",
        cloned=flags.get("cloned", False),
        suspended=flags.get("suspended", False),
    )


def test_job_record_divides_the_data_wait_by_the_readers():
    r = _record(1, "hot", 2.0, 3.0, 7.5, [1.0, 3.0], suspended=True)
    assert r["data_wait_s"] == 2.0
    assert r["queue_wait_s"] == 1.0
    assert r["run_s"] == 4.5
    assert r["jct_s"] == 5.5
    assert r["nodes"] == ["n1", "n2"]
    assert r["files"] == 20 and r["bytes"] == 2000
    assert r["suspended"] and not r["cloned"]


def test_summarize_synthetic_records():
    records = [
        _record(1, "hot", 0.0, 0.0, 4.0, [1.0]),
        _record(2, "hot", 1.0, 3.0, 6.0, [2.0, 4.0], suspended=True),
        _record(3, "hot", 2.0, 2.0, 5.0, [5.0], cloned=True),
        _record(4, "cold", 10.0, 10.0, 12.0, [0.5]),
    ]
    s = summarize(records)
    waits = [1.0, 3.0, 5.0, 0.5]
    assert s["jobs"] == 4
    assert s["mean_data_wait_s"] == pytest.approx(sum(waits) / 4)
    assert s["p95_data_wait_s"] == pytest.approx(float(numpy.percentile(waits, 95)))
    assert s["max_data_wait_s"] == 5.0
    assert s["mean_queue_wait_s"] == pytest.approx((0 + 2 + 0 + 0) / 4)
    assert s["mean_jct_s"] == pytest.approx((4 + 5 + 3 + 2) / 4)
    assert s["mean_run_s"] == pytest.approx((4 + 3 + 3 + 2) / 4)
    assert s["makespan_s"] == 12.0
    assert (s["suspended"], s["cloned"]) == (1, 1)
    assert s["peak_running_jobs"] == {"cold": 1, "hot": 3}
    assert summarize([])["makespan_s"] == 0.0


def test_ratios_against_no_hints():
    summaries = {
        "no-hints": {
            "mean_data_wait_s": 2.0,
            "p95_data_wait_s": 4.0,
            "mean_queue_wait_s": 0.0,
            "mean_jct_s": 10.0,
            "makespan_s": 50.0,
        },
        "tdcs": {
            "mean_data_wait_s": 1.0,
            "p95_data_wait_s": 1.0,
            "mean_queue_wait_s": 0.0,
            "mean_jct_s": 8.0,
            "makespan_s": 50.0,
        },
    }
    r = ratios(summaries)
    assert r["tdcs"]["mean_data_wait_s"] == 0.5
    assert r["tdcs"]["p95_data_wait_s"] == 0.25
    assert "mean_queue_wait_s" not in r["tdcs"]  # ~0 without a coordinator: no ratio
    zero = {"no-hints": dict(summaries["no-hints"], makespan_s=0.0), "tdcs": summaries["tdcs"]}
    assert ratios(zero)["tdcs"]["makespan_s"] is None
    assert r["no-hints"]["mean_jct_s"] == 1.0
    assert ratios({"tdcs": summaries["tdcs"]})["tdcs"]["mean_jct_s"] is None


def test_parse_configs_keeps_the_report_order_and_rejects_unknown_names():
    assert parse_configs("tdcs+clone, tdcs") == ["tdcs", "tdcs+clone"]
    assert parse_configs(",".join(CONFIGS)) == list(CONFIGS)
    with pytest.raises(Exception, match="unknown"):
        parse_configs("tdcs,fifo")


def _config(**overrides) -> dict:
    config = {
        "fadvise_check": {"effective": True},
        "store": {"object_gets": 0},
        "workers": {"peer_req_ok": 10, "peer_req_fill_ok": 5},
        "summary": {"suspended": 1, "cloned": 0, "peak_running_jobs": {"hot": 3}},
    }
    return config | overrides


def test_config_notes_flag_what_contradicts_the_setup():
    assert config_notes("tdcs+suspend", _config(), 2) == []
    notes = config_notes(
        "tdcs+clone",
        _config(
            fadvise_check={"effective": False},
            store={"object_gets": 31},
            workers={"peer_req_ok": 3, "peer_req_cooling": 30, "peer_req_failed": 1},
            summary={"suspended": 0, "cloned": 0, "peak_running_jobs": {"hot": 1}},
        ),
        2,
    )
    assert len(notes) == 4
    assert "fadvise" in notes[0]
    assert "31 object GETs" in notes[1]
    assert "cooling 30, failed 1" in notes[2]
    assert "never applied" in notes[3]
    unlimited = _config(summary={"suspended": 0, "cloned": 0, "peak_running_jobs": {}})
    assert config_notes("tdcs", unlimited, 2) == []


# --- reading -----------------------------------------------------------------------------------


def _files(tmp_path, n=6):
    rng = random.Random(0)
    contents = [rng.randbytes(rng.randint(1, 300_000)) for _ in range(n)]
    keys = [f"train/c{i % 2}/f{i}.JPEG" for i in range(n)]
    for key, content in zip(keys, contents, strict=True):
        path = tmp_path / "hot" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    data = DatasetFiles(
        "hot",
        keys,
        [len(c) for c in contents],
        [xxhash.xxh3_64_intdigest(c) for c in contents],
    )
    return data, str(tmp_path / "hot")


def test_read_share_reads_and_verifies_its_files(tmp_path):
    data, root = _files(tmp_path)
    result = read_share(root, data, [4, 1, 2], 0.001, "n1")
    assert (result.node, result.files) == ("n1", 3)
    assert result.bytes == data.sizes[4] + data.sizes[1] + data.sizes[2]
    assert 0 < result.wait_s <= result.seconds
    assert result.seconds >= 3 * 0.001  # the emulated compute is not data-wait


def test_read_share_aborts_on_a_wrong_byte_or_length(tmp_path):
    data, root = _files(tmp_path)
    path = tmp_path / "hot" / data.keys[3]
    content = bytearray(path.read_bytes())
    content[len(content) // 2] ^= 1
    path.write_bytes(bytes(content))
    with pytest.raises(BenchmarkFailure, match="xxh3"):
        read_share(root, data, [0, 3], 0.0, "n1")
    path.write_bytes(bytes(content[:-1]))
    with pytest.raises(BenchmarkFailure, match="expected"):
        read_share(root, data, [3], 0.0, "n1")


def test_read_share_stops_when_aborted(tmp_path):
    data, root = _files(tmp_path)
    abort = threading.Event()
    abort.set()
    assert read_share(root, data, [0, 1], 0.0, "n1", abort).files == 0


# --- the report --------------------------------------------------------------------------------


def _results(tmp_path) -> dict:
    trace = make_trace(3, 10.0, NODES, seed=1)
    records = [
        _record(1, "hot", 0.0, 0.0, 4.0, [1.0]),
        _record(2, "cold", 1.0, 1.0, 5.0, [2.0, 1.0]),
    ]
    configs = {}
    for name, extra in (("no-hints", 0.0), ("tdcs+clone", -0.5)):
        recs = [dict(r, data_wait_s=r["data_wait_s"] + extra) for r in records]
        configs[name] = {
            "summary": summarize(recs),
            "first_copies": first_copies(NODES),
            "store": {"object_gets": 0},
            "served_bytes": {"local": 2e6, "peer": 1e6, "store": 0},
            "fill_bytes": 0,
            "copies_at_end": {
                "hot": [{"id": "A", "nodes": ["n1", "n2"]}],
                "cold": [{"id": "A", "nodes": ["n3", "n4"]}],
            },
            "cpu_busy_during": 0.8,
            "cpu_busy_before": 0.1,
            "jobs": recs,
        }
    summaries = {n: c["summary"] for n, c in configs.items()}
    return {
        "date": "2026-01-02",
        "command": "python -m bench.jobs_bench",
        "git": {"head": "abc1234", "uncommitted_changes": True},
        "machine": {"nproc": 2, "memory_bytes": 2**34, "kernel": "6.x", "python": "3.11"},
        "load_before": [0.1, 0.2, 0.3],
        "load_after": [0.4, 0.5, 0.6],
        "cluster": {"nodes": 4, "ram_per_node": "512MiB", "heartbeat_interval": "0.5s"},
        "datasets": {"hot": {"files": 10, "bytes": 10**6, "seed": 0}},
        "store": "moto behind a delay proxy",
        "trace": {
            "seed": 1,
            "jobs": 3,
            "span_s": 10.0,
            "hot_share": 0.7,
            "compute_ms_per_file": 1.0,
            "max_jobs_per_copy": 2,
            "jobs_list": [vars(job) | {"random_nodes": list(job.random_nodes)} for job in trace],
        },
        "verification": "xxh3",
        "configs": configs,
        "summary": summaries,
        "ratios_vs_no_hints": ratios(summaries),
        "notes": ["a note"],
    }


def test_markdown_puts_the_configurations_side_by_side_with_ratios(tmp_path):
    text = render_markdown(_results(tmp_path))
    assert "| | no-hints | tdcs+clone |" in text
    mean_row = next(line for line in text.splitlines() if line.startswith("| mean data-wait"))
    assert "| 1.250 | 0.750 (0.60x) |" in mean_row
    assert "### Jobs: tdcs+clone" in text
    assert "A: n1+n2 / A: n3+n4" in text
    assert "- a note" in text


def test_write_results_writes_json_and_markdown(tmp_path):
    results = _results(tmp_path)
    written = write_results(results, json_path=None, save_dir=str(tmp_path / "out"))
    assert [p.rsplit("/", 1)[1] for p in written] == ["2026-01-02.json", "2026-01-02.md"]
    assert json.loads((tmp_path / "out" / "2026-01-02.json").read_text())["date"] == "2026-01-02"
    assert (tmp_path / "out" / "2026-01-02.md").read_text().startswith("## cachefs jobs")


# --- the delay proxy ---------------------------------------------------------------------------

BLOB = random.Random(7).randbytes(700_000)


class _Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path.startswith("/bucket/blob"):
            start, _, end = (
                self.headers.get("Range", "bytes=0-").removeprefix("bytes=").partition("-")
            )
            part = BLOB[int(start) : int(end) + 1 if end else None]
            self._send(206 if self.headers.get("Range") else 200, part, {"ETag": '"e1"'})
        elif self.path.startswith("/bucket?"):
            self._send(200, b"<ListBucketResult/>", {"Content-Type": "application/xml"})
        else:
            self._send(404, b"NoSuchKey")

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(BLOB)))
        self.send_header("ETag", '"e1"')
        self.end_headers()

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self._send(200, xxhash.xxh3_64_hexdigest(body).encode(), {"X-Host": self.headers["Host"]})


@pytest.fixture
def upstream():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _request(url: str, method: str, path: str, body=None, headers=None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_request_kind_tells_object_gets_from_listings():
    assert request_kind("GET", "/bucket/hot/train/x.JPEG") == "GET object"
    assert request_kind("GET", "/bucket?list-type=2&prefix=hot/") == "GET bucket"
    assert request_kind("GET", "/bucket/") == "GET bucket"
    assert request_kind("HEAD", "/bucket/k") == "HEAD"


def test_proxy_forwards_bytes_unchanged_and_adds_the_delay(upstream):
    delay = 0.05
    with DelayProxy(upstream, delay) as proxy:
        before = proxy.stats()
        began = time.perf_counter()
        status, headers, body = _request(proxy.url, "GET", "/bucket/blob")
        elapsed = time.perf_counter() - began
        assert (status, body) == (200, BLOB)
        assert headers["ETag"] == '"e1"'
        assert elapsed >= delay
        status, _, body = _request(
            proxy.url, "GET", "/bucket/blob", headers={"Range": "bytes=10-99"}
        )
        assert (status, body) == (206, BLOB[10:100])
        status, headers, body = _request(proxy.url, "HEAD", "/bucket/blob")
        assert (status, body, headers["Content-Length"]) == (200, b"", str(len(BLOB)))
        status, headers, body = _request(proxy.url, "PUT", "/bucket/new", body=BLOB[:1234])
        assert body == xxhash.xxh3_64_hexdigest(BLOB[:1234]).encode()
        assert headers["X-Host"] == proxy.url.removeprefix("http://")  # Host passed through
        assert _request(proxy.url, "GET", "/bucket?list-type=2")[0] == 200
        assert _request(proxy.url, "GET", "/bucket/missing")[0] == 404
        stats = fetch_stats(proxy.url)  # answered by the proxy, not forwarded, not counted
        assert stats == proxy.stats()
        delta = stats_delta(before, stats)
    assert delta["object_gets"] == 3
    assert delta["requests"] == {"GET bucket": 1, "GET object": 3, "HEAD": 1, "PUT": 1}
    assert delta["bytes"]["GET object"] == len(BLOB) + 90 + len(b"NoSuchKey")
    assert delta["errors"] == 0


def test_proxy_keeps_connections_alive_and_serves_clients_in_parallel(upstream):
    with DelayProxy(upstream, 0.5) as proxy:
        host, port = proxy.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        for _ in range(2):  # two requests on one connection
            conn.request("GET", "/bucket/blob", headers={"Range": "bytes=0-9"})
            assert conn.getresponse().read() == BLOB[:10]
        conn.close()
        results = []
        threads = [
            threading.Thread(
                target=lambda: results.append(_request(proxy.url, "GET", "/bucket/blob")[2])
            )
            for _ in range(4)
        ]
        began = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - began
    assert results == [BLOB] * 4
    assert elapsed < 4 * 0.5  # the delays overlap: one thread per client


def test_proxy_answers_502_when_the_upstream_is_gone(upstream):
    with DelayProxy("http://127.0.0.1:9", 0.0) as proxy:  # nothing listens on port 9
        status, _, body = _request(proxy.url, "GET", "/bucket/blob")
        assert status == 502 and b"upstream failed" in body
        assert proxy.stats()["errors"] == 1


def test_proxy_paces_bodies_to_the_bandwidth_and_keeps_the_bytes(upstream):
    bandwidth = 2_000_000  # bytes/s: BLOB (700 kB) takes at least 0.35 s
    with DelayProxy(upstream, 0.0, bandwidth=bandwidth) as proxy:
        began = time.perf_counter()
        status, headers, body = _request(proxy.url, "GET", "/bucket/blob")
        elapsed = time.perf_counter() - began
        assert (status, body, headers["Content-Length"]) == (200, BLOB, str(len(BLOB)))
        assert elapsed >= len(BLOB) / bandwidth - 0.01  # a lower bound, not a timing target
        status, _, body = _request(
            proxy.url, "GET", "/bucket/blob", headers={"Range": "bytes=5-70004"}
        )
        assert (status, body) == (206, BLOB[5:70005])
        status, headers, body = _request(proxy.url, "HEAD", "/bucket/blob")
        assert (status, body, headers["Content-Length"]) == (200, b"", str(len(BLOB)))
        stats = fetch_stats(proxy.url)
    assert stats["config"] == {"first_byte_ms": 0.0, "bandwidth_bytes_per_s": 2_000_000.0}
    assert stats["bytes"]["GET object"] == len(BLOB) + 70_000


def test_paced_writes_keep_the_bytes_and_never_run_ahead_of_the_rate():
    now = [100.0]
    writes: list[tuple[float, bytes]] = []

    def sleep(seconds: float) -> None:
        assert seconds > 0
        now[0] += seconds

    body = random.Random(3).randbytes(50_000)
    write_paced(
        lambda part: writes.append((now[0], bytes(part))), body, 10_000, lambda: now[0], sleep
    )
    assert b"".join(part for _, part in writes) == body
    assert len(writes) > 1
    sent = 0
    for at, part in writes:  # each chunk leaves no earlier than its last byte allows
        sent += len(part)
        assert at - 100.0 >= sent / 10_000 - 1e-9
    assert writes[-1][0] - 100.0 == pytest.approx(len(body) / 10_000)
    unpaced: list[bytes] = []
    write_paced(unpaced.append, body, 0, lambda: 0.0, lambda s: pytest.fail("slept"))
    assert unpaced == [body]
    assert pacing_chunk(1) == 4096 and pacing_chunk(10**12) == 256 * 1024
    assert pacing_chunk(10_000_000) == 100_000


def test_proxy_command_line_keeps_delay_ms_and_adds_first_byte_and_bandwidth():
    parse = build_parser().parse_args
    defaults = parse(["--upstream", "http://127.0.0.1:1"])
    assert (defaults.delay_ms, defaults.bandwidth) == (20.0, 0)
    assert parse(["--upstream", "u", "--delay-ms", "5"]).delay_ms == 5.0
    assert parse(["--upstream", "u", "--first-byte-ms", "7.5"]).delay_ms == 7.5
    assert parse(["--upstream", "u", "--bandwidth", "50MiB"]).bandwidth == 50 * 2**20
    assert parse(["--upstream", "u", "--bandwidth", "12500000"]).bandwidth == 12_500_000
    with pytest.raises(SystemExit):
        parse(["--upstream", "u", "--bandwidth", "fast"])
    with pytest.raises(ValueError):
        DelayProxy("http://127.0.0.1:1", 0.0, bandwidth=-1)
