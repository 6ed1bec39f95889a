"""The cluster CLI against a real coordinator process: the generated token is found by the CLI
on the same machine, a wrong token is refused with a hint, and the client commands print what
the API says."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid

import httpx

from tests.cluster_process import Cluster, wait_for
from tests.fakes.moto import free_port
from tests.waiting import WAIT_S
from tests.worker_process import REPO_ROOT


def cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cachefs", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )


def refusal(result: subprocess.CompletedProcess) -> str:
    """The line a refused command printed: exit status 1 and exactly one line on stderr."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


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
    source = tmp_path / "source"
    source.mkdir()
    (source / "f.bin").write_bytes(b"f")
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
            f"file://{source}",
            "--state",
            state,
            env=env,
        )
        assert added.returncode == 0, added.stderr
        listed = cli("dataset", "ls", "--json", "--state", state, "--coordinator", url, env=env)
        assert [d["name"] for d in json.loads(listed.stdout)] == ["ds"]

        wrong = cli("--coordinator", url, "dataset", "ls", env={**env, "CACHEFS_TOKEN": "nope"})
        assert refusal(wrong) == (
            "cachefs: error: missing or wrong bearer token (pass --token-file or set CACHEFS_TOKEN)"
        )

        none = cli("preload", "status", "ds", "--state", state, "--coordinator", url, env=env)
        assert "no preload job" in refusal(none)

        down = cli("--coordinator", "http://127.0.0.1:1", "locality", "ds", env=env)
        assert "cannot reach the cachefs coordinator" in refusal(down)
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
        assert "no job named 'nope'" in refusal(missing)
        single = cli(
            "dataset", "add", "x", f"file://{source}", "--cleanup", "lru",
            "--state", str(tmp_path / "solo"), env={**env, "CACHEFS_COORDINATOR": ""},
        )  # fmt: skip
        assert "--cleanup need a coordinator" in refusal(single)
    finally:
        cluster.cleanup()


def test_refused_requests_are_one_line_and_add_nothing(tmp_path, moto_s3):
    """Against a real coordinator and worker: a mistyped prefix is refused before the
    coordinator accepts the dataset (unless --allow-empty), and values the API's schema
    refuses come back as one line naming the option and the value, never a pydantic dump."""
    bucket = f"cli-{uuid.uuid4().hex[:12]}"
    moto_s3.make_bucket(bucket)
    moto_s3.put(bucket, "imagenet/train/a.jpg", b"a" * 3000)
    cluster = Cluster(str(tmp_path / "cluster"), 1, env=moto_s3.env).start()
    env = {**cluster.coordinator.env, "CACHEFS_COORDINATOR": cluster.coordinator.url}
    endpoint = ("--endpoint", moto_s3.endpoint)
    typo, right = f"s3://{bucket}/imagnet", f"s3://{bucket}/imagenet"
    try:
        assert refusal(cli("dataset", "add", "ds", typo, *endpoint, env=env)) == (
            f"cachefs: error: dataset 'ds': {typo} lists no objects; a mistyped prefix? "
            "Nothing added (--allow-empty adds it anyway)"
        )
        bad_cleanup = cli(
            "dataset", "add", "ds", right, *endpoint, "--cleanup", "ttl:banana", env=env
        )
        assert refusal(bad_cleanup) == (
            "cachefs: error: cleanup must be lock, lru or ttl:<duration> (e.g. ttl:6h), "
            "got 'ttl:banana'"
        )
        assert cluster.client.datasets() == []

        unchecked = cli("dataset", "add", "gone", "s3://no-such-bucket-here/x", *endpoint, env=env)
        assert unchecked.returncode == 0, unchecked.stderr
        [note] = unchecked.stderr.splitlines()
        assert note.startswith(
            "cachefs: note: could not list s3://no-such-bucket-here/x from here, so it is "
            "added unchecked ("
        ), note
        assert cli("dataset", "rm", "gone", env=env).returncode == 0

        added = cli("dataset", "add", "ds", right, *endpoint, env=env)
        assert added.returncode == 0 and added.stderr == "", added.stderr
        wait_for(lambda: os.path.isdir(cluster.workers[0].path("ds")), "ds mounted")
        with open(cluster.workers[0].path("ds", "train", "a.jpg"), "rb") as f:
            assert f.read() == b"a" * 3000

        for args, line in [
            (("preload", "ds", "--fraction", "1.5"),
             "--fraction: input should be less than or equal to 1 (got 1.5)"),
            (("preload", "ds", "--bytes", "0"), "--bytes: input should be greater than 0 (got 0)"),
            (("job", "submit", "train", "--dataset", "ds", "--nodes", "0"),
             "--nodes: input should be greater than or equal to 1 (got 0)"),
            (("dataset", "set", "ds", "--max-jobs-per-copy", "-1"),
             "--max-jobs-per-copy: input should be greater than or equal to 1 (got -1)"),
        ]:  # fmt: skip
            assert refusal(cli(*args, env=env)) == f"cachefs: error: {line}"
        assert cluster.client.jobs() == []
        assert cluster.client.dataset("ds")["max_jobs_per_copy"] is None
        with_none = cli("preload", "status", "ds", env=env)
        assert "no preload job" in refusal(with_none)

        allowed = cli("dataset", "add", "later", typo, *endpoint, "--allow-empty", env=env)
        assert allowed.returncode == 0 and allowed.stderr == "", allowed.stderr
        assert sorted(d["name"] for d in cluster.client.datasets()) == ["ds", "later"]
    finally:
        cluster.cleanup()


