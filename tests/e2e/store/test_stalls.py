"""A stalled store at the store seam: S3Store against a real S3 endpoint (moto server) and
OSSStore against the fake OSS server (the real oss2 SDK over HTTP), each behind the fault proxy,
which holds requests — before the response, or in the middle of its body — for longer than the
read's whole budget. So a read can only succeed if a stalled try is hedged or replaced, and a
try can only end if the SDK's own timeouts (connect/read, set from the policy) are real.

No timing is asserted: each test bounds its waits generously and checks outcomes (the bytes,
the error, the requests the proxy saw, the tries still running).
"""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from cachefs.errors import ObjectChanged, StoreUnavailable
from cachefs.store.base import RetryPolicy, StoreConfig
from cachefs.store.oss import OSSStore
from cachefs.store.s3 import S3Store
from tests.fakes.fault_proxy import FaultProxy
from tests.waiting import WAIT_S, wait_for

#: Longer than any read's budget here: a stalled request answers too late to be of use.
STALL_S = 120.0
DATA = random.Random(5).randbytes(250_000)


@pytest.fixture(params=["s3", "oss"])
def world(request, monkeypatch):
    """``proxy`` in front of a real S3 or OSS endpoint, ``put(key, data) -> etag`` on the
    backend (not through the proxy), ``store(**policy)`` opening a store through the proxy
    (closed after the test) and ``etag`` of the object ``ds/f`` holding DATA."""
    if request.param == "s3":
        moto_s3 = request.getfixturevalue("moto_s3")
        bucket = moto_s3.make_bucket()
        proxy = request.getfixturevalue("fault_proxy")
        put = lambda key, data: moto_s3.put(bucket, key, data)  # noqa: E731
        uri, store_class = f"s3://{bucket}/ds", S3Store
    else:
        oss_server = request.getfixturevalue("oss_server")
        for name, value in oss_server.env.items():
            monkeypatch.setenv(name, value)
        proxy = FaultProxy(oss_server.endpoint).start()
        request.addfinalizer(proxy.stop)
        put = lambda key, data: oss_server.put("bkt", key, data)  # noqa: E731
        uri, store_class = "oss://bkt/ds", OSSStore
    opened = []

    def store(**policy):
        config = StoreConfig(uri, endpoint=proxy.url, dataset="ds", retry=RetryPolicy(**policy))
        opened.append(store_class(config))
        return opened[-1]

    etag = put("ds/f", DATA).strip('"')
    yield SimpleNamespace(proxy=proxy, put=put, store=store, etag=etag)
    proxy.clear_faults()  # lets held requests go, so the proxy stops quickly
    for opened_store in opened:
        opened_store.close()


def test_a_read_whose_first_try_stalls_is_answered_by_a_hedge(world):
    store = world.store(first_byte_timeout_s=2.0, deadline_s=30.0)
    world.proxy.stall_next(1, STALL_S)  # the first GET gets no answer within the budget

    assert store.get_range("f", 1000, 200_000, etag=world.etag) == DATA[1000:201_000]

    assert world.proxy.stalled == 1
    assert world.proxy.count("GET") >= 2  # the stalled try, and the hedge that answered


def test_a_read_that_stalls_mid_body_is_retried(world):
    store = world.store(first_byte_timeout_s=2.0, deadline_s=30.0)
    # Headers and 100 kB of the body arrive, then nothing for longer than the budget.
    world.proxy.stall_next(1, STALL_S, after_bytes=100_000)

    assert store.get_range("f", 0, 250_000, etag=world.etag) == DATA

    assert world.proxy.stalled == 1
    assert world.proxy.count("GET") >= 2


def test_every_try_carries_the_etag_precondition(world):
    """Tries stalled, then the object is rewritten, then the stalls end: neither the stalled
    tries nor their replacements may return the new version's bytes for the old etag."""
    store = world.store(attempts=1000, first_byte_timeout_s=2.0, deadline_s=WAIT_S)
    world.proxy.stall_fraction(1.0, STALL_S)
    with ThreadPoolExecutor(1) as pool:
        read = pool.submit(store.get_range, "f", 0, 1000, etag=world.etag)
        wait_for(lambda: world.proxy.stalled >= 2, "a stalled try and its hedge")
        world.put("ds/f", b"new version " * 100)
        world.proxy.clear_faults()

        with pytest.raises(ObjectChanged):
            read.result(timeout=WAIT_S)


def test_when_every_get_stalls_the_budget_ends_the_read_and_every_try_ends(world):
    store = world.store(attempts=1000, first_byte_timeout_s=1.0, deadline_s=3.0)
    world.proxy.stall_fraction(1.0, STALL_S)

    with pytest.raises(StoreUnavailable) as caught:
        store.get_range("f", 0, 1000, etag=world.etag)

    message = str(caught.value)
    assert "\n" not in message
    # The last try was abandoned here ("within 1 s") or ended by its SDK's read timeout
    # ("in time (ReadTimeoutError)"), whichever came first.
    assert re.search(
        r": the store did not answer (within 1 s|in time \(\w*Timeout\w*\)) "
        r"\(gave up on GET 'f' bytes 0\+1000 after \d+ tries in [\d.]+ s\)$",
        message,
    ), message
    # The proxy still holds every request: only the SDK's own timeouts can end the tries.
    assert world.proxy.stalled >= 2
    wait_for(lambda: store.tries_in_flight == 0, "the abandoned tries to end by their timeouts")
