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
