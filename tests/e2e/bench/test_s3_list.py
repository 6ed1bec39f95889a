"""bench/s3_list.py: a tiny run against a real lean_s3 server lists every object with both
timestamp parsers (the bench itself fails when the two listings differ) and reports both."""

from __future__ import annotations

import json

from bench.s3_list import main


def test_a_tiny_run_lists_every_object_with_both_parsers(tmp_path, capsys):
    out = tmp_path / "list.json"
    assert main(["--objects", "1500", "--repeats", "1", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["objects"] == 1500
    assert set(results["parsers"]) == {"botocore (dateutil)", "cachefs (fromisoformat)"}
    for row in results["parsers"].values():
        assert row["objects_per_s"] > 0 and row["cpu_ms_per_1000"] > 0
        assert len(row["runs"]) == 1
    assert "| cachefs (fromisoformat) |" in capsys.readouterr().out
