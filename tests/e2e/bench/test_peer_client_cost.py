"""bench/peer_client_cost.py runs end to end on a small workload (a real PeerClient over real
loopback TCP to the bench's stub owner process) and reports what it promises: client CPU per
block and blocks/s per round, as JSON and as a table."""

from __future__ import annotations

import json

from bench.peer_client_cost import main


def test_a_small_run_reports_every_round(tmp_path, capsys):
    out = tmp_path / "cost.json"
    argv = ["--blocks", "200", "--concurrency", "4", "--rounds", "2", "--block-bytes", "70000"]
    results = main([*argv, "--json", str(out)])

    printed = capsys.readouterr().out
    assert json.loads(out.read_text()) == results
    assert json.loads(printed[: printed.index("\n|")]) == results
    assert results["concurrency"] == 4 and results["block_bytes"] == 70_000
    assert [one["blocks"] for one in results["rounds"]] == [200, 200]
    for one in results["rounds"]:
        assert one["client_cpu_us_per_block"] > 0
        assert one["blocks_per_s"] > 0
    assert printed.count("| 200 |") == 2
