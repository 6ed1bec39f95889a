"""S3 (and S3-compatible) object store, on botocore — the engine under boto3.

Two botocore clients per store, shared by all threads (botocore clients are thread-safe): one
for reads (GET, HEAD), whose connect and read timeouts are the policy's short per-try
``attempt_timeout_s`` — so a try that stalls before its first byte or mid-body ends by itself —
and one for LIST pages, which a big bucket may legitimately take seconds to produce
(``listing_timeout_s``). botocore's own retries are off: reads go through
:class:`cachefs.store.retry.HedgedReads` (hedged, replaced when they stall), HEAD and LIST
through :func:`cachefs.store.retry.call_with_retries`; every SDK exception is translated into
our error vocabulary by exactly one function, :func:`map_error` (an HTTP error answer by
:func:`error_for_answer`, which the lean bulk-GET client in :mod:`cachefs.store.s3_bulk` shares).

Credentials are looked up by botocore, never by us, and never appear in messages or logs:
with ``credentials_file`` and/or ``profile`` set, only that profile of that file is used (an
explicitly configured dataset must not silently pick up whatever AWS_* variables the worker
process happens to have); otherwise botocore's usual chain applies (AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY, ~/.aws, container and instance roles).
"""

from __future__ import annotations

import datetime
import enum
import functools
import logging
import os
import ssl
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar

import botocore.config
import botocore.exceptions
import botocore.loaders
import botocore.session
import botocore.utils
import urllib3.exceptions

from cachefs.errors import (
    ConfigError,
    ObjectChanged,
    ObjectNotFound,
    StoreAuthError,
    StoreBucketNotFound,
    StoreError,
    StoreIOError,
    StoreThrottled,
    StoreUnavailable,
)
from cachefs.store.base import ObjectInfo, StoreConfig
from cachefs.store.retry import (
    ATTEMPT_THREADS,
    Attempt,
    HedgedReads,
    RetriedStore,
    ShortBody,
    body_length_error,
    is_throttling,
    network_failure_cause,
)
from cachefs.store.uri import SourceURI, check_endpoint, parse_uri

if TYPE_CHECKING:  # s3_bulk imports this module: S3Store opens its reader lazily
    from cachefs.store.s3_bulk import S3BulkReader

T = TypeVar("T")

#: HTTP connections kept for reads: one per thread that may run a try.
POOL_CONNECTIONS = ATTEMPT_THREADS
#: HTTP connections kept for listings (one listing runs at a time per dataset).
LIST_POOL_CONNECTIONS = 2
#: S3's own maximum page size for ListObjectsV2.
MAX_PAGE_SIZE = 1000
#: Ranged GETs go through the lean client (cachefs/store/s3_bulk.py: botocore's signer over a
#: pooled urllib3 connection, half or less of boto3's CPU per GET) wherever it can handle the
#: source's configuration; HEAD and LIST stay on botocore. The one default; ``S3Store(...,
#: lean_gets=False)`` overrides it (benchmarks compare both).
LEAN_GETS = True

log = logging.getLogger(__name__)

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)

# Error codes that mean "the store is overloaded or hiccuping; try again later".
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "OperationAborted",
    }
)
CHANGED = "the object changed in the store since the dataset snapshot (refresh the dataset)"

# Error codes that mean "these credentials are wrong, expired or not allowed".
_AUTH_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "AccountProblem",
    }
)


class _NotOpened(enum.Enum):
    """A sentinel type (an enum, so a type checker narrows ``is _NOT_OPENED``)."""

    NOT_OPENED = enum.auto()


_NOT_OPENED: Final = _NotOpened.NOT_OPENED  # S3Store._lean before the first GET


