"""The retry loops, on their own.

``call_with_retries`` is pure logic: tested with a fake clock, a recording sleep and a fixed
jitter. ``HedgedReads`` runs tries on real threads: tested with scripted tries (functions that
answer, fail or stay silent until abandoned) and no timing assertion — whatever the machine's
load, a silent try stays silent and an answering one answers. Both loops against real failing
servers are exercised in test_s3.py, test_oss.py and test_stalls.py.
"""

from __future__ import annotations

import queue
import threading
import time

import botocore.exceptions
import oss2.exceptions
import pytest
import requests.exceptions
import urllib3.exceptions

from cachefs.errors import ObjectChanged, ObjectNotFound, StoreIOError, StoreUnavailable
from cachefs.store.base import RetryPolicy
from cachefs.store.retry import (
    Attempt,
    HedgedReads,
    ShortBody,
    call_with_retries,
    check_body_length,
    network_failure_cause,
)
from cachefs.threads import LazyThreads
from tests.waiting import WAIT_S, wait_for


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


# --- HedgedReads ---------------------------------------------------------------------------


class ScriptedTries:
    """The read function for HedgedReads: try number n does ``script(n, attempt)``. Records
    which tries began and which saw themselves abandoned."""

    def __init__(self, script):
        self.script = script
        self.began: list[int] = []
        self.abandoned: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, attempt: Attempt):
        with self.lock:
            self.began.append(attempt.number)
        return self.script(attempt.number, attempt)

    def stay_silent(self, attempt: Attempt):
        """A try whose store never answers: it waits until abandoned (as a real try's socket
        timeout would end it), bounded so that a bug cannot hang the test run."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            try:
                attempt.check_abandoned()
            except Exception:
                with self.lock:
                    self.abandoned.append(attempt.number)
                raise
            time.sleep(0.01)
        raise AssertionError(f"try {attempt.number} was never abandoned")


def stalled(cause: str) -> StoreUnavailable:
    return StoreUnavailable(cause, dataset="ds", key="k", store="s3://b/")


@pytest.fixture
def hedged():
    """A factory of HedgedReads (closed after the test) with quick backoffs."""
    made: list[HedgedReads] = []

    def make(*, inline_first_try: bool = False, **policy) -> HedgedReads:
        policy = {"base_delay_s": 0.01, "max_delay_s": 0.05, **policy}
        reads = HedgedReads(
            RetryPolicy(**policy), name="test-read", inline_first_try=inline_first_try
        )
        made.append(reads)
        return reads

    yield make
    for reads in made:
        wait_until_ended(reads)
        reads.close()


def wait_until_ended(reads: HedgedReads) -> None:
    """Abandoned tries end by themselves (here: as soon as they look); wait for that."""
    wait_for(lambda: reads.in_flight == 0, "every try to end")


def call(reads: HedgedReads, tries: ScriptedTries):
    return reads.call(tries, what="GET k", stalled=stalled)


def test_a_silent_try_gets_a_hedge_and_the_first_answer_wins(hedged):
    reads = hedged(first_byte_timeout_s=2.0, deadline_s=WAIT_S)

    def script(number, attempt):
        if number == 1:
            return tries.stay_silent(attempt)
        attempt.first_byte()
        return b"answer"

    tries = ScriptedTries(script)
    assert call(reads, tries) == b"answer"
    wait_until_ended(reads)
    assert tries.began[:2] == [1, 2] and tries.abandoned == [1]


def test_an_inline_first_try_runs_on_the_calling_thread_its_head_wait_bounded(hedged):
    reads = hedged(inline_first_try=True, first_byte_timeout_s=4.0, deadline_s=WAIT_S)
    seen = []

    def script(number, attempt):
        seen.append((threading.get_ident(), attempt.head_timeout_s))
        attempt.first_byte()
        return b"answer"

    tries = ScriptedTries(script)
    assert call(reads, tries) == b"answer"
    assert tries.began == [1]
    assert seen == [(threading.get_ident(), reads.policy.hedge_after_s)]  # 2.0: half of 4
    assert reads.in_flight == 0


def test_an_inline_first_try_that_fails_is_retried_on_the_pool(hedged):
    """A transient failure of the first try (a head that did not come within its bound is
    reported as one) sends the read to the pool's threads, where the next try answers."""
    reads = hedged(inline_first_try=True, deadline_s=WAIT_S)
    seen = {}

    def script(number, attempt):
        seen[number] = (threading.get_ident(), attempt.head_timeout_s)
        if number == 1:
            raise stalled("the store did not answer in time")
        attempt.first_byte()
        return number

    tries = ScriptedTries(script)
    assert call(reads, tries) == 2
    caller = threading.get_ident()
    assert seen[1] == (caller, reads.policy.hedge_after_s)
    assert seen[2][0] != caller and seen[2][1] is None  # a pool thread, watched by the caller
    wait_until_ended(reads)


