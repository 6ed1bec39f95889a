"""The suite's object store: moto_server behind the delay proxy, both in their own processes.

Every data path of the suite (cachefs, s3fs, rclone, direct boto3) talks to the proxy's URL,
never to moto directly, so all of them see the same first-byte latency and per-connection
bandwidth. The proxy counts the GETs it forwards (``stats()``): a pass that should not reach the
store can be checked against it.
"""

from __future__ import annotations

import os
import sys
import time

from bench.cluster_bench import s3_client
from bench.delay_proxy import fetch_stats, stats_delta
from bench.read_bench import BenchmarkFailure, MotoProcess
from harness.processes import ChildProcess, child_env, free_port

BUCKET = "cachefs-bench"


class ProxyProcess:
    """bench/delay_proxy.py in its own process (its GIL is not the readers')."""

    def __init__(self, upstream: str, delay_ms: float, log_path: str, *, bandwidth: int = 0):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.delay_ms = delay_ms
        self.bandwidth = bandwidth
        argv = [
            sys.executable, "-m", "bench.delay_proxy", "--upstream", upstream,
            "--first-byte-ms", str(delay_ms), "--bandwidth", str(bandwidth),
            "--listen", f"127.0.0.1:{port}",
        ]  # fmt: skip
        self.child = ChildProcess(argv, log_path, child_env())
        deadline = time.monotonic() + 30
        while True:
            try:
                fetch_stats(self.url, timeout=2)
                return
            except OSError as exc:
                if not self.child.alive() or time.monotonic() > deadline:
                    self.child.terminate()
                    raise BenchmarkFailure(
                        f"the delay proxy did not start ({exc}):\n{self.child.log_tail()}"
                    ) from exc
                time.sleep(0.1)

    @property
    def pid(self) -> int:
        return self.child.process.pid

    def stats(self) -> dict:
        return fetch_stats(self.url)

    def stop(self) -> None:
        self.child.terminate()


class Backend:
    """moto (in memory) + the delay proxy in front of it, one bucket; ``stop()`` ends both."""

    def __init__(self, workdir: str, *, delay_ms: float, bandwidth: int):
        os.makedirs(workdir, exist_ok=True)
        self.moto = MotoProcess(os.path.join(workdir, "moto.log"))
        try:
            self.proxy = ProxyProcess(
                self.moto.endpoint,
                delay_ms,
                os.path.join(workdir, "proxy.log"),
                bandwidth=bandwidth,
            )
        except BaseException:
            self.moto.stop()
            raise
        self.endpoint = self.proxy.url
        # Uploads go to moto directly: the proxy models reads from a remote store.
        self.upload_client = s3_client(self.moto.endpoint, pool=16)
        self.upload_client.create_bucket(Bucket=BUCKET)

    def client(self, pool: int = 16):
        """A boto3 client through the proxy (what "direct boto3 reads" use)."""
        return s3_client(self.endpoint, pool=pool)

    def stats(self) -> dict:
        return self.proxy.stats()

    @staticmethod
    def object_gets(before: dict, after: dict) -> int:
        """Object GETs the proxy forwarded between two ``stats()``."""
        return stats_delta(before, after)["object_gets"]

    def describe(self) -> dict:
        return {
            "store": "moto_server (in memory) on 127.0.0.1",
            "proxy": self.endpoint,
            "first_byte_ms": self.proxy.delay_ms,
            "bandwidth_per_connection": self.proxy.bandwidth,
        }

    def stop(self) -> None:
        try:
            self.proxy.stop()
        finally:
            self.moto.stop()
