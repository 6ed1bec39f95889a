"""Alibaba Cloud OSS object store, on oss2 (optional: ``pip install cachefs-dl[oss]``).

Like the S3 store: our retry loops are the only ones (oss2's iterators, which retry on their
own, are not used — pages are fetched with ``list_objects_v2`` directly), reads are hedged and
replaced when they stall (:class:`cachefs.store.retry.HedgedReads`; requests enforces the
policy's per-try ``attempt_timeout_s`` as its connect and read timeouts), and every SDK
exception is translated by exactly one function, :func:`_map_error`.

Thread safety: oss2 sends requests through a ``requests.Session``, which is not documented as
safe to share between threads, so each thread gets its own session (``threading.local``), with
two ``oss2.Bucket`` on it that differ only in their timeouts: one for reads, one for listings;
they die with their thread, and ``close()`` closes the sessions still alive.

Credentials: the ini file ``credentials_file`` (section ``[default]``, or ``[<profile>]``, with
``access_key_id`` and ``access_key_secret``) when configured, else the environment variables
``OSS_ACCESS_KEY_ID`` / ``OSS_ACCESS_KEY_SECRET``. They are sent as OSS V1 signatures and never
appear in messages or logs.
"""

from __future__ import annotations

import configparser
import functools
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TypeVar

import oss2
import oss2.exceptions
import requests.exceptions
import urllib3.exceptions

from cachefs import errors
from cachefs.store.base import ObjectInfo, StoreConfig
from cachefs.store.retry import (
    Attempt,
    HedgedReads,
    RetriedStore,
    ShortBody,
    is_throttling,
    network_failure_cause,
)
from cachefs.store.uri import check_endpoint, parse_uri

T = TypeVar("T")

#: OSS's own maximum page size for ListObjectsV2.
MAX_PAGE_SIZE = 1000
#: Connections per thread's session (each thread runs one request at a time).
_CONNECTIONS_PER_THREAD = 2
#: A read's body is taken in chunks this big; a try that lost stops at the next one.
BODY_CHUNK = 1 << 20

_TRANSIENT_CODES = frozenset({"InternalError", "ServiceUnavailable", "RequestTimeout"})
_AUTH_CODES = frozenset(
    {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "SecurityTokenExpired"}
)
_CHANGED = "the object changed in the store since the dataset snapshot (refresh the dataset)"