def test_a_permanent_failure_or_a_bug_in_an_inline_first_try_ends_the_read(hedged):
    reads = hedged(inline_first_try=True, deadline_s=WAIT_S)

    def gone(number, attempt):
        raise ObjectNotFound("no such key", dataset="ds", key="k", store="s3://b/")

    tries = ScriptedTries(gone)
    with pytest.raises(ObjectNotFound):
        call(reads, tries)
    assert tries.began == [1] and reads.in_flight == 0

    def bug(number, attempt):
        raise ZeroDivisionError("a bug")

    tries = ScriptedTries(bug)
    with pytest.raises(ZeroDivisionError):
        call(reads, tries)
    assert tries.began == [1] and reads.in_flight == 0


def test_a_try_that_answered_is_not_hedged_however_slow_its_body(hedged):
    # The try answers on its first line; the hedge would come 3 s after its thread took it up.
    reads = hedged(first_byte_timeout_s=6.0, deadline_s=WAIT_S)
    body_ends_at: dict[int, float] = {}

    def script(number, attempt):
        attempt.first_byte()
        # "Reads the body" until past its first-byte timeout, counted from when it began (as
        # the caller counts): a clock still running for it would have hedged or replaced it.
        body_ends_at[number] = attempt.began_at + reads.policy.attempt_timeout_s + 1.0
        while time.monotonic() < body_ends_at[number]:
            time.sleep(0.05)
        return number

    tries = ScriptedTries(script)
    assert call(reads, tries) == 1
    assert tries.began == [1]


def test_a_try_that_stalls_mid_body_is_replaced(hedged):
    reads = hedged(first_byte_timeout_s=5.0, deadline_s=WAIT_S)

    def script(number, attempt):
        attempt.first_byte()
        if number == 1:  # what the SDK raises when the body stops for the read timeout
            raise StoreUnavailable("the store did not answer in time (ReadTimeoutError)")
        return b"whole"

    tries = ScriptedTries(script)
    assert call(reads, tries) == b"whole"
    assert tries.began == [1, 2]


def test_when_every_try_stalls_the_budget_ends_the_read_in_one_line(hedged):
    # A hedge 0.25 s after the first try began, a replacement at 0.5 s, and so on: the budget
    # leaves a loaded machine seconds to start the first two tries.
    reads = hedged(attempts=1000, first_byte_timeout_s=0.5, deadline_s=6.0)
    tries = ScriptedTries(lambda number, attempt: tries.stay_silent(attempt))

    with pytest.raises(StoreUnavailable) as caught:
        call(reads, tries)

    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("dataset 'ds', s3://b/, key 'k': ")
    assert "the store did not answer within 0.5 s (gave up on GET k after " in message
    assert 1 < len(tries.began) < 1000  # the budget, not the attempts, ended it
    wait_until_ended(reads)
    assert sorted(tries.abandoned) == sorted(tries.began)  # no try left behind


def test_when_every_try_stalls_the_attempts_bound_the_tries(hedged):
    reads = hedged(attempts=3, first_byte_timeout_s=1.0, deadline_s=WAIT_S)
    tries = ScriptedTries(lambda number, attempt: tries.stay_silent(attempt))

    with pytest.raises(StoreUnavailable, match="after 3 tries in"):
        call(reads, tries)
    assert sorted(tries.began) == [1, 2, 3]


def test_a_permanent_error_of_a_hedge_ends_the_read_at_once(hedged):
    reads = hedged(first_byte_timeout_s=2.0, deadline_s=WAIT_S)

    def script(number, attempt):
        if number == 1:
            return tries.stay_silent(attempt)
        raise ObjectChanged("the object changed", key="k")

    tries = ScriptedTries(script)
    with pytest.raises(ObjectChanged):
        call(reads, tries)
    wait_until_ended(reads)
    assert tries.abandoned == [1]


