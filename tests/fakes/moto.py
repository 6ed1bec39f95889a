"""A real S3 HTTP endpoint for tests: moto's server in a subprocess on 127.0.0.1.

Usage (the ``moto_s3`` fixture in ``tests/conftest.py`` does this once per session)::

    server = MotoServer()
    server.start()
    bucket = server.make_bucket()            # a fresh, uniquely named bucket
    server.put(bucket, "train/a.jpg", b"...")
    env = {**os.environ, **server.env}       # credentials/region for child processes
    server.stop()

moto runs as a separate process (``python -m moto.server``), not in-process, so that the code
under test talks real HTTP over a real socket, exactly as it would to S3, and so that worker
subprocesses started by tests can reach it too. moto accepts any credentials unless
:meth:`MotoServer.require_auth` is called (see there).

moto serves roughly 200 small GETs per second on this machine: fine for correctness tests, not a
yardstick for performance.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

import boto3
from botocore.config import Config

from harness.processes import free_port  # tests import it from here too

#: Credentials and region every test process (and its children) uses with moto. moto accepts any
#: credentials by default; these are fixed so that child processes can be given the same ones.
TEST_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "cachefs-test-access-key",
    "AWS_SECRET_ACCESS_KEY": "cachefs-test-secret-key",
    "AWS_DEFAULT_REGION": "us-east-1",
}

_START_TIMEOUT_S = 60.0
_bucket_numbers = itertools.count(1)


class MotoServer:
    """One ``moto.server`` subprocess. Not thread-safe to start/stop; safe to use afterwards."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        # moto's output, kept for the error message if it fails to start; lives as long as self.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        # Replaced by require_auth(): moto then only accepts the IAM user it created.
        self._credentials = (
            TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment variables that let any boto3/botocore (this process or a child) use this
        server's credentials without touching the network beyond loopback."""
        return {
            "AWS_ACCESS_KEY_ID": self._credentials[0],
            "AWS_SECRET_ACCESS_KEY": self._credentials[1],
            "AWS_DEFAULT_REGION": TEST_CREDENTIALS["AWS_DEFAULT_REGION"],
            # Never probe the EC2 instance-metadata address (169.254.169.254) for credentials.
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def start(self) -> None:
        """Start moto on a free port and wait until it answers HTTP (bounded wait)."""
        if self._process is not None:
            raise RuntimeError("moto server already started")
        for _ in range(3):  # a port picked by free_port() can be taken before moto binds it
            self.port = free_port(self.host)
            self._process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,  # a Ctrl-C in the test run must not reach it first
            )
            if self._wait_until_ready():
                return
            self.stop()
        raise RuntimeError(f"moto server did not start; its output:\n{self._log_tail()}")

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def client(self, endpoint: str | None = None, **config: Any) -> Any:
        """A boto3 S3 client for this server (path-style, no SDK retries). ``endpoint`` sends
        its requests elsewhere, e.g. through a FaultProxy in front of this server; ``config``
        adds botocore Config options."""
        return boto3.client(
            "s3",
            endpoint_url=endpoint or self.endpoint,
            region_name=TEST_CREDENTIALS["AWS_DEFAULT_REGION"],
            aws_access_key_id=self._credentials[0],
            aws_secret_access_key=self._credentials[1],
            config=Config(
                s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}, **config
            ),
        )

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a unique name if none is given) and return its name."""
        name = name or f"test-{os.getpid()}-{next(_bucket_numbers)}"
        self.client().create_bucket(Bucket=name)
        return name

    def put(self, bucket: str, key: str, data: bytes) -> str:
        """Upload one object; return its ETag without quotes."""
        response = self.client().put_object(Bucket=bucket, Key=key, Body=data)
        return response["ETag"].strip('"')

    def require_auth(self) -> tuple[str, str]:
        """Make moto check credentials like S3 does, from now on; return the only valid pair.

        moto normally accepts any credentials. Its ``/moto-api/reset-auth`` switch makes it
        authenticate every request against its IAM backend: unknown access key ids get 403
        ``InvalidAccessKeyId``, wrong secrets 403 ``SignatureDoesNotMatch`` — the real S3 error
        responses. Before switching, this creates an IAM user allowed ``s3:*`` and returns its
        key pair, which :meth:`client`, :meth:`put` and :attr:`env` use from then on. It cannot
        be undone: use a dedicated server, not the shared session one.
        """
        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint,
            region_name=TEST_CREDENTIALS["AWS_DEFAULT_REGION"],
            aws_access_key_id=self._credentials[0],
            aws_secret_access_key=self._credentials[1],
        )
        iam.create_user(UserName="cachefs-reader")
        iam.put_user_policy(
            UserName="cachefs-reader",
            PolicyName="s3-all",
            PolicyDocument=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
                }
            ),
        )
        key = iam.create_access_key(UserName="cachefs-reader")["AccessKey"]
        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/reset-auth",
            data=b"0",  # authenticate every request from the 0th on
            headers={"Content-Type": "text/plain"},  # not a form: moto reads the raw body
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
        self._credentials = (key["AccessKeyId"], key["SecretAccessKey"])
        return self._credentials

    def _wait_until_ready(self) -> bool:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                return False  # exited: most likely the port was taken
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2) as reply:
                    reply.read()
                return True
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        return False

    def _log_tail(self) -> str:
        self._log.seek(0)
        return self._log.read()[-4000:].decode(errors="replace")