class S3Calls(RetriedStore):
    """A store whose tries run botocore or sockets (S3Store, and the lean GET client of
    cachefs/store/s3_bulk.py): whatever they raise becomes a StoreError by :func:`map_error`."""

    def _attempt(self, key: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except (
            botocore.exceptions.BotoCoreError,
            botocore.exceptions.ClientError,
            urllib3.exceptions.HTTPError,
            OSError,
        ) as exc:
            raise map_error(exc, key=key, dataset=self._dataset, store=self.description) from exc


class S3Store(S3Calls):
    """An :class:`~cachefs.store.base.ObjectStore` for ``s3://bucket/prefix`` URIs.

    ``page_size`` (1..1000) is the ListObjectsV2 page size; only tests need to change it.
    """

    def __init__(
        self, config: StoreConfig, *, page_size: int = MAX_PAGE_SIZE, lean_gets: bool = LEAN_GETS
    ):
        source = parse_uri(config.uri)
        if source.scheme != "s3":
            raise ConfigError(f"S3Store cannot open {config.uri!r}: it is not an s3:// URI")
        if not 1 <= page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"page_size must be 1..{MAX_PAGE_SIZE}, not {page_size}")
        endpoint = check_endpoint(config.endpoint) if config.endpoint else None
        self.description = describe(source, endpoint)
        self._bucket = source.bucket
        self._prefix = source.prefix
        self._dataset = config.dataset
        self._retry = config.retry
        self._page_size = page_size
        self._client = self._call("connect", "", lambda: make_client(config, endpoint))
        self._list_client = self._call(
            "connect", "", lambda: make_client(config, endpoint, listing=True)
        )
        self._reads = HedgedReads(self._retry, name="cachefs-s3-read")
        self._config = config
        # The lean GET client once opened (_NOT_OPENED before the first GET); None: boto3.
        self._lean: S3BulkReader | Literal[_NotOpened.NOT_OPENED] | None = (
            _NOT_OPENED if lean_gets else None
        )
        self._lean_lock = threading.Lock()

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        request: dict[str, Any] = {
            "Bucket": self._bucket,
            "Prefix": self._prefix + prefix,
            "MaxKeys": self._page_size,
        }
        previous_key: str | None = None
        while True:
            page = self._call(
                f"LIST {request['Prefix']!r}",
                "",
                lambda: self._list_client.list_objects_v2(**request),
            )
            for entry in page.get("Contents", ()):
                key = entry["Key"][len(self._prefix) :]
                self._check_listing_order(previous_key, key)
                previous_key = key
                yield _object_info(key, entry["Size"], entry["ETag"], entry["LastModified"])
            if not page.get("IsTruncated"):
                return
            if not page.get("NextContinuationToken"):
                raise self._error(
                    StoreIOError,
                    "the store sent a truncated listing without a continuation token",
                    prefix,
                )
            request["ContinuationToken"] = page["NextContinuationToken"]

    def head(self, key: str) -> ObjectInfo:
        response = self._call(
            f"HEAD {key!r}",
            key,
            lambda: self._client.head_object(Bucket=self._bucket, Key=self._prefix + key),
        )
        return _object_info(
            key, response["ContentLength"], response["ETag"], response["LastModified"]
        )

    def get_range(self, key: str, offset: int, length: int, *, etag: str | None = None) -> bytes:
        if length == 0:
            return b""
        lean = self._lean_reader()
        if lean is not None:
            return lean.get_range(key, offset, length, etag=etag)
        request = {
            "Bucket": self._bucket,
            "Key": self._prefix + key,
            "Range": f"bytes={offset}-{offset + length - 1}",
        }
        if etag is not None:
            request["IfMatch"] = f'"{etag}"'

        return self._hedged_read(
            key,
            offset,
            length,
            lambda attempt: self._get_body(key, request, etag, length, attempt),
        )

    @property
    def throttled_tries(self) -> int:
        """Tries of reads the store answered "slow down" so far (the adaptive limits' signal)."""
        lean = self._lean if self._lean is not _NOT_OPENED else None
        return self._reads.throttled_tries + (lean.throttled_tries if lean else 0)

    @property
    def tries_in_flight(self) -> int:
        """Tries of reads not ended yet, abandoned ones included (they end by their timeouts)."""
        lean = self._lean if self._lean is not _NOT_OPENED else None
        return self._reads.in_flight + (lean.tries_in_flight if lean else 0)

    def close(self) -> None:
        with self._lean_lock:
            lean, self._lean = self._lean, None
        if lean is not None and lean is not _NOT_OPENED:
            lean.close()
        self._reads.close()
        self._client.close()
        self._list_client.close()

    def prepare_reads(self) -> None:
        """Open the lean GET client now: building it (a botocore client that signs a probe
        request) takes tens of ms of CPU, which the first block read after a dataset add would
        otherwise wait for."""
        try:
            self._lean_reader()
        except (StoreError, ConfigError) as exc:  # left unopened: the first GET raises it again
            log.debug("lean GET client for %s not opened yet: %s", self.description, exc)

    def opened_bulk_reader(self) -> S3BulkReader | None:
        """The lean GET client :meth:`get_range` reads through if it is open already, else
        None (boto3's GETs, or not opened yet): it never opens it, which may wait on a
        credentials provider. For callers that send its GETs themselves on a thread that must
        not block (cachefs/store/get_loop.py); the first GET through :meth:`get_range` opens
        it."""
        lean = self._lean
        return None if lean is _NOT_OPENED else lean

    def _lean_reader(self) -> S3BulkReader | None:
        """The lean GET client, opened on first use; None where it cannot serve this source
        (cachefs/store/s3_bulk.py ``_refuse_unsupported`` says when; logged once) or when
        switched off. Opening it signs one request locally (no I/O); a configuration error
        (no credentials) raises the same one-line error botocore's path would."""
        if self._lean is not _NOT_OPENED:
            return self._lean
        from cachefs.store.s3_bulk import BulkClientUnsupported, S3BulkReader  # imports us

        with self._lean_lock:
            if self._lean is _NOT_OPENED:
                try:
                    self._lean = S3BulkReader(self._config)
                except BulkClientUnsupported as why:
                    log.info("reading %s with boto3: %s", self.description, why)
                    self._lean = None
            return self._lean

    # --- internals --------------------------------------------------------------------------

    def _get_body(
        self, key: str, request: dict[str, Any], etag: str | None, length: int, attempt: Attempt
    ) -> bytes:
        """One try of a ranged GET. The body is read in one call (no copies beyond the
        socket's): a try that lost while it waited for its headers stops before it, one that
        lost while reading ends with that block, or at its read timeout if the body stalls."""
        response = self._client.get_object(**request)
        attempt.first_byte()
        body = response["Body"]  # not "with": StreamingBody.__enter__ returns the raw stream
        try:
            attempt.check_abandoned()  # close() below drops the connection, body unread
            # A store that ignores If-Match must still not hand us another version's bytes.
            returned_etag = response.get("ETag")
            if etag is not None and returned_etag is not None and returned_etag.strip('"') != etag:
                raise self._error(ObjectChanged, CHANGED, key)
            announced = response.get("ContentLength", 0)
            if announced > length:  # it ignored the Range header: never swallow a whole object
                raise body_length_error(
                    announced, length, key=key, store=self.description, dataset=self._dataset
                )
            data: bytes = body.read()  # botocore's StreamingBody carries no annotations
            return data
        except (
            botocore.exceptions.IncompleteReadError,
            botocore.exceptions.ResponseStreamingError,
        ) as exc:
            # The connection died mid-body: retry, and never hand out the partial bytes.
            cause = f"the body was cut short ({type(exc).__name__})"
            raise self._error(ShortBody, cause, key) from exc
        finally:
            body.close()


