"""Fixtures shared by every test package: the real servers of :mod:`tests.fakes`.

- ``moto_s3`` (session): an S3 endpoint (moto server subprocess). ``.endpoint``, ``.client()``,
  ``.make_bucket(name=None) -> name``, ``.put(bucket, key, data) -> etag``, and ``.env``: the
  credentials/region for child processes (``env={**os.environ, **moto_s3.env}``). The same
  variables are set in this process's environment for the whole session.
- ``fault_proxy`` (function): a started :class:`~tests.fakes.fault_proxy.FaultProxy` in front of
  ``moto_s3`` — point a store's endpoint at ``fault_proxy.url`` to count requests and inject
  503s, resets, delays or a dead store.
- ``oss_server`` (function): a started :class:`~tests.fakes.oss_server.FakeOSSServer`;
  ``.endpoint``, ``.put(bucket, key, data)``, ``.env`` (OSS_ACCESS_KEY_ID/SECRET).
- ``etcd`` (session): a one-member etcd 3.4 (:class:`~tests.fakes.etcd.EtcdServer`, Debian's
  ``/usr/bin/etcd``) on free ports; ``.endpoint`` (``http://127.0.0.1:port``), ``.location``
  (``etcd://127.0.0.1:port``), ``.kill()``/``.restart()`` (same data). Shared: give each test
  its own key prefix.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.fakes.etcd import ETCD_BINARY, EtcdServer
from tests.fakes.fault_proxy import FaultProxy
from tests.fakes.moto import TEST_CREDENTIALS, MotoServer
from tests.fakes.oss_server import FakeOSSServer

# No test may make botocore probe the EC2 instance-metadata address (169.254.169.254) for
# credentials: all traffic stays on loopback. Nor read the developer's own ~/.aws files.
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("AWS_CONFIG_FILE", os.devnull)
os.environ.setdefault("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
# The moto server's test credentials from the start, not only once ``moto_s3`` sets them: the
# preload fetchers are forked by multiprocessing's forkserver, which keeps the environment it
# was started with, so a test that started it first (a local-store fetch) left every later
# test's fetchers without credentials (tests/e2e/cluster/test_fetchers.py, then
# test_preload_throttling.py, failed run alone).
for _name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
    os.environ.setdefault(_name, TEST_CREDENTIALS[_name])


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoServer]:
    server = MotoServer()
    server.start()
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in server.env.items():
                patch.setenv(name, value)
            yield server
    finally:
        server.stop()


@pytest.fixture
def fault_proxy(moto_s3: MotoServer) -> Iterator[FaultProxy]:
    with FaultProxy(moto_s3.endpoint) as proxy:
        yield proxy


@pytest.fixture
def oss_server() -> Iterator[FakeOSSServer]:
    with FakeOSSServer() as server:
        yield server


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdServer]:
    if not os.path.exists(ETCD_BINARY):
        pytest.fail(f"{ETCD_BINARY} is missing (Debian's etcd-server): run scripts/setup.sh")
    with EtcdServer() as server:
        yield server
