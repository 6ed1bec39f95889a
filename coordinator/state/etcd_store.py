"""The replicated state store: etcd v3 through its HTTP/JSON gateway.

The gateway (``POST /v3/kv/...``, on by default in etcd 3.4) needs nothing but httpx, which the
coordinator already uses; no gRPC stack or etcd client package. Keys and values travel as
base64 in JSON, and, as protobuf's JSON mapping goes, fields that are zero, false or empty are
left out of replies. etcd limits a request to 1.5 MiB by default (``--max-request-bytes``).
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import httpx

from cachefs.errors import ConfigError

from .base import StateStoreError

T = TypeVar("T")
Reply = dict[str, Any]


class EtcdStateStore:
    """A :class:`~coordinator.state.base.StateStore` in etcd, every key under ``prefix``.

    ``endpoints`` are the gateway URLs of the cluster's members (``http://host:2379``). A
    request that cannot connect is tried on the next member, and the one that answered is used
    first from then on; any other failure (a timeout, an error reply) is raised at once,
    because the request may have been applied. The atomic methods are etcd transactions.
    """

    def __init__(self, endpoints: list[str], *, prefix: str = "/cachefs/", timeout_s: float = 5.0):
        if not endpoints:
            raise ConfigError("etcd state store: no endpoint given")
        self._endpoints = [endpoint.rstrip("/") for endpoint in endpoints]
        self._prefix = prefix.encode()
        self._current = 0  # index of the endpoint that answered last
        self.where = "etcd:" + ",".join(_without_credentials(e) for e in self._endpoints)
        # etcd is cluster-internal: proxies configured in the environment would only get in
        # the way (or see the traffic).
        self._client = httpx.Client(timeout=timeout_s, trust_env=False)

    def get(self, key: str) -> bytes | None:
        def parse(reply: Reply) -> bytes | None:
            kvs = reply.get("kvs", [])
            return _decode(kvs[0].get("value", "")) if kvs else None

        return self._call("range", {"key": self._key(key)}, parse)

    def put(self, key: str, value: bytes) -> None:
        self._call("put", {"key": self._key(key), "value": _encode(value)}, lambda _reply: None)

    def delete(self, key: str) -> bool:
        return self._call(
            "deleterange", {"key": self._key(key)}, lambda reply: int(reply.get("deleted", 0)) > 0
        )

    def list(self, prefix: str) -> list[tuple[str, bytes]]:
        start = self._prefix + prefix.encode()
        skip = len(self._prefix)

        def parse(reply: Reply) -> list[tuple[str, bytes]]:
            return [
                (_decode(kv["key"])[skip:].decode(), _decode(kv.get("value", "")))
                for kv in reply.get("kvs", [])
            ]

        request = {
            "key": _encode(start),
            "range_end": _encode(_prefix_end(start)),
            "sort_order": "ASCEND",
            "sort_target": "KEY",
        }
        return self._call("range", request, parse)

    def put_if_absent(self, key: str, value: bytes) -> bool:
        return self._put_if(key, {"target": "CREATE", "create_revision": "0"}, value)

    def compare_and_put(self, key: str, expected: bytes | None, value: bytes) -> bool:
        if expected is None:
            return self.put_if_absent(key, value)
        # etcd fails a VALUE comparison on a missing key, as it should here.
        return self._put_if(key, {"target": "VALUE", "value": _encode(expected)}, value)

    def close(self) -> None:
        self._client.close()

    def _key(self, key: str) -> str:
        return _encode(self._prefix + key.encode())

    def _put_if(self, key: str, compare: Reply, value: bytes) -> bool:
        """Put ``value`` in one transaction if ``compare`` holds for ``key``; whether it did."""
        request = {
            "compare": [{"key": self._key(key), "result": "EQUAL", **compare}],
            "success": [{"request_put": {"key": self._key(key), "value": _encode(value)}}],
        }
        return self._call("txn", request, lambda reply: bool(reply.get("succeeded", False)))

    def _call(self, method: str, request: Reply, parse: Callable[[Reply], T]) -> T:
        """POST ``request`` to ``/v3/kv/<method>`` and ``parse`` the reply; a reply that does
        not parse (bad base64, missing fields) is a StateStoreError like any other failure."""
        reply = self._post(method, request)
        try:
            return parse(reply)
        except (KeyError, TypeError, ValueError) as err:  # ValueError covers base64 and UTF-8
            raise StateStoreError(
                f"{self.where}: cannot decode etcd's reply to {method}: {err!r}"
            ) from err

    def _post(self, method: str, request: Reply) -> Reply:
        unreachable = []
        for attempt in range(len(self._endpoints)):
            index = (self._current + attempt) % len(self._endpoints)
            endpoint = self._endpoints[index]
            try:
                response = self._client.post(f"{endpoint}/v3/kv/{method}", json=request)
            except (httpx.ConnectError, httpx.ConnectTimeout) as err:
                unreachable.append(f"{_without_credentials(endpoint)}: {_describe(err)}")
                continue
            except httpx.HTTPError as err:
                raise StateStoreError(
                    f"etcd at {_without_credentials(endpoint)}: {method} failed: {_describe(err)}"
                ) from err
            self._current = index
            return self._reply(method, endpoint, response)
        raise StateStoreError(f"etcd: cannot reach any endpoint ({'; '.join(unreachable)})")

    def _reply(self, method: str, endpoint: str, response: httpx.Response) -> Reply:
        try:
            reply = response.json()
        except ValueError:
            reply = None
        if response.status_code != 200:
            # The gateway reports gRPC errors as {"error": ..., "message": ..., "code": ...}.
            if isinstance(reply, dict):
                detail = reply.get("message") or reply.get("error") or response.text
            else:
                detail = response.text
            raise StateStoreError(
                f"etcd at {_without_credentials(endpoint)}: {method} refused "
                f"(HTTP {response.status_code}): {str(detail)[:500]}"
            )
        if not isinstance(reply, dict):
            raise StateStoreError(
                f"etcd at {_without_credentials(endpoint)}: the reply to {method} is not a "
                "JSON object"
            )
        return reply


def _encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _decode(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


def _prefix_end(start: bytes) -> bytes:
    """etcd's ``range_end`` for "every key starting with ``start``": the smallest key after all
    of them (the last byte below 0xff incremented), or b"\\0", which etcd reads as "to the end"."""
    stem = start.rstrip(b"\xff")
    return stem[:-1] + bytes([stem[-1] + 1]) if stem else b"\0"


def _without_credentials(url: str) -> str:
    """``url`` without any ``user:password@``, for messages."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def _describe(err: Exception) -> str:
    """``Name: message`` (httpx's timeouts have empty messages)."""
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
