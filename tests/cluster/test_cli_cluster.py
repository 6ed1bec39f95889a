"""The cluster CLI against a real coordinator process: the generated token is found by the CLI
on the same machine, a wrong token is refused with a hint, and the client commands print what
the API says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx

from tests.cluster_process import Cluster, wait_for
from tests.fakes.moto import free_port
from tests.worker_process import REPO_ROOT


def cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cachefs", *args], env=env, capture_output=True, text=True
    )


def test_generated_token_is_found_by_the_cli_on_the_same_machine(tmp_path):
    state = str(tmp_path / "state")
    url = f"http://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("CACHEFS_TOKEN", "CACHEFS_STATE")}
    env["PYTHONPATH"] = REPO_ROOT
    coordinator = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cachefs",
            "coordinator",
            "--state",
            state,
            "--listen",
            url.removeprefix("http://"),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: httpx.get(f"{url}/healthz").status_code == 200, "coordinator")
        token_file = os.path.join(state, "token")
        assert os.stat(token_file).st_mode & 0o777 == 0o600
        assert httpx.get(f"{url}/v1/datasets").status_code == 401

        added = cli(
            "--coordinator",
            url,
            "dataset",
            "add",
            "ds",
            "s3://bucket/prefix",
            "--state",
            state,
            env=env,
        )
        assert added.returncode == 0, added.stderr
        listed = cli("dataset", "ls", "--json", "--state", state, "--coordinator", url, env=env)
        assert [d["name"] for d in json.loads(listed.stdout)] == ["ds"]

        wrong = cli("--coordinator", url, "dataset", "ls", env={**env, "CACHEFS_TOKEN": "nope"})
        assert wrong.returncode == 2
        assert "bearer token" in wrong.stderr and "CACHEFS_TOKEN" in wrong.stderr

        none = cli("preload", "status", "ds", "--state", state, "--coordinator", url, env=env)
        assert none.returncode == 2 and "no preload job" in none.stderr

        bad = cli(
            "preload", "ds", "--fraction", "1.5", "--state", state, "--coordinator", url, env=env
        )
        assert bad.returncode == 2 and "fraction" in bad.stderr

        down = cli("--coordinator", "http://127.0.0.1:1", "locality", "ds", env=env)
        assert down.returncode == 2 and "cannot reach the cachefs coordinator" in down.stderr
    finally:
        coordinator.terminate()
        coordinator.wait(timeout=15)


def test_job_scale_and_events_commands(tmp_path):
    """`cachefs dataset add` with sharing policies, `job submit/ls/show/release`, `scale` and
    `events` against a real coordinator and two real workers (jobs need live nodes)."""
    cluster = Cluster(str(tmp_path / "cluster"), 2).start()
    env = {**cluster.coordinator.env, "CACHEFS_COORDINATOR": cluster.coordinator.url}
    source = tmp_path / "source"
    (source / "d").mkdir(parents=True)
    (source / "d" / "f.bin").write_bytes(b"x" * 1000)
    try:
        added = cli(
            "dataset", "add", "ds", f"file://{source}", "--max-jobs-per-copy", "1",
            "--overflow", "suspend", "--cleanup", "ttl:6h", "--nodes", "n1", env=env,
        )  # fmt: skip
        assert added.returncode == 0, added.stderr
        assert "1 per copy, then suspend; cleanup ttl:6h" in added.stdout
        assert "copy A: n1" in added.stdout

        first = cli("job", "submit", "train-1", "--dataset", "ds", "--nodes", "2", env=env)
        assert first.returncode == 0, first.stderr
        assert first.stdout.startswith("train-1: running on n1,n2 (copy A)")
        second = cli("job", "submit", "train-2", "--dataset", "ds", env=env)
        assert second.stdout.startswith("train-2: suspended (position 1)")
        listed = json.loads(cli("job", "ls", "--json", env=env).stdout)
        assert [(j["id"], j["state"]) for j in listed] == [
            ("train-1", "running"), ("train-2", "suspended")
        ]  # fmt: skip
        table = cli("job", "ls", env=env).stdout
        assert "train-2" in table and "#1" in table

        released = cli("job", "release", "train-1", env=env)
        assert released.stdout.strip() == "train-1 released; promoted train-2"
        shown = cli("job", "show", "train-2", "--wait", env=env)
        assert shown.stdout.startswith("train-2: running on n1 (copy A)")

        scaled = cli("scale", "ds", "--copy", "A", "--add", "n2", env=env)
        assert scaled.returncode == 0, scaled.stderr
        assert "copy A of ds: n1,n2" in scaled.stdout and "handed off" in scaled.stdout
        events = cli("events", "--dataset", "ds", env=env).stdout
        assert "promoted" in events and "scaled to n1, n2" in events

        policy = cli("dataset", "set", "ds", "--max-jobs-per-copy", "0", "--json", env=env)
        assert json.loads(policy.stdout)["max_jobs_per_copy"] is None, policy.stderr

        missing = cli("job", "release", "nope", env=env)
        assert missing.returncode == 2 and "no job named 'nope'" in missing.stderr
        single = cli(
            "dataset", "add", "x", f"file://{source}", "--cleanup", "lru",
            "--state", str(tmp_path / "solo"), env={**env, "CACHEFS_COORDINATOR": ""},
        )  # fmt: skip
        assert single.returncode == 2 and "--cleanup need a coordinator" in single.stderr
    finally:
        cluster.cleanup()