class OSSStore(RetriedStore):
    """An :class:`~cachefs.store.base.ObjectStore` for ``oss://bucket/prefix`` URIs.

    The endpoint comes from ``config.endpoint``, or from ``config.region`` as
    ``https://oss-<region>.aliyuncs.com``. oss2 addresses buckets virtual-hosted style
    (``bucket.endpoint-host``) except for IP/localhost endpoints, where it uses path style
    (``http://127.0.0.1:port/bucket/key``); ``config.path_style=True`` forces path style.
    ``page_size`` (1..1000) is the listing page size; only tests need to change it.
    """

    def __init__(self, config: StoreConfig, *, page_size: int = MAX_PAGE_SIZE):
        source = parse_uri(config.uri)
        if source.scheme != "oss":
            raise errors.ConfigError(
                f"OSSStore cannot open {config.uri!r}: it is not an oss:// URI"
            )
        if not 1 <= page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"page_size must be 1..{MAX_PAGE_SIZE}, not {page_size}")
        self._endpoint = _endpoint_of(config)
        self.description = f"{source} at {self._endpoint}"
        self._bucket_name = source.bucket
        self._prefix = source.prefix
        self._dataset = config.dataset
        self._retry = config.retry
        self._page_size = page_size
        policy = config.retry
        # (connect, read) for requests; the read timeout bounds every wait on the socket, for
        # the response headers and for each piece of a body.
        self._read_timeouts = (policy.attempt_timeout_s, policy.attempt_timeout_s)
        self._list_timeouts = (policy.attempt_timeout_s, policy.listing_timeout_s)
        self._path_style = bool(config.path_style)
        self._auth = oss2.Auth(*self._credentials(config))
        self._per_thread = threading.local()
        # Weak: a session goes away with its thread (worker threads come and go), and close()
        # closes whichever are still alive.
        self._sessions: weakref.WeakSet[oss2.Session] = weakref.WeakSet()
        self._sessions_lock = threading.Lock()
        self._reads = HedgedReads(self._retry, name="cachefs-oss-read")

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        full_prefix = self._prefix + prefix
        token = ""
        previous_key: str | None = None
        while True:
            page = self._call(
                f"LIST {full_prefix!r}",
                "",
                functools.partial(self._list_page, full_prefix, token),
            )
            for entry in page.object_list:
                key = entry.key[len(self._prefix) :]
                self._check_listing_order(previous_key, key)
                previous_key = key
                yield ObjectInfo(
                    key=key,
                    size=entry.size,
                    etag=entry.etag,
                    mtime_ns=entry.last_modified * 1_000_000_000,  # OSS lists whole seconds
                )
            if not page.is_truncated:
                return
            if not page.next_continuation_token:
                raise self._error(
                    errors.StoreIOError,
                    "the store sent a truncated listing without a continuation token",
                    prefix,
                )
            token = page.next_continuation_token

    def head(self, key: str) -> ObjectInfo:
        result = self._call(
            f"HEAD {key!r}", key, lambda: self._bucket().head_object(self._prefix + key)
        )
        return ObjectInfo(
            key=key,
            size=result.content_length,
            etag=result.etag,
            mtime_ns=result.last_modified * 1_000_000_000,
        )

    def get_range(self, key: str, offset: int, length: int, *, etag: str | None = None) -> bytes:
        if length == 0:
            return b""
        # "standard" makes OSS answer 416 to an unsatisfiable range instead of quietly sending
        # the whole object (its default); the length check below catches it either way.
        headers = {"x-oss-range-behavior": "standard"}
        if etag is not None:
            headers["If-Match"] = f'"{etag}"'
        byte_range = (offset, offset + length - 1)

        return self._hedged_read(
            key,
            offset,
            length,
            lambda attempt: self._get_body(key, byte_range, headers, etag, length, attempt),
        )

    def prepare_reads(self) -> None:
        """Nothing to set up ahead: the first read's session costs no more than the next."""

    def close(self) -> None:
        self._reads.close()
        with self._sessions_lock:
            sessions = list(self._sessions)
        for session in sessions:
            session.session.close()

    # --- internals --------------------------------------------------------------------------

    def _bucket(self, *, listing: bool = False) -> oss2.Bucket:
        """This thread's oss2.Bucket for reads, or for listings (created on first use)."""
        buckets = getattr(self._per_thread, "buckets", None)
        if buckets is None:
            session = oss2.Session(pool_size=_CONNECTIONS_PER_THREAD)
            buckets = {
                purpose: oss2.Bucket(
                    self._auth,
                    self._endpoint,
                    self._bucket_name,
                    session=session,
                    connect_timeout=timeouts,  # oss2 hands this to requests as (connect, read)
                    enable_crc=False,  # ranged reads carry no whole-object CRC to check against
                    is_path_style=self._path_style,
                    is_verify_object_strict=False,  # keys starting with "?" are valid objects
                )
                for purpose, timeouts in (
                    ("read", self._read_timeouts),
                    ("list", self._list_timeouts),
                )
            }
            with self._sessions_lock:
                self._sessions.add(session)
            self._per_thread.buckets = buckets
        return buckets["list" if listing else "read"]

    def _get_body(
        self,
        key: str,
        byte_range: tuple[int, int],
        headers: dict[str, str],
        etag: str | None,
        length: int,
        attempt: Attempt,
    ) -> bytes:
        """One try of a ranged GET: the body, read in chunks (at most one more than asked for,
        so that a store ignoring the Range header cannot make us swallow a whole object)."""
        result = self._bucket().get_object(
            self._prefix + key, byte_range=byte_range, headers=headers
        )
        attempt.first_byte()
        try:
            # A store that ignores If-Match must still not hand us another version's bytes.
            if etag is not None and result.etag is not None and result.etag != etag:
                raise self._error(errors.ObjectChanged, _CHANGED, key)
            chunks, received = [], 0
            while received <= length and (chunk := result.read(BODY_CHUNK)):
                attempt.check_abandoned()  # a try that lost stops here; close() drops it
                chunks.append(chunk)
                received += len(chunk)
            return b"".join(chunks)
        except requests.exceptions.ChunkedEncodingError as exc:
            # requests' name for any body that ended early (chunked or not): retry it, and
            # never hand out the partial bytes.
            cause = f"the body was cut short ({type(exc).__name__})"
            raise self._error(ShortBody, cause, key) from exc
        finally:
            result.close()  # after a whole body: back to the pool; otherwise: dropped

    def _list_page(self, full_prefix: str, token: str) -> oss2.models.ListObjectsV2Result:
        return self._bucket(listing=True).list_objects_v2(
            prefix=full_prefix, continuation_token=token, max_keys=self._page_size
        )

    def _attempt(self, key: str, sdk_call: Callable[[], T]) -> T:
        """Run one SDK call, translating whatever the SDK raises into a errors.StoreError."""
        try:
            return sdk_call()
        except (
            oss2.exceptions.OssError,
            requests.exceptions.RequestException,
            urllib3.exceptions.HTTPError,
            OSError,
        ) as exc:
            raise _map_error(exc, key=key, dataset=self._dataset, store=self.description) from exc

    def _credentials(self, config: StoreConfig) -> tuple[str, str]:
        if config.credentials_file is not None:
            return _credentials_from_file(config.credentials_file, config.profile or "default")
        key_id = os.environ.get("OSS_ACCESS_KEY_ID", "")
        secret = os.environ.get("OSS_ACCESS_KEY_SECRET", "")
        if not key_id or not secret:
            raise self._error(
                errors.StoreAuthError,
                "no OSS credentials found (set OSS_ACCESS_KEY_ID and OSS_ACCESS_KEY_SECRET, "
                "or give a credentials file)",
                "",
            )
        return key_id, secret


