"""cachefs/fs/peer_answers.py: the wait a peer connection's task does between its calls into C,
and what becomes of the READs C handed back. Real sockets; the "READs" are plain coroutines
(the binding's handed-back handlers need a FUSE request; the real ones run in
tests/e2e/cluster/test_native_peer_reads.py)."""

from __future__ import annotations

import socket

import trio

from cachefs.fs.peer_answers import run_handed_back, wait_for_answers


async def test_a_read_pending_for_the_whole_timeout_ends_the_wait_at_once():
    here, there = socket.socketpair()
    with here, there:
        there.send(b"x")  # even with bytes to read: the answer came too late
        assert await wait_for_answers(here.fileno(), 1, 2.0, timeout_s=2.0) is False


async def test_bytes_to_read_end_the_wait():
    here, there = socket.socketpair()
    with here, there:
        there.send(b"x")
        with trio.fail_after(60):  # the wait itself is a quarter of an hour
            assert await wait_for_answers(here.fileno(), 0, 0.0, timeout_s=3600.0) is True


async def test_with_nothing_to_read_the_wait_ends_by_the_pending_reads_timeout():
    here, there = socket.socketpair()
    with here, there:
        with trio.fail_after(60):  # 0.05 s left to the oldest READ, not a quarter of 3600 s
            assert await wait_for_answers(here.fileno(), 3, 3599.95, timeout_s=3600.0) is True
        # ...and the next wait says it timed out
        assert await wait_for_answers(here.fileno(), 3, 3600.0, timeout_s=3600.0) is False


async def test_handed_back_reads_run_as_tasks_of_the_nursery():
    ran: list[int] = []

    async def read(n: int) -> None:
        ran.append(n)

    async with trio.open_nursery() as nursery:
        run_handed_back(nursery, [read(1), read(2)])
        assert ran == []  # started, not run inline
    assert sorted(ran) == [1, 2]


async def test_handed_back_reads_are_closed_unrun_when_ending():
    ran: list[int] = []

    async def read(n: int) -> None:
        ran.append(n)

    without_nursery = [read(1)]
    run_handed_back(None, without_nursery)
    async with trio.open_nursery() as nursery:
        nursery.cancel_scope.cancel()
        cancelled = [read(2)]
        run_handed_back(nursery, cancelled)
    assert ran == []
    # closed, not left pending (a coroutine never awaited would warn when collected)
    for coroutine in without_nursery + cancelled:
        assert coroutine.cr_frame is None


async def test_a_task_cancelled_on_its_own_still_has_its_handed_back_reads_run():
    """A serving process cancels a link's task when the worker closes the link; the READs its
    last receive handed back belong to readers of a mount that is still served."""
    ran: list[int] = []

    async def read(n: int) -> None:
        ran.append(n)

    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as link_scope:
            link_scope.cancel()
            run_handed_back(nursery, [read(1)])
    assert ran == [1]