def test_a_bug_in_a_try_propagates(hedged):
    reads = hedged()

    def script(number, attempt):
        raise ValueError("a bug, not the store")

    with pytest.raises(ValueError, match="a bug"):
        call(reads, ScriptedTries(script))


def test_a_body_short_on_every_try_becomes_an_io_error(hedged):
    reads = hedged(attempts=3)
    tries = ScriptedTries(
        lambda number, attempt: check_body_length(b"ab", 3, key="k", store="s", dataset="d")
    )

    with pytest.raises(StoreIOError) as caught:
        call(reads, tries)

    assert type(caught.value) is StoreIOError
    assert "after 3 tries" in str(caught.value) and tries.began == [1, 2, 3]


def test_a_body_short_once_is_retried(hedged):
    reads = hedged()
    bodies = {1: b"ab", 2: b"abc"}
    tries = ScriptedTries(
        lambda number, attempt: check_body_length(
            bodies[number], 3, key="k", store="s", dataset="d"
        )
    )

    assert call(reads, tries) == b"abc"


def test_a_closed_pool_refuses_new_reads_in_one_line(hedged):
    reads = hedged()
    reads.close()

    with pytest.raises(StoreUnavailable, match=r"key 'k': the store was closed$"):
        call(reads, ScriptedTries(lambda number, attempt: b"x"))


def test_closing_the_store_ends_waiting_reads_at_once_and_every_try_ends():
    """One pool thread: read A's try holds it (its store silent), read B's try waits in the
    pool's queue. Closing the store ends both reads at once in one line, though neither's
    budget nor first-byte timeout (an hour) is near; B's dropped try counts as ended, and A's
    ends when its (here: scripted) socket gives up."""
    reads = HedgedReads(
        RetryPolicy(first_byte_timeout_s=3600.0, deadline_s=3600.0), name="test-read", threads=1
    )
    a_began, a_socket_gives_up = threading.Event(), threading.Event()

    def hold_the_thread(number, attempt):
        a_began.set()
        assert a_socket_gives_up.wait(WAIT_S), "the test never let try A end"
        raise StoreUnavailable("the store did not answer in time (ReadTimeoutError)")

    errors: dict[str, BaseException] = {}

    def read(name: str, tries: ScriptedTries) -> None:
        try:
            call(reads, tries)
        except BaseException as exc:
            errors[name] = exc

    b_tries = ScriptedTries(lambda number, attempt: b"never run")
    readers = {
        "A": threading.Thread(target=read, args=("A", ScriptedTries(hold_the_thread))),
        "B": threading.Thread(target=read, args=("B", b_tries)),
    }
    readers["A"].start()
    assert a_began.wait(WAIT_S)
    readers["B"].start()
    wait_for(lambda: reads.in_flight == 2, "B's try to wait for the pool's thread")

    reads.close()
    for reader in readers.values():
        reader.join(WAIT_S)
        assert not reader.is_alive(), "a read still waits on a closed store"
    for name in "AB":
        assert isinstance(errors[name], StoreUnavailable)
        assert str(errors[name]) == "dataset 'ds', s3://b/, key 'k': the store was closed"
    assert b_tries.began == []
    assert reads.in_flight == 1  # A's try, still in its (blocking) SDK call
    a_socket_gives_up.set()
    wait_until_ended(reads)


# --- network_failure_cause ---------------------------------------------------------------------


def chained(*exceptions: BaseException) -> BaseException:
    """The first exception, raised while handling the second, itself while the third... (the
    way SDKs wrap the errors of the layers below them)."""
    inner: BaseException | None = None
    for exc in reversed(exceptions):
        exc.__context__ = inner
        inner = exc
    return exceptions[0]


