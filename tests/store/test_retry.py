"""The retry loop is pure logic: tested with a fake clock, a recording sleep and a fixed jitter
(the real loop against real failing servers is exercised in test_s3.py and test_oss.py)."""

from __future__ import annotations

import pytest

from cachefs.errors import ObjectNotFound, StoreIOError, StoreUnavailable
from cachefs.store.base import RetryPolicy
from cachefs.store.retry import (
    ShortBody,
    call_ranged_read_with_retries,
    call_with_retries,
    check_body_length,
)


class FakeTime:
    """A clock that only moves when the code under test sleeps (or a call "takes" time)."""

    def __init__(self):
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def failing(times: int, error: Exception, result="ok", *, fake_time=None, call_s=0.0):
    """A callable that raises ``error`` ``times`` times, then returns ``result``."""
    calls = []

    def call():
        calls.append(1)
        if fake_time is not None:
            fake_time.now += call_s
        if len(calls) <= times:
            raise error
        return result

    call.calls = calls
    return call


def run(fn, policy, fake_time, jitter=1.0):
    return call_with_retries(
        fn,
        policy,
        what="GET k",
        sleep=fake_time.sleep,
        clock=fake_time.clock,
        jitter=lambda: jitter,
    )


def unavailable():
    return StoreUnavailable("HTTP 503 SlowDown", dataset="ds", key="k", store="s3://b/")


def test_success_needs_no_retry():
    fake_time = FakeTime()
    fn = failing(0, unavailable())

    assert run(fn, RetryPolicy(), fake_time) == "ok"
    assert len(fn.calls) == 1 and fake_time.sleeps == []


def test_transient_errors_are_retried_with_exponential_backoff():
    fake_time = FakeTime()
    fn = failing(3, unavailable())
    policy = RetryPolicy(attempts=5, base_delay_s=0.1, max_delay_s=5.0, deadline_s=60.0)

    assert run(fn, policy, fake_time) == "ok"
    assert len(fn.calls) == 4
    assert fake_time.sleeps == pytest.approx([0.1, 0.2, 0.4])


def test_backoff_is_capped_and_fully_jittered():
    fake_time = FakeTime()
    fn = failing(5, unavailable())
    policy = RetryPolicy(attempts=10, base_delay_s=1.0, max_delay_s=3.0, deadline_s=600.0)

    run(fn, policy, fake_time, jitter=0.5)

    assert fake_time.sleeps == pytest.approx([0.5, 1.0, 1.5, 1.5, 1.5])


def test_gives_up_after_the_attempts_reraising_the_same_kind_of_error():
    fake_time = FakeTime()
    fn = failing(100, unavailable())

    with pytest.raises(StoreUnavailable) as caught:
        run(fn, RetryPolicy(attempts=3, base_delay_s=0.1), fake_time)

    assert len(fn.calls) == 3
    err = caught.value
    assert (err.dataset, err.key, err.store) == ("ds", "k", "s3://b/")
    assert "HTTP 503 SlowDown" in str(err)
    assert "gave up on GET k after 3 tries in 0.3 s" in str(err)
    assert isinstance(err.__cause__, StoreUnavailable)


def test_gives_up_before_sleeping_past_the_deadline():
    fake_time = FakeTime()
    fn = failing(100, unavailable(), fake_time=fake_time, call_s=1.0)
    policy = RetryPolicy(attempts=100, base_delay_s=1.0, max_delay_s=1.0, deadline_s=5.0)

    with pytest.raises(StoreUnavailable, match=r"after 3 tries in 5\.0 s"):
        run(fn, policy, fake_time)

    # tries at t=0..1, 2..3, 4..5; a 4th would start after the deadline
    assert len(fn.calls) == 3 and fake_time.now - 100.0 == pytest.approx(5.0)


def test_one_attempt_means_no_retry():
    fake_time = FakeTime()

    with pytest.raises(StoreUnavailable, match="after 1 try in"):
        run(failing(1, unavailable()), RetryPolicy(attempts=1), fake_time)
    assert fake_time.sleeps == []


@pytest.mark.parametrize(
    "error", [ObjectNotFound("gone"), StoreIOError("odd"), ValueError("a bug, not the store")]
)
def test_permanent_errors_propagate_at_once(error):
    fake_time = FakeTime()
    fn = failing(1, error)

    with pytest.raises(type(error)) as caught:
        run(fn, RetryPolicy(), fake_time)

    assert caught.value is error
    assert len(fn.calls) == 1 and fake_time.sleeps == []


def test_check_body_length():
    assert check_body_length(b"abc", 3, key="k", store="s", dataset="d") == b"abc"
    with pytest.raises(ShortBody, match="sent 2 of the 3 bytes"):
        check_body_length(b"ab", 3, key="k", store="s", dataset="d")
    with pytest.raises(StoreIOError, match="ignore the Range header"):
        check_body_length(b"abcd", 3, key="k", store="s", dataset="d")


def test_a_body_short_on_every_try_becomes_an_io_error():
    calls = []

    def always_short():
        calls.append(1)
        return check_body_length(b"ab", 3, key="k", store="s", dataset="d")

    with pytest.raises(StoreIOError) as caught:
        call_ranged_read_with_retries(
            always_short, RetryPolicy(attempts=3, base_delay_s=0.0), what="GET k"
        )

    assert type(caught.value) is StoreIOError
    assert "after 3 tries" in str(caught.value) and len(calls) == 3


def test_a_body_short_once_is_retried():
    results = iter([b"ab", b"abc"])

    def short_then_whole():
        return check_body_length(next(results), 3, key="k", store="s", dataset="d")

    assert (
        call_ranged_read_with_retries(short_then_whole, RetryPolicy(base_delay_s=0.0), what="GET k")
        == b"abc"
    )
