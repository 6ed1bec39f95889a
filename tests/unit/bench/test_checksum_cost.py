"""bench/checksum_cost.py runs end to end on a small workload (real TieredBlockCache on tmpfs)
and reports what it promises: CPU per GB and the share of a core, as JSON and as a table."""

from __future__ import annotations

import json

import pytest

from bench.checksum_cost import main


def test_a_small_run_reports_every_measurement(tmp_path, capsys):
    out = tmp_path / "results"
    argv = ["--total", "1MiB", "--buffer", "512KiB", "--chunk-sizes", "64KiB,128KiB"]
    assert main([*argv, "--blocks", "1", "--repeats", "1", "--out", str(out)]) == 0

    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((out / "checksum_cost.json").read_text())
    names = [(row["name"], row["chunk_size"]) for row in printed["results"]]
    assert names == [
        ("verify", 64 << 10),
        ("verify", 128 << 10),
        ("read", 128 << 10),
        ("read, check replaced by a no-op", None),
    ]
    for row in printed["results"]:
        assert row["cpu_s_per_gb"] > 0
        assert row["core_share_at_rate"] == pytest.approx(row["cpu_s_per_gb"] * 2)  # 2 GB/s
    assert printed["machine"]["cores"] >= 1
    table = (out / "checksum_cost.md").read_text()
    assert "| verification in the read path (difference) |" in table
    assert "share of a core at 2 GB/s" in table
