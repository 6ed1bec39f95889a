"""bench/status_cost.py against a real worker: a few status requests, every figure filled."""

from __future__ import annotations

from bench.status_cost import measure


def test_status_cost_measures_a_real_worker():
    result = measure(5)
    assert result["calls"] == 5
    assert result["frozen_objects"] > 10_000  # the worker froze what it holds (tune_gc)
    assert set(result) >= {"worker_cpu_ms_per_status", "wall_ms_per_status", "machine"}
