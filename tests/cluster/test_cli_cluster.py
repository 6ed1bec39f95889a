"""The cluster CLI against a real coordinator process: the generated token is found by the CLI
on the same machine, a wrong token is refused with a hint, and the client commands print what
the API says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx

from tests.cluster_process import wait_for
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
