"""bench/cold_read_bench.py: its readers check every byte they read (real files), percentiles,
targets and the report, and one tiny run end to end (lean_s3, the delay proxy, a real worker
and mount) whose mount passes must have reached the store for every file and whose direct
passes must have sent exactly one GET per file or part. No timing assertions."""

from __future__ import annotations

import json
import os

import pytest
import xxhash

from bench.cold_read_bench import (
    ServedFile,
    evaluate,
    main,
    percentile,
    read_large_sequentially,
    render,
    timed_reads,
)
from bench.read_bench import BenchmarkFailure
from bench.read_bench import read_whole_file as read_file


@pytest.fixture
def served(tmp_path):
    files = []
    for i in range(9):
        data = os.urandom(500 + 91 * i)
        path = tmp_path / f"f{i}.bin"
        path.write_bytes(data)
        files.append(ServedFile(str(path), len(data), xxhash.xxh3_64_intdigest(data)))
    return files


@pytest.mark.parametrize("readers", [1, 4])
def test_every_file_is_read_checked_and_timed(served, readers):
    run = timed_reads(served, list(range(len(served))), readers, lambda f: read_file(f.key))
    assert (run.files, run.bytes) == (9, sum(f.size for f in served))
    assert len(run.latencies) == 9 and all(t > 0 for t in run.latencies)


def test_a_wrong_byte_or_a_short_file_fails_the_pass(served):
    with open(served[4].key, "r+b") as f:
        f.write(b"\0\0")
    with pytest.raises(BenchmarkFailure, match="xxh3"):
        timed_reads(served, list(range(9)), 3, lambda f: read_file(f.key))
    os.truncate(served[6].key, 10)
    with pytest.raises(BenchmarkFailure, match="expected"):
        timed_reads(served, [6], 1, lambda f: read_file(f.key))


def test_the_large_reader_checks_the_whole_file(tmp_path):
    data = os.urandom((3 << 20) + 17)
    path = tmp_path / "large.bin"
    path.write_bytes(data)
    wanted = ServedFile("large.bin", len(data), xxhash.xxh3_64_intdigest(data))
    assert read_large_sequentially(str(path), wanted).bytes == len(data)
    with open(path, "r+b") as f:
        f.seek(2 << 20)
        f.write(bytes([data[2 << 20] ^ 1]))
    with pytest.raises(BenchmarkFailure, match="xxh3"):
        read_large_sequentially(str(path), wanted)


def test_percentiles_are_nearest_rank():
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 6.0, 7.0, 8.0, 9.0]
    assert percentile(values, 0.5) == 5.0
    assert percentile(values, 0.9) == 9.0
    assert percentile([3.0], 0.9) == 3.0


def _row(name, path, delay, **numbers):
    return {"pass": name, "path": path, "delay_ms": delay, "readers": 1, "seconds": 1.0, **numbers}


def test_targets_compare_the_mount_with_direct_reads_at_each_delay():
    passes = [
        _row("epoch", "direct", 20.0, files_per_s=400.0),
        _row("epoch", "mount", 20.0, files_per_s=300.0, worker_cpu_ms_per_file=1.0),
        _row("latency_small", "direct", 20.0, p50_ms=22.0),
        _row("latency_small", "mount", 20.0, p50_ms=44.0),
        _row("large", "direct", 20.0, mb_per_s=1000.0),
        _row("large", "mount", 20.0, mb_per_s=900.0),
        _row("latency_tiny", "direct", 0.0, p50_ms=2.0),
        _row("latency_tiny", "mount", 0.0, p50_ms=2.5),
    ]
    got = {(t["target"].split(",")[0], t["target"].rsplit(", ", 1)[1]): t for t in evaluate(passes)}
    assert got[("cold first epoch", "20 ms")]["value"] == 0.75
    assert not got[("cold first epoch", "20 ms")]["met"]
    assert got[("worker CPU per cold small file (ms)", "20 ms")]["met"]
    assert got[("1 reader", "20 ms")]["value"] == 2.0 and not got[("1 reader", "20 ms")]["met"]
    assert got[("1 reader", "0 ms")]["value"] == 1.25 and got[("1 reader", "0 ms")]["met"]
    assert got[("cold sequential read of the large file", "20 ms")]["met"]
    assert len(got) == 5  # nothing made up for what was not measured


def test_a_tiny_run_measures_cold_reads_and_direct_gets(tmp_path):
    out = tmp_path / "result.json"
    argv = [
        "--files", "24", "--tiny-files", "12", "--large-mib", "2", "--delay-ms", "0,5",
        "--readers", "4", "--latency-files", "8", "--range-mib", "1", "--range-threads", "2",
        "--large-repeats", "2", "--store-processes", "1", "--quiet-wait", "0",
        "--workdir", str(tmp_path / "work"), "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    results = json.loads(out.read_text())
    rows = {(p["pass"], p["path"], p["delay_ms"]): p for p in results["passes"]}
    assert len(rows) == len(results["passes"]) == 2 * 8  # the large repeats kept once
    for delay in (0.0, 5.0):
        for name, files in (("epoch", 24), ("latency_small", 8), ("latency_tiny", 8)):
            direct, mount = rows[(name, "direct", delay)], rows[(name, "mount", delay)]
            assert direct["files"] == mount["files"] == files
            assert direct["store"]["get_object"] == files  # one GET per file, nothing else
            # Cold: every file missed the cache and was fetched from the store.
            assert mount["worker"]["misses"] >= files
            assert mount["store"]["get_object"] >= files
            # Measured from /proc in clock ticks (10 ms): a pass of 8 tiny files may take
            # less than one; the sum over every pass below may not.
            assert mount["worker_cpu_ms_per_file"] >= 0
        assert "p50_ms" in rows[("latency_tiny", "mount", delay)]
        large_direct, large_mount = (
            rows[("large", "direct", delay)],
            rows[("large", "mount", delay)],
        )
        assert large_direct["store"]["get_object"] == 2  # two 1 MiB ranges
        assert large_mount["bytes"] == 2 << 20 and large_mount["store"]["get_object"] >= 1
        assert len(large_mount["all_seconds"]) == 2
    mount_rows = [row for row in results["passes"] if row["path"] == "mount"]
    assert sum(row["worker_cpu_ms_per_file"] * row["files"] for row in mount_rows) > 0
    # Behind the proxy every GET went through it; without it, none did.
    assert rows[("epoch", "mount", 5.0)]["proxy_object_gets"] >= 24
    assert rows[("epoch", "direct", 5.0)]["proxy_object_gets"] == 24
    assert "proxy_object_gets" not in rows[("epoch", "mount", 0.0)]
    assert len(results["targets"]) == 2 * 5
    report = render(results)
    assert "| 5 ms | cold epoch, small files | mount, 4 readers | 24 |" in report
    # The served copy and the RAM tier (named after this process) are gone.
    left = [name for name in os.listdir("/dev/shm") if name.endswith(f"-{os.getpid()}")]
    assert not [name for name in left if name.startswith("cachefs-cold-read-bench")]
