"""bench/tf_bench.py: its helpers without TensorFlow, and one tiny real run (real worker, real
mount, real tf.data). No timing assertions."""

from __future__ import annotations

import json
import uuid

import pytest

from bench.read_bench import BenchmarkFailure
from bench.tf_bench import EpochRun, PassResult, check_epoch, main, render_markdown, targets


def _pass(name: str, files_per_s: float, **extra) -> dict:
    return {
        "name": name,
        "files": 1000,
        "bytes": 110_000_000,
        "seconds": 1000 / files_per_s,
        "all_seconds": [1000 / files_per_s],
        "files_per_s": files_per_s * 1.2,  # the best run: not what the targets compare
        "median_files_per_s": files_per_s,
        "mb_per_s": 110 * files_per_s / 1000,
        "reader_stats": extra.get("reader_stats", {}),
        "worker_delta": extra.get("worker_delta", {}),
    }


def test_best_of_keeps_the_fastest_run_the_median_and_every_time():
    runs = [EpochRun(10, 100, 2.0), EpochRun(10, 100, 1.0), EpochRun(10, 100, 5.0)]
    result = PassResult.best_of("x", runs)
    assert result.seconds == 1.0 and result.all_seconds == [2.0, 1.0, 5.0]
    assert result.files_per_s == 10.0 and result.mb_per_s == 100 / 1e6
    assert result.median_files_per_s == 5.0


def test_check_epoch_fails_on_a_wrong_count():
    check_epoch(EpochRun(3, 30, 1.0), 3, 30, "ok")
    with pytest.raises(BenchmarkFailure):
        check_epoch(EpochRun(3, 29, 1.0), 3, 30, "short")
    with pytest.raises(BenchmarkFailure):
        check_epoch(EpochRun(2, 30, 1.0), 3, 30, "missing file")


def test_targets_compare_warm_passes_with_tmpfs_and_the_report_shows_them():
    passes = [
        _pass("tmpfs_read_file", 20_000),
        _pass(
            "cachefs_warm",
            19_000,
            reader_stats={"short_circuit_files": 1000, "mount_files": 0, "fallback_files": 0},
        ),
        _pass("cachefs_warm_new_pipeline", 16_000),
    ]
    steady, first = targets(passes)
    assert steady["value"] == pytest.approx(0.95) and steady["met"]
    assert "first epoch of a new pipeline" in first["target"]
    assert first["value"] == pytest.approx(0.8) and not first["met"]
    assert not targets([_pass("tmpfs_read_file", 20_000), _pass("cachefs_warm", 10_000)])[0]["met"]
    # TFRecord passes are held against TFRecordDataset on tmpfs, not against the file passes.
    (tfrecord,) = targets([_pass("tmpfs_tfrecord", 40_000), _pass("cachefs_tfrecord_warm", 38_000)])
    assert "TFRecordDataset on tmpfs" in tfrecord["target"]
    assert tfrecord["value"] == pytest.approx(0.95) and tfrecord["met"]
    assert targets(passes[:1]) == []
    results = {
        "date": "2026-11-21",
        "machine": {"nproc": 2, "memory_bytes": 8 << 30, "kernel": "6.1", "python": "3.11"},
        "tensorflow": "2.x",
        "load_before": [1, 1, 1],
        "load_after": [1, 1, 1],
        "dataset": {
            "files": 1000,
            "classes": 10,
            "bytes": 110_000_000,
            "mean_size": 110_000,
            "seed": 0,
        },
        "source": "file",
        "settings": {"batch": 256, "chunk": 32, "window": 1024, "repeats": 1},
        "passes": passes,
        "targets": [steady, first],
    }
    report = render_markdown(results)
    assert "0.95x" in report and "PASS" in report and "short-circuit 1,000" in report
    assert "0.80x" in report and "FAIL" in report


def test_a_tiny_run_reads_every_file_in_every_pass(tmp_path):
    pytest.importorskip("tensorflow")  # a guard only: CI installs the [tf] extra
    out = tmp_path / "results.json"
    status = main(
        [
            "--files",
            "40",
            "--classes",
            "4",
            "--repeats",
            "1",
            "--batch",
            "8",
            "--chunk",
            "4",
            "--window",
            "16",
            "--tfrecord-shards",
            "2",
            "--workdir",
            str(tmp_path / "work"),
            "--local-root",
            f"/dev/shm/cachefs-tf-bench-test-{uuid.uuid4().hex[:8]}",
            "--json",
            str(out),
            "--save-dir",
            str(tmp_path / "saved"),
        ]
    )
    assert status == 0
    results = json.loads(out.read_text())
    names = [p["name"] for p in results["passes"]]
    assert names == [
        "tmpfs_read_file",
        "cachefs_first_epoch",
        "cachefs_warm",
        "cachefs_warm_new_pipeline",
        "cachefs_warm_python",
        "cachefs_mount_read_file",
        "blockfiles_read_file",
        "tmpfs_tfrecord",
        "cachefs_tfrecord_warm",
        "cachefs_tfrecord_mount",
        "tmpfs_read_file_last",
    ]
    assert all(p["files"] == 40 for p in results["passes"])
    tfrecord_warm, tfrecord_mount = results["passes"][8:10]
    assert tfrecord_warm["reader_stats"]["short_circuit_files"] == 2  # both shards
    assert tfrecord_warm["reader_stats"]["mount_files"] == 0
    assert tfrecord_mount["reader_stats"]["mount_files"] == 2
    for warm in results["passes"][2:5]:  # per timed epoch, not summed over the pipeline's
        assert warm["reader_stats"]["short_circuit_files"] == 40
        assert warm["reader_stats"]["mount_files"] == 0
        assert warm["worker_delta"]["store_gets"] == 0
    assert results["passes"][1]["worker_delta"]["store_gets"] > 0  # the local store counts too
    saved = list((tmp_path / "saved").iterdir())
    assert sorted(p.suffix for p in saved) == [".json", ".md"]
