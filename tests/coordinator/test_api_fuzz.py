"""Schemathesis against a real coordinator process: ``python -m cachefs coordinator`` on a
free 127.0.0.1 port with its LMDB state in a temporary directory and ``CACHEFS_TOKEN`` set.

The schema is the one the live server publishes (``/openapi.json``). Every operation is fuzzed
with valid (positive) and invalid (negative) requests, bounded by Hypothesis settings; every
answer must be no server error and have a status code the spec documents. Then every /v1
operation is called without the token and must answer 401. The server's log must show no
traceback at the end."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import status_code_conformance

from tests.fakes.moto import free_port
from tests.waiting import WAIT_S

TOKEN = "fuzz-token-7c1e"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = 25  # per operation and generation mode
NO_TOKEN_EXAMPLES = 3


@dataclass
class Coordinator:
    url: str
    process: subprocess.Popen
    log: Path


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory) -> Iterator[Coordinator]:
    tmp = tmp_path_factory.mktemp("coordinator")
    url = f"http://127.0.0.1:{free_port()}"
    log = tmp / "coordinator.log"
    env = {**os.environ, "CACHEFS_TOKEN": TOKEN, "PYTHONPATH": str(REPO_ROOT)}
    command = [
        sys.executable,
        "-m",
        "cachefs",
        "--state",
        str(tmp / "state"),
        "coordinator",
        "--listen",
        url.removeprefix("http://"),
        "--heartbeat-interval",
        "0.5s",
        "--down-after",
        "2s",
    ]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            assert process.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the coordinator did not start"
            time.sleep(0.1)
        yield Coordinator(url, process, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert process.returncode == 0, log.read_text()[-5000:]


@pytest.fixture(scope="module")
def schema(coordinator: Coordinator):
    return schemathesis.openapi.from_url(f"{coordinator.url}/openapi.json")


def operations(schema) -> list:
    ops = [result.ok() for result in schema.get_all_operations()]
    labels = {f"{op.method.upper()} {op.path}" for op in ops}
    # The spec is what is fuzzed: a route missing from it would go unchecked.
    for expected in (
        "POST /v1/datasets",
        "DELETE /v1/datasets/{name}",
        "POST /v1/datasets/{name}/preload",
        "POST /v1/nodes/{node}/heartbeat",
        "GET /v1/preloads/{job_id}",
        "POST /v1/placement",
        "GET /healthz",
    ):
        assert expected in labels, sorted(labels)
    return ops


def fuzz(operation, mode: GenerationMode, examples: int, check) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case) -> None:
        check(case)

    run()


def test_fuzz_every_operation_with_the_token(schema, coordinator: Coordinator) -> None:
    started = time.monotonic()
    calls: dict[tuple[str, str], int] = {}
    statuses: dict[int, int] = {}

    def check(case) -> None:
        key = (case.operation.label, case.meta.generation.mode)
        calls[key] = calls.get(key, 0) + 1
        response = case.call_and_validate(
            headers=AUTH, checks=[not_a_server_error, status_code_conformance], timeout=30
        )
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    failures = []
    ops = operations(schema)
    for operation in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                fuzz(operation, mode, EXAMPLES, check)
            except Unsatisfiable:
                # Nothing invalid can be sent to an operation without parameters, body or auth.
                if operation.path.startswith("/v1/") or mode == GenerationMode.POSITIVE:
                    failures.append(f"{operation.label} [{mode}]: no case generated")
            except Exception as exc:  # collect them all, then fail once
                failures.append(f"{operation.label} [{mode}]: {exc}")
    assert not failures, "\n\n".join(failures)
    for operation in ops:
        assert calls.get((operation.label, GenerationMode.POSITIVE), 0) >= 1, operation.label
    # Valid requests were accepted somewhere and invalid ones refused, not just one or the other.
    assert statuses.get(200, 0) + statuses.get(201, 0) > 0, statuses
    assert statuses.get(422, 0) > 0 and statuses.get(404, 0) > 0, statuses
    assert not any(status >= 500 for status in statuses), statuses
    log = coordinator.log.read_text()
    assert "Traceback" not in log, log[-5000:]
    total = sum(calls.values())
    elapsed = time.monotonic() - started
    print(f"\n{total} requests over {len(ops)} operations in {elapsed:.1f}s: {statuses}")


def test_every_v1_operation_without_the_token_is_401(schema, coordinator: Coordinator) -> None:
    seen = []

    def check(case) -> None:
        headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
        case.headers = headers
        response = case.call(timeout=30)
        assert response.status_code == 401, (case.method, case.formatted_path, response.text)
        assert response.headers["www-authenticate"] == ["Bearer"]  # lower-cased names, lists
        seen.append(case.operation.label)

    v1 = [op for op in operations(schema) if op.path.startswith("/v1/")]
    assert len(v1) >= 17
    for operation in v1:
        fuzz(operation, GenerationMode.POSITIVE, NO_TOKEN_EXAMPLES, check)
    assert {op.label for op in v1} <= set(seen)
    # And the open routes stay open.
    for path in ("/healthz", "/metrics", "/openapi.json"):
        assert httpx.get(f"{coordinator.url}{path}", timeout=10).status_code == 200
