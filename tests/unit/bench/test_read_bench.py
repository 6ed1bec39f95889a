"""bench/read_bench.py without the worker: verification of the bytes read (real files), ratios
and targets, the markdown/JSON writers, and the profile summariser. No timing assertions."""

from __future__ import annotations

import hashlib
import json

import pytest

from bench.read_bench import (
    BenchmarkFailure,
    evaluate,
    lock_workdir,
    read_pass,
    render_markdown,
    sanity_notes,
    summarise_profile,
    write_results,
)


def _pass(name: str, threads: int, files_per_s: float, **extra) -> dict:
    return {
        "name": name,
        "threads": threads,
        "files": 1000,
        "bytes": 110_000_000,
        "seconds": 1000 / files_per_s,
        "all_seconds": [1000 / files_per_s, 1.5 * 1000 / files_per_s],
        "files_per_s": files_per_s,
        "gb_per_s": 0.11 * files_per_s / 1000,
        "worker_delta": extra.get("delta", {}),
        "cpu_busy_before": [0.05, 0.4],
    }


PASSES = [
    _pass("tmpfs_direct", 1, 30_000),
    _pass("tmpfs_direct", 4, 20_000),
    _pass("cachefs_first_read_store", 4, 150, delta={"misses": 1000, "store_gets": 1000}),
    _pass(
        "cachefs_first_read_ram",
        4,
        5_000,
        delta={"hits_ram": 1000, "worker_cpu_ms": 250, "worker_write_syscalls": 5300},
    ),
    _pass("cachefs_warm", 4, 16_000),
]


def _results(passes=PASSES) -> dict:
    ratios, targets = evaluate(passes)
    return {
        "date": "2026-01-02",
        "machine": {
            "nproc": 2,
            "cpu": "x",
            "memory_bytes": 8 << 30,
            "kernel": "6.1",
            "python": "3.11.7",
        },
        "load_before": [0.5, 0.4, 0.3],
        "load_after": [1.0, 0.5, 0.3],
        "dataset": {
            "files": 1000,
            "classes": 10,
            "bytes": 110_000_000,
            "mean_size": 110_000,
            "median_size": 92_000,
            "seed": 0,
        },
        "source": "s3: moto_server",
        "repeats": 2,
        "order_seed": 1,
        "sample_files": 50,
        "passes": passes,
        "worker_rss_bytes": 200 << 20,
        "worker_fuse_no_open": True,
        "ratios": ratios,
        "targets": targets,
        "notes": ["a note"],
    }


def test_targets_are_judged_at_four_readers():
    targets = {t["target"]: t for t in evaluate(PASSES)[1]}
    warm_vs_tmpfs = targets["warm >= 0.7x tmpfs direct, 4 readers"]
    assert warm_vs_tmpfs["value"] == pytest.approx(0.8)
    assert warm_vs_tmpfs["met"]
    ram = targets["first read from RAM tier >= 6,000 files/s, 4 readers"]
    assert ram["value"] == 5_000 and not ram["met"]
    # 5x the best peer's warm 4-reader reference (rclone, 1,540 files/s)
    warm_vs_peers = next(t for name, t in targets.items() if name.startswith("warm >= 5x"))
    assert warm_vs_peers["value"] == pytest.approx(16_000 / 1540)
    assert warm_vs_peers["met"]
    ram_vs_peers = next(
        t for name, t in targets.items() if name.startswith("first read from RAM tier >= 5x")
    )
    assert not ram_vs_peers["met"]


def test_ratios_compare_with_tmpfs_of_the_same_reader_count_and_the_references():
    ratios = {(r["what"], r["threads"]): r["ratio"] for r in evaluate(PASSES)[0]}
    assert ratios[("cachefs_warm / tmpfs_direct", 4)] == pytest.approx(0.8)
    assert ratios[("cachefs_first_read_store / s3fs 1.90 first_read (reference)", 4)] == (
        pytest.approx(150 / 357)
    )
    assert ratios[("cachefs_warm / rclone 1.60 (vfs-cache full) warm@4 (reference)", 4)] == (
        pytest.approx(16_000 / 1540)
    )


def test_a_local_directory_source_is_not_compared_with_the_peers_first_reads():
    ratios = [r["what"] for r in evaluate(PASSES, s3_source=False)[0]]
    assert "cachefs_first_read_store / tmpfs_direct" in ratios
    assert not any(r.startswith("cachefs_first_read_store / s3fs") for r in ratios)


