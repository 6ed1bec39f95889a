"""The `cachefs` command line, run as a user runs it (subprocesses), against a real worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from cachefs.units import parse_duration, parse_size
from tests.worker_process import REPO_ROOT, WorkerProcess


def cachefs(
    *args: str, state: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {}), "CACHEFS_STATE": state, "PYTHONPATH": REPO_ROOT}
    result = subprocess.run(
        [sys.executable, "-m", "cachefs", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"cachefs {args} failed: {result.stdout}\n{result.stderr}")
    return result


def test_sizes_and_durations_parse_with_suffixes():
    assert parse_size("8GiB") == 8 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("100GB") == 100 * 10**9
    assert parse_size("4096") == 4096
    assert parse_duration("6h") == 6 * 3600
    assert parse_duration("250ms") == 0.25
    for bad in ("8 apples", "", "GiB", "-1GiB"):
        with pytest.raises(Exception, match="invalid size"):
            parse_size(bad)


def refusal(result: subprocess.CompletedProcess) -> str:
    """The line a refused command printed: exit status 1 and exactly one line on stderr."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_commands_without_a_worker_say_how_to_start_one(tmp_path):
    result = cachefs("status", state=str(tmp_path / "nothing"), check=False)
    assert result.returncode == 1
    assert "no cachefs worker is running" in result.stderr and "cachefs up" in result.stderr
    result = cachefs("down", state=str(tmp_path / "nothing"), check=False)
    assert result.returncode == 0 and "no worker running" in result.stderr


