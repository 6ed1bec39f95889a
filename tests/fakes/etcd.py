"""A real etcd for tests: Debian's ``/usr/bin/etcd`` (3.4) in a subprocess on 127.0.0.1.

Usage (the ``etcd`` fixture in ``tests/conftest.py`` does this once per session)::

    with EtcdServer() as server:
        store = EtcdStateStore([server.endpoint])   # or open_state_store(server.location)
        server.kill(); server.restart()             # a crash, then the same member again

Each server is a one-member cluster with its own data directory (removed by :meth:`stop`) and
free client and peer ports, so it never meets a system etcd on the default 2379.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from tests.fakes.moto import free_port

ETCD_BINARY = "/usr/bin/etcd"
_START_TIMEOUT_S = 20.0


class EtcdServer:
    """One etcd member. Not thread-safe to start/stop; safe to use afterwards."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.port = 0
        self.peer_port = 0
        self._dir: str | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def location(self) -> str:
        """The ``open_state_store`` location of this server."""
        return f"etcd://{self.host}:{self.port}"

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start a fresh member on free ports and wait until it serves requests (bounded)."""
        if self._dir is not None:
            raise RuntimeError("etcd server already started")
        if not os.path.exists(ETCD_BINARY):
            raise RuntimeError(f"{ETCD_BINARY} is missing: run scripts/setup.sh")
        self._dir = tempfile.mkdtemp(prefix="cachefs-etcd-")
        for _ in range(3):  # a port picked by free_port() can be taken before etcd binds it
            self.port, self.peer_port = free_port(self.host), free_port(self.host)
            self._launch()
            if self._wait_until_ready():
                return
            self.kill()
            # The half-made member remembers its ports: the next try must start from scratch.
            shutil.rmtree(os.path.join(self._dir, "data"), ignore_errors=True)
        log = self._log_tail()
        self.stop()
        raise RuntimeError(f"etcd did not start; its log:\n{log}")

    def kill(self) -> None:
        """SIGKILL the member (a crash); its data directory stays for :meth:`restart`."""
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait(timeout=10)

    def restart(self) -> None:
        """Start the member again on the same ports and data directory."""
        self.kill()
        self._launch()
        if not self._wait_until_ready():
            raise RuntimeError(f"etcd did not restart; its log:\n{self._log_tail()}")

    def stop(self) -> None:
        """Stop the member and remove its data directory."""
        self.kill()
        directory, self._dir = self._dir, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    def _launch(self) -> None:
        assert self._dir is not None
        client_url = f"http://{self.host}:{self.port}"
        peer_url = f"http://{self.host}:{self.peer_port}"
        with open(os.path.join(self._dir, "etcd.log"), "ab") as log:
            self._process = subprocess.Popen(
                [
                    ETCD_BINARY,
                    "--name=default",
                    f"--data-dir={os.path.join(self._dir, 'data')}",
                    f"--listen-client-urls={client_url}",
                    f"--advertise-client-urls={client_url}",
                    f"--listen-peer-urls={peer_url}",
                    f"--initial-advertise-peer-urls={peer_url}",
                    f"--initial-cluster=default={peer_url}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in the test run must not reach it first
            )

    def _wait_until_ready(self) -> bool:
        """Whether a range request succeeded in time: that needs an elected leader, not only
        an open port."""
        request = json.dumps({"key": base64.b64encode(b"ready").decode()}).encode()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                return False  # exited: most likely a port was taken
            try:
                urllib.request.urlopen(f"{self.endpoint}/v3/kv/range", request, timeout=2).read()
                return True
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        return False

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self._dir or "", "etcd.log"), "rb") as log:
                return log.read()[-4000:].decode(errors="replace")
        except OSError as err:
            return f"(no log: {err})"
