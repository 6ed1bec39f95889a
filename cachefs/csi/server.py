"""The node plugin's gRPC server on its unix socket: ``cachefs csi``.

grpcio runs the calls on its own threads (a bounded pool); the main thread only waits for
SIGTERM or SIGINT, then stops the server: calls in progress get :data:`STOP_GRACE_S` to finish,
new ones are refused, and the socket file is removed. Nothing else runs in the background.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import FrameType

import grpc

from cachefs.csi import DEFAULT_KUBELET_DIR
from cachefs.csi.node import IdentityService, NodeService
from cachefs.csi.proto import csi_pb2_grpc
from cachefs.errors import ConfigError

log = logging.getLogger(__name__)

#: Calls served at once. The kubelet sends a few at a time (one per volume of a starting or
#: ending pod); each takes one control call to the worker and two mount(2) calls.
RPC_THREADS = 4
#: How long calls in progress may take to finish once SIGTERM came (the kubelet retries any
#: that did not: every call is idempotent).
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class PluginConfig:
    endpoint: str  # "unix:///csi/csi.sock": where the kubelet and the registrar call
    node: str  # the node id NodeGetInfo reports: the Kubernetes node name
    state_dir: str  # the worker's state directory, which holds its control socket
    kubelet_dir: str = DEFAULT_KUBELET_DIR


def socket_path(endpoint: str) -> str:
    """The file of a ``unix:///abs/path`` endpoint (``unix:/abs/path`` is accepted too)."""
    scheme, _, path = endpoint.partition(":")
    path = path.removeprefix("//")
    if scheme != "unix" or not os.path.isabs(path):
        raise ConfigError(f"--endpoint {endpoint}: use unix:///ABSOLUTE/PATH (a unix socket)")
    return path


def _clear_stale_socket(path: str) -> None:
    """Remove the socket a plugin that is gone left at ``path``; refuse a live one, or a path
    that is not a socket."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"--endpoint {path} exists and is not a socket: remove it first")
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # nobody listens: left by a plugin that was killed
            return
    raise ConfigError(f"--endpoint {path} is served by another process (a plugin running?)")


def serve(
    config: PluginConfig,
    stop: threading.Event,
    on_serving: Callable[[], None] = lambda: None,
) -> None:
    """Serve until ``stop`` is set, then stop cleanly. ``on_serving`` runs once the socket
    answers."""
    path = socket_path(config.endpoint)
    _clear_stale_socket(path)
    node = NodeService(node=config.node, state_dir=config.state_dir, kubelet_dir=config.kubelet_dir)
    with ThreadPoolExecutor(RPC_THREADS, thread_name_prefix="csi-call") as calls:
        server = grpc.server(calls)
        csi_pb2_grpc.add_IdentityServicer_to_server(IdentityService(), server)
        csi_pb2_grpc.add_NodeServicer_to_server(node, server)
        server.add_insecure_port(f"unix://{path}")
        server.start()
        try:
            os.chmod(path, 0o600)  # whoever reaches it can mount datasets into pods' paths
            on_serving()
            stop.wait()
        finally:
            server.stop(STOP_GRACE_S).wait()
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def run_until_signalled(config: PluginConfig, banner: str) -> None:
    """``serve`` in the foreground: SIGTERM (the kubelet stopping the pod) or SIGINT stops it.
    ``banner`` goes to stderr once the socket answers."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("%s: stopping", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve(config, stop, on_serving=lambda: print(banner, file=sys.stderr, flush=True))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