def test_full_cli_flow(tmp_path):
    source = tmp_path / "source"
    (source / "train" / "cls").mkdir(parents=True)
    (source / "train" / "cls" / "a.jpg").write_bytes(b"a" * 5000)
    (source / "val.txt").write_bytes(b"v" * 10)
    worker = WorkerProcess(str(tmp_path / "w")).start()
    state = worker.state
    try:
        out = cachefs("dataset", "add", "imagenet", f"file://{source}", state=state).stdout
        assert "imagenet" in out and "added" in out
        with open(worker.path("imagenet", "train", "cls", "a.jpg"), "rb") as f:
            assert f.read() == b"a" * 5000
        listed = json.loads(cachefs("dataset", "ls", "--json", state=state).stdout)
        assert [d["name"] for d in listed] == ["imagenet"] and listed[0]["files"] == 2
        status_text = cachefs("status", state=state).stdout
        for fragment in ("ram", "hit ratio", "imagenet", "DATASET"):
            assert fragment in status_text
        status = json.loads(cachefs("status", "--json", state=state).stdout)
        assert status["datasets"][0]["cached_bytes"] == 5000
        page = os.sysconf("SC_PAGE_SIZE")  # the RAM tier counts the tmpfs pages a block takes
        assert status["tiers"][0]["used"] == -(-5000 // page) * page
        dup = cachefs("dataset", "add", "imagenet", f"file://{source}", state=state, check=False)
        assert refusal(dup) == "cachefs: error: dataset 'imagenet' already exists"
        (source / "new.bin").write_bytes(b"n")
        out = cachefs("dataset", "refresh", "imagenet", state=state).stdout
        assert "refreshed" in out
        with open(worker.path("imagenet", "new.bin"), "rb") as f:
            assert f.read() == b"n"
        resolved = json.loads(cachefs("resolve", "imagenet", "train/cls/a.jpg", state=state).stdout)
        with open(resolved["blocks"][0]["file"], "rb") as f:
            assert f.read() == b"a" * 5000  # the short-circuit path: the block file itself
        out = cachefs("dataset", "rm", "imagenet", state=state).stdout
        assert "removed" in out
        assert os.listdir(worker.mount) == []
        out = cachefs("down", state=state).stdout
        assert "stopped" in out
        worker.proc.wait(timeout=30)
        assert not os.path.ismount(worker.mount)
    finally:
        worker.cleanup()


def test_second_worker_on_the_same_state_is_refused(tmp_path):
    worker = WorkerProcess(str(tmp_path)).start()
    try:
        clash = subprocess.run(
            [
                sys.executable,
                "-m",
                "cachefs",
                "--state",
                worker.state,
                "up",
                "--mount",
                str(tmp_path / "other"),
                "--metrics",
                "off",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": REPO_ROOT},
        )
        assert clash.returncode == 1
        assert "another cachefs worker" in clash.stderr
        assert worker.client.is_running()
    finally:
        worker.cleanup()


def test_killed_worker_leaves_no_stuck_mount_after_restart(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "f").write_bytes(b"data")
    worker = WorkerProcess(str(tmp_path / "w")).start()
    try:
        worker.add_dataset("d", f"file://{source}")
        worker.proc.kill()  # SIGKILL: the mount is left "Transport endpoint is not connected"
        worker.proc.wait()
        worker.proc = None
        worker.start()
        with open(worker.path("d", "f"), "rb") as f:
            assert f.read() == b"data"
    finally:
        worker.cleanup()


def test_a_mistyped_prefix_and_bad_options_are_refused_in_one_line_adding_nothing(
    tmp_path, moto_s3
):
    """`dataset add` of a prefix that lists nothing is refused (rc 1, one line) and leaves no
    dataset, mount entry or snapshot behind, unless --allow-empty; options the worker's rules
    refuse are one line too. The right prefix then adds and reads byte for byte."""
    bucket = f"cli-{uuid.uuid4().hex[:12]}"
    moto_s3.make_bucket(bucket)
    moto_s3.put(bucket, "imagenet/train/a.jpg", b"a" * 3000)
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    worker = WorkerProcess(str(tmp_path / "w"), env=moto_s3.env).start()
    state, endpoint = worker.state, moto_s3.endpoint
    try:

        def add(name: str, uri: str, *options: str) -> subprocess.CompletedProcess:
            return cachefs(
                "dataset", "add", name, uri, "--endpoint", endpoint, *options,
                state=state, check=False, env=moto_s3.env,
            )  # fmt: skip

        typo = f"s3://{bucket}/imagnet"
        assert refusal(add("imagenet", typo)) == (
            f"cachefs: error: dataset 'imagenet': {typo} lists no objects; a mistyped prefix? "
            "Nothing added (--allow-empty adds it anyway)"
        )
        assert refusal(add("local", f"file://{empty_dir}")) == (
            f"cachefs: error: dataset 'local': file://{empty_dir} lists no objects; a mistyped "
            "prefix? Nothing added (--allow-empty adds it anyway)"
        )
        assert refusal(add("imagenet", f"s3://{bucket}/imagenet", "--cleanup", "ttl:banana")) == (
            "cachefs: error: cleanup must be lock, lru or ttl:<duration> (e.g. ttl:6h), "
            "got 'ttl:banana'"
        )
        assert refusal(add("imagenet", f"s3://{bucket}/imagenet", "--block-size", "1KiB")) == (
            "cachefs: error: block_size must be between 64 KiB and 64 MiB"
        )
        # Nothing of the refused adds is left: no dataset, no mount entry, no snapshot.
        assert json.loads(cachefs("dataset", "ls", "--json", state=state).stdout) == []
        assert os.listdir(worker.mount) == []
        assert os.listdir(os.path.join(state, "snapshots")) == []

        added = add("imagenet", f"s3://{bucket}/imagenet", "--json")
        assert added.returncode == 0, added.stderr
        assert json.loads(added.stdout)["files"] == 1
        with open(worker.path("imagenet", "train", "a.jpg"), "rb") as f:
            assert f.read() == b"a" * 3000
        allowed = add("later", typo, "--allow-empty", "--json")
        assert allowed.returncode == 0, allowed.stderr
        assert json.loads(allowed.stdout)["files"] == 0
        assert sorted(os.listdir(worker.mount)) == ["imagenet", "later"]
    finally:
        worker.cleanup()


def test_piped_into_head_the_cli_stops_quietly(tmp_path):
    """`cachefs … | head -1`: head exits after one line while the CLI still writes (2 MB of
    JSON: far more than a pipe holds), so its writes fail with EPIPE. No traceback; exit 141
    (128 + SIGPIPE), which `set -o pipefail` reports like any tool's."""
    source = tmp_path / "src"
    source.mkdir()
    with open(source / "big.bin", "wb") as f:
        f.truncate(1 << 30)  # sparse: 16,384 blocks of 64 KiB to list, nothing to read
    worker = WorkerProcess(str(tmp_path / "w")).start()
    try:
        worker.add_dataset("ds", f"file://{source}", block_size=64 << 10)
        piped = subprocess.run(
            [
                "bash", "-c",
                f"set -o pipefail; {sys.executable} -m cachefs resolve ds big.bin | head -1",
            ],
            env={**os.environ, "CACHEFS_STATE": worker.state, "PYTHONPATH": REPO_ROOT},
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
        assert piped.stderr == ""
        assert piped.stdout == "{\n"
        assert piped.returncode == 141
    finally:
        worker.cleanup()
