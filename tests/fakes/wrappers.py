"""Test wrappers around real parts: a store that counts (and can slow or fail) its GETs, and a
real hypercorn server for an ASGI app on a chosen loopback address."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from cachefs.errors import StoreUnavailable


class CountingStore:
    """Delegates to a real store; counts get_range calls and can delay or fail them."""

    def __init__(self, inner, delay_s: float = 0.0):
        self.inner = inner
        self.delay_s = delay_s
        self.fail = False
        self.gets = 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get_range(self, key, offset, length, *, etag=None):
        with self._lock:
            self.gets += 1
        time.sleep(self.delay_s)
        if self.fail:
            raise StoreUnavailable("injected failure", key=key)
        return self.inner.get_range(key, offset, length, etag=etag)


@asynccontextmanager
async def served(app, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """Serve ``app`` with hypercorn's trio server on a free port; yield "host:port"."""
    config = Config()
    config.bind = [f"{host}:0"]
    config.accesslog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(serve, app, config, shutdown_trigger=trio.sleep_forever)
        )
        yield binds[0].removeprefix("http://")
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def served_peer(serve_block, host: str = "127.0.0.1", **kwargs) -> AsyncIterator[str]:
    """A real PeerServer (the worker's block server) for ``serve_block`` on a free port of
    ``host``; yield "host:port"."""
    import socket

    from cachefs.peer.server import PeerServer

    server = PeerServer(serve_block, kwargs.pop("token", "s3cret-token"), **kwargs)
    sock = socket.socket()
    sock.bind((host, 0))
    address = f"{host}:{sock.getsockname()[1]}"
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, sock)
        yield address
        nursery.cancel_scope.cancel()
