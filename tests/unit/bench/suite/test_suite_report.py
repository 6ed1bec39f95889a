"""The suite's report: targets computed from the results, the markdown, the plots, the CLI."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from bench.__main__ import _parts, build_parser, default_out_dir, main, write_report
from bench.suite import report
from bench.suite.presets import PRESETS


def small_pass(system: str, name: str, threads: int, files_per_s: float) -> dict:
    return {
        "system": system,
        "name": name,
        "threads": threads,
        "files": 1000,
        "bytes": 110_000_000,
        "seconds": 1000 / files_per_s,
        "all_seconds": [1000 / files_per_s],
        "files_per_s": files_per_s,
        "gb_per_s": 0.11 * files_per_s / 1000,
        "worker_delta": {"store_gets": 0},
        "cpu_busy_before": [0.1],
    }


def emulator_run(
    largest: int, utilisations: dict[int, float], *, warm_up=False, drop_caches=False
) -> dict:
    return {
        "workload": {
            "warm_up": warm_up,
            "drop_caches": drop_caches,
            "batch": 40,
            "compute_s": 0.0224,
            "scale": 0.1,
            "batches": 10,
            "readers": 4,
            "demand_samples_per_s_per_accelerator": 1785.7,
        },
        "dataset": {"samples": 1000, "sample_size": 114_660},
        "trials": [{"accelerators": n, "mean_utilisation": u} for n, u in utilisations.items()],
        "search": {"largest_accelerators": largest},
    }


@pytest.fixture
def results() -> dict:
    passes = [
        small_pass("tmpfs", "warm", 4, 20_000),
        small_pass("cachefs", "warm", 4, 15_000),  # 0.75x tmpfs
        small_pass("s3fs", "warm", 4, 1_000),  # cachefs 15x
        small_pass("rclone", "warm", 4, 2_000),  # cachefs 7.5x: below 10x
        small_pass("cachefs", "after_preload", 4, 2_400),
        small_pass("boto3", "cold", 4, 200),  # 12x
        small_pass("cachefs", "cold", 4, 150),
    ]
    return {
        "date": "2026-11-21",
        "started": "2026-11-21T10:00:00",
        "wall_s": 600.0,
        "command": ".venv/bin/python -m bench all --preset quick",
        "git": {"head": "abc1234", "uncommitted_changes": False},
        "machine": {
            "nproc": 2,
            "cpu": "test cpu",
            "memory_bytes": 24 << 30,
            "kernel": "6.18",
            "python": "3.11",
        },
        "load_before": [1.0, 1.0, 1.0],
        "load_after": [2.0, 2.0, 2.0],
        "preset": {"name": "quick"},
        "systems": {
            "backend": {"store": "moto", "first_byte_ms": 20, "bandwidth_per_connection": 1 << 26},
            "s3fs": {"name": "s3fs", "flags": {"-o kernel_cache": "keeps the page cache"}},
        },
        "small": {
            "files": 1000,
            "bytes": 110_000_000,
            "sizes": {"mean": 110_000, "median": 92_000},
            "cold_files": 300,
            "passes": passes,
            "preload": {"objects": 1000, "seconds": 5.0, "objects_per_s": 200, "mb_per_s": 22},
        },
        "large": {
            "shards": [{"index": 0, "path": "shards/a", "size": 64 << 20}],
            "bytes": 64 << 20,
            "s3_range_bytes": 8 << 20,
            "runs": [
                {
                    "system": s,
                    "pattern": "sequential",
                    "readers": 1,
                    "state": "cold",
                    "mb_per_s": mb,
                    "seconds": 1.0,
                    "store_gets": 16,
                }
                for s, mb in (("cachefs", 300.0), ("boto3", 100.0))
            ],
        },
        "emulator": {
            "tmpfs": emulator_run(10, {8: 0.95, 16: 0.7, 10: 0.91}, warm_up=True),
            "cachefs": emulator_run(8, {8: 0.93, 16: 0.6}, warm_up=True),  # 0.8x: met
            # 0.1x: not met
            "cachefs_ram_tier": emulator_run(1, {1: 0.95, 2: 0.5}, drop_caches=True),
        },
        "thrash": {
            "policies": {
                "avoid-eviction": {
                    "capacity_ratio": 0.5,
                    "epochs": [
                        {"epoch": 1, "hit_ratio": 0.0, "files_per_s": 100},
                        {"epoch": 2, "hit_ratio": 0.49, "files_per_s": 200},
                    ],
                }
            },
            "targets": [
                {"target": "thrash avoid-eviction", "value": 0.98, "threshold": 0.9, "unit": "x"}
            ],
        },
        "notes": ["a note"],
    }


def test_targets_are_ratios_of_the_measured_numbers(results: dict) -> None:
    rows = {row["target"]: row for row in report.evaluate(results)}
    warm = rows["warm small files >= 0.7x tmpfs direct, 4 readers"]
    assert warm["value"] == pytest.approx(0.75) and warm["met"] is True
    assert rows["warm small files >= 10x s3fs (warm), 4 readers"]["value"] == pytest.approx(15)
    rclone = rows["warm small files >= 10x rclone (warm), 4 readers"]
    assert rclone["value"] == pytest.approx(7.5) and rclone["met"] is False
    preload = rows["first epoch after preload >= 5x direct boto3 reads, 4 readers"]
    assert preload["value"] == pytest.approx(12) and preload["met"] is True
    emulator = [row for name, row in rows.items() if name.startswith("emulator")]
    assert [round(row["value"], 2) for row in emulator] == [0.8, 0.1]
    assert [row["met"] for row in emulator] == [True, False]
    assert rows["thrash avoid-eviction"]["met"] is True


def test_missing_parts_give_no_value_instead_of_a_verdict(results: dict) -> None:
    del results["emulator"], results["thrash"]
    results["small"]["passes"] = [p for p in results["small"]["passes"] if p["system"] != "s3fs"]
    rows = {row["target"]: row for row in report.evaluate(results)}
    s3fs = rows["warm small files >= 10x s3fs (warm), 4 readers"]
    assert s3fs["value"] is None and s3fs["met"] is None
    assert all(row["met"] is None for name, row in rows.items() if name.startswith("emulator"))


def test_markdown_shows_every_part(results: dict) -> None:
    text = report.render_markdown(results, ["/x/small_files.png"])
    assert "| warm small files >= 0.7x tmpfs direct, 4 readers | 0.75x | 0.7x | PASS |" in text
    assert "| warm small files >= 10x rclone (warm), 4 readers | 7.50x | 10x | FAIL |" in text
    assert "| later epochs (warm) | cachefs | 4 | 15,000 |" in text
    assert "| sequential | 1 | cachefs | cold | 300.0 |" in text
    assert "| cachefs_ram_tier | page cache dropped | 1 | 0.10x |" in text
    assert "| cachefs | every sample read once | 8 | 0.80x |" in text
    assert "| avoid-eviction | 0.50 | 2 | 0.490 |" in text
    assert "`-o kernel_cache`: keeps the page cache" in text
    assert "![small_files.png](small_files.png)" in text
    assert "- a note" in text


def test_write_report_writes_json_markdown_and_pngs(tmp_path, results: dict) -> None:
    written = write_report(results, str(tmp_path))
    names = sorted(os.path.basename(p) for p in written)
    assert names == [
        "emulator.png",
        "large_files.png",
        "report.md",
        "results.json",
        "small_files.png",
        "thrash.png",
    ]
    for png in (p for p in written if p.endswith(".png")):
        with open(png, "rb") as image:
            assert image.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(tmp_path / "results.json") as saved:
        assert json.load(saved) == results
    # `python -m bench report DIR` renders the saved results again, identically.
    before = (tmp_path / "report.md").read_text()
    (tmp_path / "report.md").unlink()
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report.md").read_text() == before


def test_command_line() -> None:
    args = build_parser().parse_args(["--preset", "quick", "--skip", "thrash,s3fs"])
    assert args.preset == "quick" and args.skip == ["thrash", "s3fs"]
    assert args.bandwidth == 64 << 20 and args.first_byte_ms == 20.0
    with pytest.raises(argparse.ArgumentTypeError, match="unknown part"):
        _parts("small,nope")
    assert default_out_dir("default").endswith(tuple("0123456789"))
    assert default_out_dir("quick").endswith("-quick")
    assert default_out_dir("quick", partial=True).endswith("-quick-partial")
    assert main(["nothing"]) == 2


def test_presets_grow_from_quick_to_full() -> None:
    quick, default, full = PRESETS["quick"], PRESETS["default"], PRESETS["full"]
    assert quick.small_files < default.small_files < full.small_files
    assert default.meta_entries == 1_281_167  # ImageNet-1k's training set
    for preset in PRESETS.values():
        assert preset.cold_files <= preset.small_files
        assert 4 in preset.readers  # the targets are taken at 4 readers
        assert 64 << 20 <= preset.shard_min <= preset.shard_max <= 256 << 20


def test_a_new_run_never_overwrites_earlier_results(tmp_path):
    first = default_out_dir("default", root=str(tmp_path))
    os.makedirs(first)
    assert default_out_dir("default", root=str(tmp_path)) == first  # empty: reused
    open(os.path.join(first, "results.json"), "w").close()
    second = default_out_dir("default", root=str(tmp_path))
    assert second == first + "-2"
    os.makedirs(second)
    open(os.path.join(second, "results.json"), "w").close()
    assert default_out_dir("default", root=str(tmp_path)) == first + "-3"
