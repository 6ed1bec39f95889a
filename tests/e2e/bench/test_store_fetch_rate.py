"""bench/store_fetch_rate.py runs end to end on a small workload (a real lean S3 endpoint, the
lean client's loop, and the worker's Preloader with real fetcher processes into a RAM tier) and
reports what it promises: GETs/s and CPU per GET of the loop; for the preload every object
fetched, its rate, and the fetcher pool's start measured apart from it, before the clock."""

from __future__ import annotations

import json

from bench.store_fetch_rate import main


def test_a_small_run_reports_the_loop_and_the_preload_with_its_fetchers_start(capsys):
    argv = ["--objects", "60", "--threads", "4", "--size", "20KB"]
    assert main([*argv, "--skip", "raw,fetcher,fetcher-boto3,preload-boto3"]) == 0

    captured = capsys.readouterr()
    results = json.loads(captured.err.strip().splitlines()[-1])
    [lean] = results["lean"]
    assert lean["in_flight"] == 4 and lean["error_count"] == 0 and lean["gets_per_s"] > 0
    preload = results["preload"]
    assert preload["blocks"] == 60 and preload["failures"] == 0
    assert preload["objects_per_s"] > 0
    # The pool was started (processes, their store clients) before the clock, and reported.
    assert preload["fetchers_start_s"] > 0 and preload["fetchers_start_cpu_s"] > 0
    assert preload["fetchers_cpu_ms_per_block"] >= 0
    assert "the fetchers' start before it" in captured.out
