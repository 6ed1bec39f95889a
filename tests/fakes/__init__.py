"""Real servers on 127.0.0.1 that tests (and benchmarks) run the code under test against.

- :mod:`tests.fakes.moto` — moto's S3 server in a subprocess (fixture ``moto_s3``);
- :mod:`tests.fakes.fault_proxy` — a counting, fault-injecting HTTP reverse proxy
  (fixture ``fault_proxy``);
- :mod:`tests.fakes.oss_server` — a fake Alibaba OSS endpoint that checks V1 signatures
  (fixture ``oss_server``);
- :mod:`tests.fakes.wrappers` — a store wrapper that counts GETs, and ``served(app, host)``,
  hypercorn serving an ASGI app on a loopback address.

The fixtures live in ``tests/conftest.py``.
"""
