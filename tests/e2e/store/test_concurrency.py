"""The adaptive store concurrency limit (cachefs/store/concurrency.py), step by step, and the
one classification of throttling answers it reacts to, on a real S3 endpoint (moto) behind the
fault proxy."""

from __future__ import annotations

import pytest

from cachefs.errors import StoreThrottled, StoreUnavailable
from cachefs.store import StoreConfig
from cachefs.store.base import RetryPolicy
from cachefs.store.concurrency import AdaptiveConcurrency, ConcurrencyBounds
from cachefs.store.retry import is_throttling
from cachefs.store.s3 import S3Store


def answers(limit: AdaptiveConcurrency, count: int, *, throttled: bool = False) -> None:
    for _ in range(count):
        limit.record(throttled=throttled)


def test_aimd_steps() -> None:
    limit = AdaptiveConcurrency(ConcurrencyBounds(initial=4, floor=2, ceiling=10), purpose="t")
    assert (limit.limit, limit.limiter.total_tokens) == (4, 4)
    # Slow start: one more per success, up to the ceiling.
    answers(limit, 3)
    assert (limit.limit, limit.limiter.total_tokens) == (7, 7)
    answers(limit, 10)
    assert (limit.limit, limit.peak) == (10, 10)
    # A throttling answer halves it; the answers to the requests sent before the cut (as many
    # as the old limit) cut no more, throttled or not.
    limit.record(throttled=True)
    assert (limit.limit, limit.limiter.total_tokens, limit.decreases) == (5, 5, 1)
    answers(limit, 10, throttled=True)
    assert (limit.limit, limit.decreases, limit.throttled) == (5, 1, 11)
    # Then additive increase: one more per `limit` successes in a row.
    answers(limit, 4)
    assert limit.limit == 5
    answers(limit, 1)
    assert limit.limit == 6
    answers(limit, 6)
    assert limit.limit == 7
    # Cuts never go below the floor.
    limit.record(throttled=True)
    assert limit.limit == 3
    answers(limit, 7, throttled=True)  # held: sent before the cut
    limit.record(throttled=True)
    assert (limit.limit, limit.decreases) == (2, 3)
    answers(limit, 3, throttled=True)
    limit.record(throttled=True)
    assert limit.limit == 2  # the floor
    assert limit.report() == {
        "limit": 2, "peak": 10, "in_flight": 0, "throttled": 24, "decreases": 4,
    }  # fmt: skip


def test_bounds_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="floor <= initial <= ceiling"):
        ConcurrencyBounds(initial=8, floor=2, ceiling=4)


def test_throttling_answers_are_classified_once() -> None:
    assert is_throttling(503, "SlowDown") and is_throttling(429, "")
    assert is_throttling(400, "RequestLimitExceeded") and is_throttling(403, "QpsLimitExceeded")
    assert not is_throttling(500, "InternalError") and not is_throttling(404, "NoSuchKey")
    assert issubclass(StoreThrottled, StoreUnavailable)  # retried like any transient failure


def test_the_s3_store_counts_throttled_tries(moto_s3, fault_proxy) -> None:
    bucket = moto_s3.make_bucket()
    data = bytes(range(256)) * 40
    etag = moto_s3.put(bucket, "ds/a.bin", data)
    store = S3Store(
        StoreConfig(
            f"s3://{bucket}/ds",
            endpoint=fault_proxy.url,
            retry=RetryPolicy(base_delay_s=0.01, max_delay_s=0.05),
        )
    )
    try:
        fault_proxy.fail_next(2, status=503)  # SlowDown twice: throttled
        assert store.get_range("a.bin", 10, 100, etag=etag) == data[10:110]
        assert store.throttled_tries == 2
        fault_proxy.fail_next(1, status=500)  # InternalError: retried, but not a throttle
        assert store.get_range("a.bin", 0, 5) == bytes(range(5))
        assert store.throttled_tries == 2
        assert fault_proxy.count("GET", path_contains="a.bin") == 5
    finally:
        store.close()


def run_rounds(limit: AdaptiveConcurrency, latency_of, rounds: int) -> list[int]:
    """Answer ``rounds`` windows of requests; the k-th answer of a window with ``n`` in flight
    takes ``latency_of(n, k)`` (a model of a store and of this node). The limits seen."""
    seen = []
    for _ in range(rounds):
        in_flight = limit.limit
        for k in range(in_flight):
            limit.record(throttled=False, seconds=latency_of(in_flight, k))
        seen.append(limit.limit)
    return seen


def busy_cpu(n: int, k: int) -> float:
    """A fast store (1 ms) behind a CPU that serves 3 requests at a time: the k-th answer of
    a window waits for the k // 3 batches before it."""
    return 0.001 * (1 + k // 3)


def test_requests_that_queue_here_bring_the_limit_down_and_it_settles() -> None:
    limit = AdaptiveConcurrency(ConcurrencyBounds(initial=16, floor=2, ceiling=64), purpose="t")
    seen = run_rounds(limit, busy_cpu, 40)
    assert seen[0] < 16 and limit.decreases == 0  # latency, not throttling, lowered it
    assert all(4 <= n <= 8 for n in seen[-10:]), seen
    assert limit.peak <= 32  # one round of slow start (a doubling) before the first signal


def test_a_store_far_away_keeps_its_requests_in_flight() -> None:
    """20 ms of latency whatever the count: nothing waits here, slow start runs to the
    ceiling and the limit stays there."""
    limit = AdaptiveConcurrency(ConcurrencyBounds(initial=16, floor=2, ceiling=64), purpose="t")
    seen = run_rounds(limit, lambda n, k: 0.020, 20)
    assert seen[-1] == 64 and min(seen[2:]) == 64


def test_a_store_that_gets_slower_for_good_is_not_mistaken_for_queueing() -> None:
    """The base latency is the fastest of the last rounds: once the store itself is slower
    (5 ms instead of 1 ms, nothing queued), the old base leaves the window and the limit
    grows back instead of staying down."""
    limit = AdaptiveConcurrency(ConcurrencyBounds(initial=8, floor=2, ceiling=32), purpose="t")
    run_rounds(limit, lambda n, k: 0.001, 10)
    assert limit.limit == 32
    seen = run_rounds(limit, lambda n, k: 0.005, 60)
    assert min(seen) < 32 and seen[-1] == 32, seen


def test_throttling_still_halves_a_latency_driven_limit() -> None:
    limit = AdaptiveConcurrency(ConcurrencyBounds(initial=16, floor=2, ceiling=64), purpose="t")
    run_rounds(limit, lambda n, k: 0.020, 5)
    assert limit.limit == 64
    limit.record(throttled=True, seconds=0.020)
    assert (limit.limit, limit.decreases) == (32, 1)