def test_missing_passes_leave_their_targets_out():
    ratios, targets = evaluate([_pass("cachefs_warm", 1, 9_000)])
    assert targets == []
    assert all(r["threads"] == 1 for r in ratios)


def test_sanity_notes_flag_passes_that_did_not_measure_what_they_claim():
    honest = [
        _pass("cachefs_first_read_store", 4, 150, delta={"misses": 1000, "store_gets": 1000}),
        _pass("cachefs_first_read_ram", 4, 5_000, delta={"hits_ram": 1300}),
        _pass("cachefs_warm", 4, 16_000, delta={"hits_ram": 20}),
    ]
    assert sanity_notes(honest) == []
    dishonest = [
        _pass("cachefs_first_read_store", 4, 150, delta={"misses": 10, "store_gets": 10}),
        _pass("cachefs_first_read_ram", 4, 5_000, delta={"hits_ram": 900, "misses": 100}),
        _pass("cachefs_warm", 1, 16_000, delta={"hits_ram": 700}),
    ]
    notes = sanity_notes(dishonest)
    assert len(notes) == 3
    assert notes[0].startswith("cachefs_first_read_store@4: only 10 store GETs for 1,000 files")
    assert notes[1].startswith("cachefs_first_read_ram@4: 100 misses and 900 RAM hits")
    assert notes[2].startswith("cachefs_warm@1: 700 block reads reached the worker")


def test_markdown_report_has_every_pass_target_and_the_reference_caveat():
    text = render_markdown(_results())
    assert "| tmpfs direct (the limit) | 4 | 20,000 | 2.200 |" in text
    assert "| cachefs warm (page cache holds the data) | 4 | 16,000 | 1.760 | 0.80x |" in text
    assert "misses 1,000, store_gets 1,000" in text
    # worker CPU and write syscalls per file, apart from the other counters
    assert "| 250 µs | 5.3 | hits_ram 1,000 |" in text
    assert "| warm >= 0.7x tmpfs direct, 4 readers | 0.800 x tmpfs | 0.700 | PASS |" in text
    assert "| 5,000 files/s | 6,000 | FAIL |" in text
    assert "NOT re-measured" in text
    assert "| s3fs 1.90 | 357 | 559 | 1,295 |" in text
    assert "worker RSS after the passes: 200 MiB" in text
    assert "FUSE no-open mode: on" in text
    assert "- a note" in text
    assert "0.06 (5%), 0.09 (40%)" in text  # every run, with the CPU load it started under


def test_markdown_report_shows_profiles():
    results = _results()
    results["profiles"] = {
        "cachefs_warm": {
            "threads": 4,
            "files_per_s_under_profiler": 900.0,
            "samples": 100,
            "idle_samples": 60,
            "helper_thread_samples": 0,
            "fuse_loop_busy_samples": 40,
            "fuse_loop_by_layer": {"pyfuse3 + libfuse dispatch": 0.75, "trio scheduler": 0.25},
            "fuse_loop_by_handler_inclusive": {"FuseOperations.open": 0.1},
        }
    }
    text = render_markdown(results)
    assert "### Profile: cachefs warm (page cache holds the data), 4 readers" in text
    assert "| pyfuse3 + libfuse dispatch | 75% |" in text
    assert "| of which inside FuseOperations.open | 10% |" in text


def test_write_results_writes_json_and_markdown(tmp_path):
    results = _results()
    written = write_results(
        results, json_path=str(tmp_path / "out.json"), save_dir=str(tmp_path / "read")
    )
    assert written == [
        str(tmp_path / "out.json"),
        str(tmp_path / "read" / "2026-01-02.json"),
        str(tmp_path / "read" / "2026-01-02.md"),
    ]
    assert json.loads((tmp_path / "out.json").read_text()) == results
    assert (tmp_path / "read" / "2026-01-02.md").read_text() == render_markdown(results)


@pytest.fixture
def small_tree(tmp_path):
    contents = [bytes([i]) * (100 + i) for i in range(12)]
    paths = []
    for i, data in enumerate(contents):
        path = tmp_path / f"f{i}"
        path.write_bytes(data)
        paths.append(str(path))
    sample = {i: hashlib.sha256(contents[i]).hexdigest() for i in (0, 5, 11)}
    return paths, [len(c) for c in contents], sample