def interruptible_cli(*args: str, env: dict) -> subprocess.Popen:
    """The CLI as a terminal runs it: SIGINT (Ctrl-C) at its default, also when this test
    runs with SIGINT ignored (a background job), which the child would inherit."""
    return subprocess.Popen(
        [sys.executable, "-m", "cachefs", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def first_line(stream, what: str) -> str:
    ready, _, _ = select.select([stream], [], [], WAIT_S)
    assert ready, f"{what}: nothing printed within {WAIT_S:.0f} s"
    return stream.readline()


def test_ctrl_c_while_waiting_says_what_goes_on(tmp_path):
    """Ctrl-C (SIGINT) on `job submit --wait` and `preload --wait`: one line says what goes on
    without the CLI, exit 130, and the job and the preload are still there."""
    cluster = Cluster(str(tmp_path / "cluster"), 1).start()
    env = {**cluster.coordinator.env, "CACHEFS_COORDINATOR": cluster.coordinator.url}
    source = tmp_path / "source"
    source.mkdir()
    (source / "f.bin").write_bytes(b"f" * 1000)
    try:
        cluster.add_dataset("ds", f"file://{source}", max_jobs_per_copy=1)
        cluster.client.submit_job("train-1", "ds", 1)

        waiting = interruptible_cli(
            "job", "submit", "train-2", "--dataset", "ds", "--wait", env=env
        )
        line = first_line(waiting.stdout, "job submit --wait")
        assert line.startswith("train-2: suspended (position 1)"), line
        waiting.send_signal(signal.SIGINT)
        out, err = waiting.communicate(timeout=WAIT_S)
        assert waiting.returncode == 130, (out, err)
        assert err == (
            "cachefs: stopped waiting; job train-2 stays queued for dataset 'ds'; released "
            "unless renewed within 600 s: `cachefs job show train-2 --wait` waits again, "
            "`cachefs job release train-2` gives up its place\n"
        )
        assert cluster.client.job("train-2")["state"] == "suspended"

        tomorrow = str(time.time() + 86400)
        waiting = interruptible_cli("preload", "ds", "--at", tomorrow, "--wait", env=env)
        line = first_line(waiting.stderr, "preload --wait")
        assert line.startswith("scheduled for "), line
        waiting.send_signal(signal.SIGINT)
        out, err = waiting.communicate(timeout=WAIT_S)
        assert waiting.returncode == 130, (out, err)
        assert err.splitlines()[-1] == (
            "cachefs: stopped waiting; the preload of 'ds' goes on: `cachefs preload status ds`"
        )
        assert cluster.client.preload_status("ds")["state"] == "scheduled"
    finally:
        cluster.cleanup()