def _map_error(exc: Exception, *, key: str, dataset: str, store: str) -> errors.StoreError:
    """The one place where OSS SDK exceptions become cachefs store errors.

    Messages use only status codes, OSS error codes and exception class names — never the
    server's message text, which for SignatureDoesNotMatch quotes the string that was signed.
    """

    def error(kind: type[errors.StoreError], cause: str) -> errors.StoreError:
        return kind(cause, dataset=dataset, key=key, store=store)

    if isinstance(exc, oss2.exceptions.RequestError):
        # oss2 wraps the requests exception raised while sending (refused, reset, timeout).
        return error(errors.StoreUnavailable, network_failure_cause(exc))
    if isinstance(exc, oss2.exceptions.ServerError):
        status, code = int(exc.status), str(exc.code or "")
        if is_throttling(status, code):
            return error(errors.StoreThrottled, f"the store is unavailable: HTTP {status} {code}")
        if status >= 500 or code in _TRANSIENT_CODES:
            return error(errors.StoreUnavailable, f"the store is unavailable: HTTP {status} {code}")
        if status in (401, 403) or code in _AUTH_CODES:
            return error(errors.StoreAuthError, f"credentials rejected by OSS: {code or status}")
        if code == "NoSuchBucket":
            return error(errors.StoreBucketNotFound, "the bucket does not exist")
        if code == "NoSuchKey" or status == 404:
            return error(errors.ObjectNotFound, "the object does not exist in the store")
        if code == "PreconditionFailed" or status == 412:
            return error(errors.ObjectChanged, _CHANGED)
        return error(
            errors.StoreIOError, f"unexpected response from the store: HTTP {status} {code}"
        )
    if isinstance(exc, oss2.exceptions.OssError):
        # Raised by oss2 itself before or after talking to the server (ClientError and kin).
        return error(errors.StoreIOError, f"the OSS SDK failed: {type(exc).__name__}")
    # requests/urllib3/socket errors raised while reading a response body.
    return error(errors.StoreUnavailable, network_failure_cause(exc))


def _endpoint_of(config: StoreConfig) -> str:
    if config.endpoint:
        return check_endpoint(config.endpoint)
    if config.region:
        return check_endpoint(f"https://oss-{config.region}.aliyuncs.com")
    raise errors.ConfigError(
        f"OSS source {config.uri!r} needs an endpoint (e.g. https://oss-cn-hangzhou.aliyuncs.com) "
        "or a region (e.g. cn-hangzhou)"
    )


def _credentials_from_file(path: str, section: str) -> tuple[str, str]:
    """Read ``access_key_id``/``access_key_secret`` from an ini file. Errors name the file,
    section and option, never a value."""
    parser = configparser.ConfigParser(interpolation=None)
    try:
        with open(path, encoding="utf-8") as file:
            parser.read_file(file)
    except (OSError, UnicodeDecodeError, configparser.Error) as err:
        raise errors.ConfigError(
            f"cannot read the OSS credentials file {path!r}: {type(err).__name__}"
        ) from None
    values = []
    for option in ("access_key_id", "access_key_secret"):
        value = parser.get(section, option, fallback="").strip()
        if not value:
            raise errors.ConfigError(
                f"OSS credentials file {path!r} has no {option!r} in section [{section}]"
            )
        values.append(value)
    return values[0], values[1]
