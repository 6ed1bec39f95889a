"""Schemathesis against a real coordinator process (`cachefs coordinator` on a free 127.0.0.1
port, its LMDB state in a temporary directory, ``CACHEFS_TOKEN`` set): the spec the server
publishes (``/openapi.json``) is the contract, and the server must keep it.

The main test runs ``schemathesis run`` as CI would: every check (server errors, status codes,
response schemas, content types and headers, positive data accepted, negative data refused,
``Allow`` on 405, auth, created resources found, …), the coverage, fuzzing and stateful phases,
a bounded number of examples per operation and a time budget for the whole run. Three nodes
stay up by sending heartbeats over the API (the protocol a worker speaks: the coordinator's
contract needs no real worker), so jobs, scaling and placement reach their logic rather than
"no live nodes"; likewise one dataset is there for the whole run (the hooks keep the fuzzer
from deleting it), so jobs find a dataset whenever they are sent. Then every /v1 operation is
called without the token and must answer 401. The server's log must show no traceback at the
end, and the server must exit cleanly."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.cluster_process import TOKEN, CoordinatorProcess

AUTH = {"Authorization": f"Bearer {TOKEN}"}
HOOKS = Path(__file__).with_name("schemathesis_hooks.py")
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")  # the venv's CLI
MAX_EXAMPLES = 25  # per operation, each round of the fuzzing phase
# The whole run's budget: the fuzzing and stateful phases repeat until it is spent, so the test
# takes about this long on any machine (a loaded one covers less).
MAX_TIME_S = 300
SEED = 15  # a failure can be replayed (the report prints `st replay` commands)
NO_TOKEN_EXAMPLES = 3
LIVE_NODES = ("n1", "n2", "n3")
# Registered before the run and kept by the hooks (jobs name it: the spec's examples do).
DATASET = "imagenet"
# Operations some of whose valid requests must be served (answered 2xx) in the run.
SERVED = {
    "POST /v1/datasets": re.compile(r"/v1/datasets"),
    "POST /v1/jobs": re.compile(r"/v1/jobs"),
    "POST /v1/nodes/{node}/heartbeat": re.compile(r"/v1/nodes/[^/]+/heartbeat"),
}


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory) -> Iterator[CoordinatorProcess]:
    # Nodes are down after 30 s without a heartbeat: the keep-alive below is never late.
    process = CoordinatorProcess(
        str(tmp_path_factory.mktemp("fuzz")), extra_args=("--down-after", "30s")
    ).start()
    stop = threading.Event()
    keep_alive = threading.Thread(target=_beat, args=(process.url, stop), daemon=True)
    try:
        with httpx.Client(base_url=process.url, headers=AUTH, timeout=30) as admin:
            dataset = {"name": DATASET, "uri": f"s3://bucket/{DATASET}/"}
            assert admin.post("/v1/datasets", json=dataset).status_code == 201
        keep_alive.start()
        yield process
        stop.set()
        keep_alive.join(timeout=60)
        assert not keep_alive.is_alive()
        assert "Traceback" not in Path(process.log_path).read_text(), process.log()
        process.proc.send_signal(signal.SIGTERM)
        assert process.proc.wait(timeout=60) == 0, process.log()
    finally:
        stop.set()
        process.stop()


def _beat(url: str, stop: threading.Event) -> None:
    """Heartbeats of LIVE_NODES, as their workers would send them, until ``stop``."""
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
        while not stop.is_set():
            for i, node in enumerate(LIVE_NODES, 2):
                report = {
                    "address": f"127.0.0.{i}:7070",
                    "gpus": 8,
                    "tiers": [{"name": "ram", "capacity": 1 << 30, "used": 0}],
                }
                try:
                    client.post(f"/v1/nodes/{node}/heartbeat", json=report)
                except httpx.TransportError:
                    pass  # a slow or refused beat: the next one, a second later, is sent anyway
            stop.wait(1.0)


def test_schemathesis_finds_no_contract_failure(coordinator, tmp_path) -> None:
    assert SCHEMATHESIS.exists(), f"{SCHEMATHESIS}: pip install -e '.[dev]'"
    reports = tmp_path / "reports"
    command = [
        str(SCHEMATHESIS), "run", f"{coordinator.url}/openapi.json",
        "--header", f"Authorization: Bearer {TOKEN}",
        "--checks", "all",
        "--max-examples", str(MAX_EXAMPLES),
        "--max-time", str(MAX_TIME_S),
        "--seed", str(SEED),
        "--workers", "1",
        # Far above any answer's time (long-polls are cut to 1 s by the hooks), so that a slow,
        # loaded machine is no "network error".
        "--request-timeout", "120",
        "--no-color",
        "--report", "json,har",
        "--report-dir", str(reports),
    ]  # fmt: skip
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS), "CACHEFS_FUZZ_KEPT_DATASET": DATASET}
    # In tmp_path: schemathesis keeps a cache of earlier crashes (.schemathesis/) where it runs,
    # and replays them; every run here starts clean, and nothing is written into the checkout.
    # The timeout bounds a hung run, it is no timing check: the run itself stops at MAX_TIME_S.
    run = subprocess.run(
        command,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=MAX_TIME_S + 600,
    )
    output = run.stdout[-20_000:] + run.stderr[-5_000:]
    (report_path,) = reports.glob("json-*.json")
    report = json.loads(report_path.read_text())
    (har_path,) = reports.glob("har-*.json")
    print(output[-3_000:])
    assert report["failures"] == [] and report["errors"] == [], output
    assert run.returncode == 0, output
    # Every operation was tested, in every phase, with cases generated and checked.
    operations = report["operations"]
    assert operations["tested"] == operations["total"] >= 30, operations
    phases = {name: phase["status"] for name, phase in report["phases"].items()}
    assert phases["coverage"] == phases["fuzzing"] == phases["stateful"] == "success", phases
    assert report["test_cases"]["generated"] >= 10 * operations["total"], report["test_cases"]
    # The fuzzer got past validation: valid requests were served, not only refused. Counted
    # over every request of the run (the HAR report): the report's ``valid_rates`` hold only
    # the last scenario of each operation and phase, and on a loaded machine the time budget
    # may cut that one to a single request.
    served = _served(har_path)
    for label in SERVED:
        assert served[label] > 0, (label, served)


def _served(har_path: Path) -> Counter[str]:
    """How many requests of each :data:`SERVED` operation the run's HAR shows answered 2xx."""
    served: Counter[str] = Counter()
    for entry in json.loads(har_path.read_text())["log"]["entries"]:
        request, status = entry["request"], entry["response"]["status"]
        path = urlsplit(request["url"]).path
        for label, pattern in SERVED.items():
            method = label.split(" ", 1)[0]
            if request["method"] == method and pattern.fullmatch(path) and 200 <= status < 300:
                served[label] += 1
    return served