@pytest.mark.parametrize("threads", [1, 4])
def test_read_pass_reads_every_file_once_and_counts_bytes(small_tree, threads):
    paths, sizes, sample = small_tree
    order = [3, 1, 0, 2, 11, 10, 9, 8, 7, 6, 5, 4]
    seen: list[str] = []

    def read(path: str) -> bytes:
        seen.append(path)
        with open(path, "rb") as f:
            return f.read()

    run = read_pass(paths, sizes, order, threads, sample, read)
    assert sorted(seen) == sorted(paths)
    assert run.files == 12 and run.bytes == sum(sizes)


def test_read_pass_fails_on_a_wrong_byte_in_a_sampled_file(small_tree):
    paths, sizes, sample = small_tree
    with open(paths[5], "r+b") as f:
        f.write(b"\xff")  # same length, different content
    with pytest.raises(BenchmarkFailure, match="f5: content differs"):
        read_pass(paths, sizes, list(range(12)), 4, sample)


def test_read_pass_fails_on_a_short_file(small_tree):
    paths, sizes, sample = small_tree
    with open(paths[7], "r+b") as f:
        f.truncate(10)
    with pytest.raises(BenchmarkFailure, match="f7: read 10 bytes, expected 107"):
        read_pass(paths, sizes, list(range(12)), 2, sample)


def test_read_pass_reports_reader_exceptions(small_tree):
    paths, sizes, sample = small_tree
    paths[2] = paths[2] + ".missing"
    with pytest.raises(BenchmarkFailure, match="FileNotFoundError"):
        read_pass(paths, sizes, list(range(12)), 1, sample)


def test_a_second_benchmark_cannot_share_a_work_directory(tmp_path):
    refused = pytest.raises(BenchmarkFailure, match=r"another read_bench \(pid \d+\) is using")
    with lock_workdir(str(tmp_path / "work")), refused:
        lock_workdir(str(tmp_path / "work"))
    with lock_workdir(str(tmp_path / "work")):  # free again once the first one is done
        pass


def test_profile_summary_splits_the_fuse_loop_into_layers_and_handlers(tmp_path):
    loop = "MainThread;main (cachefs/__main__.py:5);cmd_up (cachefs/cli.py:64);run (trio/_run.py:1)"
    dispatch = f"{loop};wrapper (_pyfuse3.py:58);gen (handlers.pxi:468)"
    collapsed = tmp_path / "stacks.txt"
    collapsed.write_text(
        f"{dispatch};FuseOperations.read (cachefs/fs/fuse_ops.py:188);"
        "BlockReader._read_block (/repo/cachefs/fs/blocks.py:130) 5\n"
        f"{dispatch};FuseOperations.open (cachefs/fs/fuse_ops.py:175);get (lmdb.so) 1\n"
        f"{dispatch};fuse_reply_buf (libfuse3.so.3);writev (libc.so.6) 2\n"
        f"{dispatch};Py_DECREF (object.h:537) 1\n"
        f"{loop};unrolled_run (trio/_core/_run.py:2318) 1\n"
        f"{loop};EpollIOManager.get_events (trio/_core/_io_epoll.py:230);epoll_wait (libc) 30\n"
        "Thread-1;WorkerThread._work (trio/_core/_thread_cache.py:166);"
        "PyThread_acquire_lock_timed (libpython3.11.so) 40\n"
        "Thread-2;WorkerThread._work (trio/_core/_thread_cache.py:170);get_range (s3.py:1) 4\n"
        "not a stack line\n"
    )
    summary = summarise_profile(str(collapsed))
    assert summary["samples"] == 84
    assert summary["idle_samples"] == 70
    assert summary["helper_thread_samples"] == 4
    assert summary["fuse_loop_busy_samples"] == 10
    assert summary["fuse_loop_by_layer"] == {
        "cachefs handlers (FuseOperations.* and below)": 0.6,
        "kernel: /dev/fuse syscalls (request read, reply write incl. data copy)": 0.2,
        "pyfuse3 + libfuse dispatch (receive, reply, coroutine plumbing)": 0.1,
        "trio scheduler": 0.1,
    }
    assert summary["fuse_loop_by_handler_inclusive"] == {
        "FuseOperations.read": 0.5,
        "FuseOperations.open": 0.1,
    }
    assert summary["fuse_loop_top_leaf_frames"][0] == [
        "BlockReader._read_block (/repo/cachefs/fs/blocks.py:130)",
        0.5,
    ]