def map_error(exc: Exception, *, key: str, dataset: str, store: str) -> StoreError:
    """The one place where S3 SDK exceptions become cachefs store errors.

    Messages use only status codes, S3 error codes and exception class names — never the
    server's message text or the exception's own string, which can quote signed requests.
    """

    def error(kind: type[StoreError], cause: str) -> StoreError:
        return kind(cause, dataset=dataset, key=key, store=store)

    if isinstance(exc, botocore.exceptions.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
        return error_for_answer(status, code, key=key, dataset=dataset, store=store)
    if isinstance(
        exc, (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError)
    ):
        return error(
            StoreAuthError,
            "no usable S3 credentials found (set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, a profile or a credentials file)",
        )
    if isinstance(exc, botocore.exceptions.ProfileNotFound):
        return error(
            StoreAuthError,
            f"AWS profile {exc.kwargs.get('profile')!r} not found in "
            "the credentials or config file",
        )
    if isinstance(exc, botocore.exceptions.SSLError | urllib3.exceptions.SSLError | ssl.SSLError):
        return error(StoreIOError, "TLS handshake with the store failed (SSLError)")
    if isinstance(
        exc,
        (
            botocore.exceptions.ConnectionError,
            botocore.exceptions.HTTPClientError,
            botocore.exceptions.IncompleteReadError,
            urllib3.exceptions.HTTPError,
            OSError,
        ),
    ):
        return error(StoreUnavailable, network_failure_cause(exc))
    return error(StoreIOError, f"unexpected failure talking to the store: {type(exc).__name__}")


def describe(source: SourceURI, endpoint: str | None) -> str:
    """A store's ``description``: its URI, and the endpoint if one is set (never a secret)."""
    return f"{source} at {endpoint}" if endpoint else str(source)


def error_for_answer(status: int, code: str, *, key: str, dataset: str, store: str) -> StoreError:
    """The store error for an S3 error answer: its HTTP ``status`` and S3 error ``code`` (from
    the XML body; "" when there is none, as for HEAD)."""

    def error(kind: type[StoreError], cause: str) -> StoreError:
        return kind(cause, dataset=dataset, key=key, store=store)

    if is_throttling(status, code):
        return error(StoreThrottled, f"the store is unavailable: HTTP {status} {code}")
    if status >= 500 or code in _TRANSIENT_CODES:
        return error(StoreUnavailable, f"the store is unavailable: HTTP {status} {code}")
    if status in (401, 403) or code in _AUTH_CODES:
        return error(StoreAuthError, f"credentials rejected by S3: {code or status}")
    if code == "NoSuchBucket":
        return error(StoreBucketNotFound, "the bucket does not exist")
    if code in ("NoSuchKey", "NotFound", "404") or status == 404:
        # HEAD has no body, so S3 cannot say whether the key or the bucket is missing.
        return error(ObjectNotFound, "the object does not exist in the store")
    if code == "PreconditionFailed" or status == 412:
        return error(ObjectChanged, CHANGED)
    return error(StoreIOError, f"unexpected response from the store: HTTP {status} {code}")


@functools.cache
def _shared_loader() -> botocore.loaders.Loader:
    """botocore's model loader, one per process (what it loads is cached and never changes).
    Extra model directories come from AWS_DATA_PATH, as a session's own loader reads them."""
    return botocore.loaders.create_loader(os.environ.get("AWS_DATA_PATH"))


def make_session(config: StoreConfig) -> botocore.session.Session:
    """The botocore session whose credentials (and region) a store of ``config`` uses."""
    profile = config.profile
    if config.credentials_file is not None:
        if not os.access(config.credentials_file, os.R_OK):
            raise ConfigError(
                f"S3 credentials file {config.credentials_file!r} does not exist or is not readable"
            )
        # Naming a profile explicitly makes botocore skip the AWS_* environment variables.
        profile = profile or "default"
    session = botocore.session.Session(profile=profile)
    # Every session of the process shares one loader: a new session otherwise parses
    # botocore's JSON models again (~250 ms of CPU), and a dataset add or refresh makes several.
    session.register_component("data_loader", _shared_loader())
    # LIST pages carry a timestamp per object; botocore's default parser (dateutil) took most
    # of a page's CPU (see parse_timestamp).
    session.get_component("response_parser_factory").set_parser_defaults(
        timestamp_parser=parse_timestamp
    )
    if config.credentials_file is not None:
        session.set_config_variable("credentials_file", config.credentials_file)
    return session


def make_client(
    config: StoreConfig,
    endpoint: str | None,
    *,
    listing: bool = False,
    session: botocore.session.Session | None = None,
) -> Any:
    """A botocore S3 client: for reads (``listing=False``) or for LIST pages; from ``session``
    (default: a new :func:`make_session`)."""
    session = session or make_session(config)
    path_style = config.path_style if config.path_style is not None else endpoint is not None
    policy = config.retry
    client_config = botocore.config.Config(
        # The read timeout bounds every wait on the socket: for the response headers, and for
        # each piece of a body (a body that stalls mid-way ends its try).
        connect_timeout=policy.attempt_timeout_s,
        read_timeout=policy.listing_timeout_s if listing else policy.attempt_timeout_s,
        retries={"total_max_attempts": 1},  # ours is the only retry loop
        max_pool_connections=LIST_POOL_CONNECTIONS if listing else POOL_CONNECTIONS,
        s3={"addressing_style": "path" if path_style else "virtual"},
        # Ranged reads carry no whole-object checksum, and many S3-compatible stores reject
        # the newer checksum headers: only send/check checksums where the API demands them.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    region = config.region or session.get_config_variable("region") or "us-east-1"
    return session.create_client(
        "s3", endpoint_url=endpoint, region_name=region, config=client_config
    )


def parse_timestamp(value: str) -> datetime.datetime:
    """A timestamp of an S3 response: the ISO 8601 of XML bodies (``2026-11-28T08:53:51.000Z``,
    one per object of a LIST page) by ``datetime.fromisoformat`` (~1 µs); anything else (the
    RFC 1123 dates of headers, epoch seconds) by botocore's own parser (dateutil, ~40 µs: with
    it, timestamps took ~65 % of the CPU of listing a bucket). Naive times are UTC."""
    try:
        moment = datetime.datetime.fromisoformat(value)
    except (TypeError, ValueError):
        parsed: datetime.datetime = botocore.utils.parse_timestamp(value)
        return parsed
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=datetime.timezone.utc)


def _object_info(key: str, size: int, etag: str, last_modified: datetime.datetime) -> ObjectInfo:
    return ObjectInfo(
        key=key, size=int(size), etag=etag.strip('"'), mtime_ns=_datetime_to_ns(last_modified)
    )


def _datetime_to_ns(moment: datetime.datetime) -> int:
    # Integer arithmetic: float timestamps lose the last digits of nanosecond values.
    return (moment - _EPOCH) // datetime.timedelta(microseconds=1) * 1000