def test_every_v1_operation_without_the_token_is_401(coordinator) -> None:
    schema = schemathesis.openapi.from_url(f"{coordinator.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    v1 = [op for op in operations if op.path.startswith("/v1/")]
    # The spec is what is fuzzed: a route missing from it would go unchecked.
    labels = {op.label for op in v1}
    for expected in (
        "POST /v1/datasets",
        "DELETE /v1/datasets/{name}",
        "POST /v1/datasets/{name}/preload",
        "POST /v1/nodes/{node}/heartbeat",
        "GET /v1/preloads/{job_id}",
        "POST /v1/placement",
        "POST /v1/schedule",
    ):
        assert expected in labels, sorted(labels)
    assert len(v1) >= 17
    seen = []

    def check(case) -> None:
        headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
        case.headers = headers
        response = case.call(timeout=30)
        assert response.status_code == 401, (case.method, case.formatted_path, response.text)
        assert response.headers["www-authenticate"] == ["Bearer"]  # lower-cased names, lists
        seen.append(case.operation.label)

    for operation in v1:

        @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
        @settings(
            max_examples=NO_TOKEN_EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def run(case) -> None:
            check(case)

        run()
    assert labels <= set(seen)
    # And the open routes stay open.
    for path in ("/healthz", "/metrics", "/openapi.json", "/docs", "/redoc"):
        assert httpx.get(f"{coordinator.url}{path}", timeout=30).status_code == 200
