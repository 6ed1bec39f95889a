"""bench/native_read_bench.py: its readers verify what they read (real files), its summary and
report, and one tiny run end to end with real workers and mounts, which must show that the
native worker's RAM-tier passes never reached Python and the other's never reached C. No
timing assertions."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import xxhash

from bench.native_read_bench import main, process_pass, render, summarise
from bench.read_bench import BenchmarkFailure
from cachefs.fs.fuse_ops import FAST_READ_SUPPORTED


@pytest.fixture
def tree(tmp_path):
    paths, sizes, sample = [], [], {}
    for i in range(12):
        data = os.urandom(1000 + 37 * i)
        path = tmp_path / f"f{i}.bin"
        path.write_bytes(data)
        paths.append(str(path))
        sizes.append(len(data))
        sample[i] = hashlib.sha256(data).hexdigest()
    return paths, sizes, sample


@pytest.mark.parametrize("readers", [1, 3])
def test_reader_processes_read_every_file_and_check_it(tree, readers):
    paths, sizes, sample = tree
    assert process_pass(paths, sizes, list(range(len(paths))), readers, sample) > 0


def test_a_wrong_byte_or_a_short_file_fails_the_pass(tree):
    paths, sizes, sample = tree
    with open(paths[3], "r+b") as f:
        f.write(b"\0")
    with pytest.raises(BenchmarkFailure, match="sha256"):
        process_pass(paths, sizes, list(range(len(paths))), 2, sample)
    os.truncate(paths[5], 10)
    with pytest.raises(BenchmarkFailure, match="expected"):
        process_pass(paths, sizes, [5], 1, {})


def test_a_large_file_is_read_whole_and_its_checked_mibs_compared(tmp_path):
    mib = 1 << 20
    data = os.urandom(3 * mib + 5)
    path = tmp_path / "large.bin"
    path.write_bytes(data)
    digests = {
        0: xxhash.xxh3_64_intdigest(data[:mib]),
        2: xxhash.xxh3_64_intdigest(data[2 * mib : 3 * mib]),
    }
    assert process_pass([str(path)], [len(data)], [0], 1, {0: digests}) > 0
    with open(path, "r+b") as f:
        f.seek(2 * mib + 10)
        f.write(bytes([data[2 * mib + 10] ^ 1]))
    with pytest.raises(BenchmarkFailure, match="MiB 2 differs"):
        process_pass([str(path)], [len(data)], [0], 1, {0: digests})
    with pytest.raises(BenchmarkFailure, match="expected"):
        process_pass([str(path)], [len(data) + 1], [0], 1, {0: {}})


def test_the_summary_gives_each_system_its_ratio_to_tmpfs():
    passes = [
        {"pass": "first_read_ram", "system": s, "readers": 16, "files_per_s": rate,
         "mb_per_s": 1.0, "seconds": 1.0, "worker_cpu_ms_per_1000_files": 50.0}
        for s, rate in (("tmpfs", 20_000.0), ("native", 10_000.0), ("python", 2_000.0))
    ] + [
        {"pass": "ls_lR", "system": s, "readers": 1, "files_per_s": 0, "mb_per_s": 0,
         "seconds": seconds}
        for s, seconds in (("tmpfs", 0.1), ("native", 0.2), ("python", 1.0))
    ]  # fmt: skip
    rows = {row["pass"]: row for row in summarise(passes, [16])}
    assert rows["first_read_ram"]["native_ratio"] == 0.5
    assert rows["first_read_ram"]["python_ratio"] == 0.1
    assert rows["ls_lR"]["native_x_tmpfs_time"] == 2.0
    assert rows["ls_lR"]["python_x_tmpfs_time"] == 10.0


@pytest.mark.skipif(not FAST_READ_SUPPORTED, reason="needs the patched pyfuse3 (scripts/setup.sh)")
def test_a_tiny_run_measures_what_each_pass_says(tmp_path, capsys):
    out = tmp_path / "result.json"
    argv = [
        "--files", "40", "--classes", "4", "--sample", "10", "--readers", "1,2",
        "--repeats", "1", "--large-files", "1", "--large-mib", "2", "--walk", "300",
        "--workdir", str(tmp_path / "work"), "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    results = json.loads(out.read_text())
    by_key = {(p["pass"], p["system"], p["readers"]): p for p in results["passes"]}
    passthrough_granted = results["native_counters"]["passthrough"]["passthrough"] == 1
    for readers in (1, 2):
        native = by_key[("first_read_ram", "native", readers)]["worker"]
        python = by_key[("first_read_ram", "python", readers)]["worker"]
        handed = by_key[("first_read_ram", "passthrough", readers)]["worker"]
        assert (native["native_reads"], native["python_reads"]) == (40, 0)
        assert (python["native_reads"], python["python_reads"]) == (0, 40)
        assert native["passthrough_opens"] == python["passthrough_opens"] == 0
        assert native["misses"] == python["misses"] == handed["misses"] == 0
        if passthrough_granted:  # every file one block: the kernel read each block file
            assert handed["passthrough_opens"] == 40
            assert handed["native_reads"] == handed["python_reads"] == 0
        else:  # a kernel without FUSE passthrough: the native path, as "native"
            assert (handed["native_reads"], handed["python_reads"]) == (40, 0)
    echo3 = by_key[("first_read_ram_echo3", "native", 2)]["worker"]
    assert echo3["native_reads"] == 40 and echo3["python_reads"] == 0
    assert by_key[("first_read_source", "native", 2)]["worker"]["misses"] > 0
    assert "| first_read_ram (files/s) | 2 |" in render(results)
    assert results["back_pages"] is True  # the default
    assert "pages backed before the RAM-tier first-read passes" in render(results)
    # The second cold walk of the namespace (300 files in 300 class directories + train) is
    # listed from the binding: its listings were registered by the first.
    walk = by_key[("walk_cold_second", "passthrough", 1)]
    assert walk["files"] == 300 + 300 + 1
    assert by_key[("walk_cold_first", "tmpfs", 1)]["files"] == walk["files"]
    assert "worker_rss" in walk
    # tmpfs's copy of the namespace is gone before the worker walks (its dentries would stay
    # in the kernel's shared dentry hash table): the worker walked with fewer cached dentries.
    assert by_key[("walk_cold_first", "tmpfs", 1)]["tmpfs_copy_present"] is True
    assert walk["tmpfs_copy_present"] is False
    assert walk["dentries_before"] > 0
    assert "dentries cached before the walk" in render(results)


@pytest.mark.skipif(not FAST_READ_SUPPORTED, reason="needs the patched pyfuse3 (scripts/setup.sh)")
def test_no_large_files_skips_the_large_pass(tmp_path):
    """``--large-files 0`` used to add an empty "large" dataset, which the worker refuses."""
    out = tmp_path / "result.json"
    argv = [
        "--files", "20", "--classes", "2", "--sample", "5", "--readers", "1",
        "--repeats", "1", "--large-files", "0", "--systems", "native", "--no-back-pages",
        "--workdir", str(tmp_path / "work"), "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    results = json.loads(out.read_text())
    assert "pages as the kernel hands them out" in render(results)
    passes = results["passes"]
    assert {p["pass"] for p in passes} >= {"first_read_ram", "warm", "ls_lR"}
    assert not [p for p in passes if p["pass"] == "large_first_read_ram"]
    first = next(p for p in passes if (p["pass"], p["system"]) == ("first_read_ram", "native"))
    assert first["worker"]["native_reads"] == 20


@pytest.mark.parametrize("bad", [["--large-files", "-1"], ["--large-mib", "0"]])
def test_a_negative_large_file_count_or_size_is_refused(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(bad)
    assert exit_info.value.code == 2
    assert "--large-files must be >= 0" in capsys.readouterr().err
