"""The worker's network listeners: its TCP addresses bound before anything else is created (a
port that is taken is a one-line refusal with nothing to undo), and the HTTP servers (the
control API on its unix socket, /metrics on TCP) run with hypercorn on them."""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from cachefs.errors import ConfigError
from cachefs.settings import WorkerConfig


def bind_listeners(config: WorkerConfig) -> dict[str, socket.socket]:
    """The TCP sockets the settings ask for, by name: "metrics" (--metrics) and, in a cluster,
    "peer" (--listen). All or none: a failure closes those already bound."""
    wanted = {"metrics": ("--metrics", config.metrics_listen)}
    if config.coordinator:
        wanted["peer"] = ("--listen", config.listen)
    listeners: dict[str, socket.socket] = {}
    try:
        for name, (option, address) in wanted.items():
            if address:
                listeners[name] = bind_tcp(address, option)
    except BaseException:
        for sock in listeners.values():
            sock.close()
        raise
    return listeners


def bind_tcp(address: str, option: str) -> socket.socket:
    """A TCP socket bound to ``address`` ("HOST:PORT"; listened on by hypercorn), or a one-line
    ConfigError naming ``option``."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{option} wants HOST:PORT (e.g. 127.0.0.1:9464), got {address!r}")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        # As hypercorn sets them on the sockets it binds itself.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, int(port)))
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise ConfigError(f"cannot listen on {address} ({option}): {reason}") from None
    return sock


def dialable(address: str) -> bool:
    """Whether another machine can dial ``address`` ("HOST:PORT"): a named or specific host
    (not 0.0.0.0, ::, or empty) and a port in 1..65535."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        return False
    try:
        return not ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host != "0"  # a host name ("0" reads as 0.0.0.0 to inet_aton)


async def serve_http(
    app: Any,  # an ASGI application (FastAPI's)
    bind: str | socket.socket,
    name: str,
    shutdown_trigger: Callable[[], Awaitable[None]],
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` with hypercorn until ``shutdown_trigger()`` returns, finishing in-flight
    requests. ``bind``: "unix:PATH", or a socket already bound (:func:`bind_tcp`), handed
    over; ``name``: its logger's (cachefs.NAME)."""
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.trio import serve as hypercorn_serve

    if isinstance(bind, socket.socket):
        bind = f"fd://{bind.detach()}"  # hypercorn's socket owns the descriptor from now on
    config = HypercornConfig()
    config.bind = [bind]
    config.accesslog = None
    config.errorlog = logging.getLogger(f"cachefs.{name}")
    config.graceful_timeout = 1.0
    await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger, task_status=task_status)