def test_a_timeout_anywhere_in_the_chain_says_the_store_did_not_answer_in_time():
    urllib3_timeout = urllib3.exceptions.ReadTimeoutError(None, "/k", "Read timed out.")
    # botocore: its own class, holding urllib3's in kwargs["error"]
    boto = botocore.exceptions.ReadTimeoutError(endpoint_url="http://h", error=urllib3_timeout)
    # oss2: RequestError raised while handling requests' ReadTimeout, while handling urllib3's
    oss = chained(
        oss2.exceptions.RequestError(requests.exceptions.ReadTimeout("t")),
        requests.exceptions.ReadTimeout("t"),
        urllib3_timeout,
    )

    assert network_failure_cause(boto) == "the store did not answer in time (ReadTimeoutError)"
    assert network_failure_cause(oss) == "the store did not answer in time (ReadTimeoutError)"
    socket_timeout = TimeoutError("timed out")
    assert network_failure_cause(socket_timeout).endswith("did not answer in time (TimeoutError)")


def test_a_refused_connection_is_unreachable_not_a_timeout():
    # urllib3's NewConnectionError is a ConnectTimeoutError subclass: the OS error decides.
    refused = chained(
        urllib3.exceptions.NewConnectionError(None, "Failed to establish a new connection"),
        ConnectionRefusedError(111, "Connection refused"),
    )

    assert network_failure_cause(refused) == (
        "the store is unreachable: Connection refused (NewConnectionError)"
    )


class RecordingTries:
    """What the store's LazyThreads (cachefs/threads.py) run: each try records the thread that
    ran it and waits for ``go``."""

    def __init__(self):
        self.go = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.ran: list[str] = []
        self.dropped = 0

    def run(self, read, attempt, outcomes) -> None:
        with self.lock:
            self.running += 1
        assert self.go.wait(WAIT_S), "the test never let the tries end"
        with self.lock:
            self.running -= 1
            self.ran.append(threading.current_thread().name)
        outcomes.put(read(attempt))

    def drop(self) -> None:
        self.dropped += 1


def try_threads(name: str, limit: int, tries: RecordingTries) -> LazyThreads:
    return LazyThreads(limit, name, tries.run, tries.drop)


def submit_numbered(threads: LazyThreads, numbers, outcomes: queue.SimpleQueue) -> None:
    """Submit one try per number; each answers its own number into ``outcomes``."""
    for number in numbers:
        threads.submit((lambda attempt: attempt.number, Attempt(number), outcomes))


def alive(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def test_tries_past_the_thread_limit_wait_for_a_thread_and_all_run():
    tries = RecordingTries()
    threads = try_threads("test-limit", 2, tries)
    outcomes: queue.SimpleQueue = queue.SimpleQueue()
    submit_numbered(threads, range(1, 6), outcomes)

    wait_for(lambda: tries.running == 2, "two tries to run")
    assert len(alive("test-limit_")) == 2
    tries.go.set()
    assert sorted(outcomes.get(timeout=WAIT_S) for _ in range(5)) == [1, 2, 3, 4, 5]
    assert len(alive("test-limit_")) == 2
    threads.close()
    wait_for(lambda: not alive("test-limit_"), "the threads to end once closed")


def test_an_idle_thread_takes_the_next_try():
    tries = RecordingTries()
    tries.go.set()
    threads = try_threads("test-idle", 8, tries)
    outcomes: queue.SimpleQueue = queue.SimpleQueue()
    for number in range(1, 21):  # one at a time: a thread is idle each time
        submit_numbered(threads, [number], outcomes)
        assert outcomes.get(timeout=WAIT_S) == number

    assert set(tries.ran) == {"test-idle_1"}
    threads.close()
    wait_for(lambda: not alive("test-idle_"), "the thread to end once closed")


def test_closing_drops_the_tries_not_begun_and_refuses_new_ones():
    tries = RecordingTries()
    threads = try_threads("test-close", 1, tries)
    outcomes: queue.SimpleQueue = queue.SimpleQueue()
    submit_numbered(threads, range(1, 4), outcomes)
    wait_for(lambda: tries.running == 1, "the first try to run")

    threads.close()
    assert tries.dropped == 2  # the two still queued; the running one ends on its own
    with pytest.raises(RuntimeError, match="closed"):
        threads.submit((lambda attempt: 0, Attempt(9), outcomes))
    tries.go.set()
    assert outcomes.get(timeout=WAIT_S) == 1
    wait_for(lambda: not alive("test-close_"), "the thread to end once its try ended")
    assert outcomes.empty()
