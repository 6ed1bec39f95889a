"""The GET loop on a thread of its own (cachefs/store/get_thread.py), against the real loopback
scripted server of tests/unit/store/test_get_loop.py: requests from many threads come back
byte for byte to their callbacks, a request while the loop does not run and every try still
pending when it stops come back "not done", a callback that fails stops nothing. The mount's
use of it, against moto behind the fault proxy, is in tests/e2e/fs/test_read_path.py."""

from __future__ import annotations

import threading

from cachefs.store.base import RetryPolicy
from cachefs.store.get_thread import LoopGets
from tests.unit.store.test_get_loop import OBJECTS, credentials, ranged, serve
from tests.waiting import WAIT_S, wait_for

__all__ = ["credentials", "serve"]  # fixtures, shared


class Outcomes:
    """Callbacks' outcomes by tag, and an event once ``expected`` have come."""

    def __init__(self, expected: int):
        self.expected = expected
        self.got: dict[object, tuple[object, bool, str]] = {}
        self.all_in = threading.Event()
        self._lock = threading.Lock()

    def callback(self, tag: object):
        def done(body, throttled: bool) -> None:
            with self._lock:
                self.got[tag] = (bytes(body) if isinstance(body, bytearray) else body, throttled,
                                 threading.current_thread().name)  # fmt: skip
                if len(self.got) >= self.expected:
                    self.all_in.set()

        return done


def running(gets: LoopGets) -> threading.Thread:
    thread = threading.Thread(target=gets.run, name="the-loop", daemon=True)
    thread.start()
    return thread


def test_gets_from_many_threads_come_back_byte_for_byte_on_the_loops_thread(serve):
    server, reader = serve([ranged(OBJECTS)])
    gets = LoopGets(connections=4)
    thread = running(gets)
    wanted = {
        (sender, key): data[7:]
        for sender in range(4)
        for key, data in ((p.removeprefix("/bucket/"), d) for p, d in OBJECTS.items())
    }
    outcomes = Outcomes(len(wanted))

    def send(sender: int) -> None:
        for (who, key), data in wanted.items():
            if who == sender:
                gets.submit(reader, key, 7, len(data), None, outcomes.callback((who, key)))

    senders = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    for t in senders:
        t.start()
    for t in senders:
        t.join(WAIT_S)
    assert outcomes.all_in.wait(WAIT_S)
    for tag, data in wanted.items():
        assert outcomes.got[tag] == (data, False, "the-loop"), tag
    assert server.connections <= 4
    gets.stop()
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_not_running_and_tries_pending_at_the_stop_come_back_not_done(serve):
    silent = lambda _head: (b"", False)  # noqa: E731  (holds every try until the stop)
    server, reader = serve([silent], retry=RetryPolicy(first_byte_timeout_s=2 * WAIT_S))
    gets = LoopGets(connections=2)
    before = Outcomes(1)
    gets.submit(reader, "obj/0", 0, 3, None, before.callback("before"))
    assert before.got == {"before": (None, False, threading.current_thread().name)}  # at once

    thread = running(gets)
    held = Outcomes(3)
    for i in range(3):
        gets.submit(reader, f"obj/{i}", 0, 3, None, held.callback(i))
    # Two tries sent (the connections' limit), the third waiting in the loop for one.
    wait_for(lambda: len(server.requests) >= 2, "two GETs at the server")
    assert not held.got
    gets.stop()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert held.all_in.is_set()
    assert {tag: got[:2] for tag, got in held.got.items()} == {i: (None, False) for i in range(3)}

    after = Outcomes(1)
    gets.submit(reader, "obj/0", 0, 3, None, after.callback("after"))
    assert after.got["after"][:2] == (None, False)


def test_a_callback_that_fails_stops_nothing(serve, caplog):
    _server, reader = serve([ranged(OBJECTS)])
    gets = LoopGets(connections=2)
    thread = running(gets)
    called = threading.Event()

    def fails(body, throttled: bool) -> None:
        called.set()
        raise RuntimeError("a callback's bug")

    gets.submit(reader, "obj/1", 0, 10, None, fails)
    assert called.wait(WAIT_S)
    later = Outcomes(1)
    gets.submit(reader, "obj/2", 5, 10, None, later.callback("later"))
    assert later.all_in.wait(WAIT_S)
    assert later.got["later"][:2] == (OBJECTS["/bucket/obj/2"][5:15], False)
    assert "a GET's callback failed" in caplog.text
    gets.stop()
    thread.join(WAIT_S)
    assert not thread.is_alive()
