"""Ranged GETs from S3 at a fraction of boto3's client CPU: for bulk fetching (preload).

Each boto3 ``get_object`` runs botocore's whole request pipeline: parameter validation,
serialisation, the endpoint rule set, a dozen event hooks, signing, and response parsing —
several milliseconds of CPU for a 110 KB GET (``python -m bench.store_fetch_rate``), which made
boto3 the limit of a preload on a small machine. :class:`S3BulkReader` sends the same GET
itself: signed by :class:`~cachefs.store.sigv4.GetSigner` (SigV4 with the key's path signed as
sent, without path normalisation, as botocore's ``S3SigV4Auth`` does; checked against it in
tests/unit/store/test_sigv4.py), over keep-alive connections of
:class:`~cachefs.store.http1.Http1Pool` (one sendall per request, the body received straight
into its buffer: urllib3 and http.client cost ~0.5 ms of CPU per GET, botocore's signer
~0.2 ms). It only reads ranges; listings, HEADs and everything else stay on
:class:`~cachefs.store.s3.S3Store` (boto3).

What it shares with S3Store, so that both behave alike:

- the configuration: credentials, region, endpoint and addressing style are botocore's, from
  the same session and client settings (:func:`cachefs.store.s3.make_session` and
  :func:`~cachefs.store.s3.make_client`). To learn the URL and the signing scope, it lets that
  client build (and sign) one GET of a probe key and stops it before it is sent
  (``before-send``): whatever the endpoint rules decide (path or virtual-host style, regional
  names, FIPS or dual-stack endpoints set in the profile) is what it then uses for every key.
  Credentials are botocore's credentials object, frozen anew for each request, so temporary
  ones are refreshed as boto3 would;
- TLS: the CA bundle botocore would use (``ca_bundle`` / ``AWS_CA_BUNDLE``,
  ``REQUESTS_CA_BUNDLE``, else certifi's), botocore's TLS context, host names checked;
- the retries: :class:`~cachefs.store.retry.HedgedReads` under the dataset's
  :class:`~cachefs.store.base.RetryPolicy` (hedges, per-try timeouts, backoff, the same
  give-up messages), the etag sent as ``If-Match`` on every try;
- the errors: S3 error answers go through :func:`cachefs.store.s3.error_for_answer` and
  network failures (OSErrors, the HTTP client's own included) through
  :func:`cachefs.store.s3.map_error`, so a 404, a changed object, a
  "SlowDown", rejected credentials read exactly as S3Store's do.

Configurations it does not handle make the constructor raise :class:`BulkClientUnsupported`
(the caller then uses S3Store): see :func:`_refuse_unsupported`.
"""

from __future__ import annotations

import os
import re
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, quote, urlsplit

import botocore.awsrequest
import botocore.exceptions
import botocore.httpsession
import botocore.session
import botocore.utils

from cachefs.errors import ConfigError, ObjectChanged, StoreError
from cachefs.store.base import RetryPolicy, StoreConfig
from cachefs.store.http1 import BodyCutShort, Http1Pool, encode_get
from cachefs.store.retry import (
    ATTEMPT_THREADS,
    Attempt,
    HedgedReads,
    ShortBody,
    body_length_error,
)
from cachefs.store.s3 import (
    CHANGED,
    S3Calls,
    describe,
    error_for_answer,
    make_client,
    make_session,
)
from cachefs.store.sigv4 import GetSigner
from cachefs.store.uri import SourceURI, check_endpoint, parse_uri

#: The User-Agent of its requests: a store's logs (and the tests' fault proxy) tell them apart
#: from boto3's.
USER_AGENT = "cachefs-s3-bulk"
#: The key whose GET the read client builds (never sends) to learn the URL and signing scope.
PROBE_KEY = "cachefs-bulk-probe"
#: The error code in an S3 error answer's XML body (small; a regular expression is enough).
_ERROR_CODE = re.compile(rb"<Code>([^<]{1,128})</Code>")
#: How much of an error answer's body is read to find its code.
ERROR_BODY_LIMIT = 64 * 1024


class BulkClientUnsupported(Exception):
    """This store configuration needs boto3: the reason, as one line (no secrets)."""


class _Probed(Exception):
    """Stops the probe GET in ``before-send``: it has been built and signed, not sent."""


class S3BulkReader(S3Calls):
    """Ranged GETs of one ``s3://bucket/prefix`` source (keys relative to the prefix, like
    every store's). Thread-safe; :meth:`close` when done."""

    def __init__(self, config: StoreConfig):
        source = parse_uri(config.uri)
        if source.scheme != "s3":
            raise ConfigError(f"S3BulkReader cannot open {config.uri!r}: it is not an s3:// URI")
        endpoint = check_endpoint(config.endpoint) if config.endpoint else None
        self.description = describe(source, endpoint)
        self._dataset = config.dataset
        self._retry = config.retry
        self._prefix = source.prefix
        probe = self._call("connect", "", lambda: _probe(config, endpoint, source))
        self._url_start, self._path_start = probe.url_start, probe.path_start
        self._region, self._credentials = probe.region, probe.credentials
        self._signer = GetSigner(self._region)
        self._tls = probe.tls
        self._pool = Http1Pool(
            probe.url_start,
            timeout=self._retry.attempt_timeout_s,  # bounds the connect and every wait on it
            tls=probe.tls,
            max_idle=ATTEMPT_THREADS,  # one connection per thread that may run a try
        )
        # The first try of each read on the reading thread: its head wait is bounded by the pool's
        # head_timeout (Attempt.head_timeout_s), see HedgedReads.
        self._reads = HedgedReads(self._retry, name="cachefs-s3-bulk", inline_first_try=True)

    def get_range(self, key: str, offset: int, length: int, *, etag: str | None = None) -> bytes:
        """Exactly ``length`` bytes of ``key`` from ``offset``, as
        :meth:`~cachefs.store.base.ObjectStore.get_range` promises."""
        if length == 0:
            return b""
        path, headers = self._target(key, offset, length, etag)
        return self._hedged_read(
            key,
            offset,
            length,
            lambda attempt: self._get_body(key, path, headers, etag, length, attempt),
        )

    def signed_get(self, key: str, offset: int, length: int, etag: str | None) -> bytes:
        """The whole request head (signed now) of the GET :meth:`get_range` sends for these
        arguments: for a caller that sends it on a connection of its own
        (cachefs/store/get_loop.py) to :attr:`origin`."""
        path, headers = self._target(key, offset, length, etag)
        return encode_get(self._pool.host_header, path, headers + self._signature(path))

    def answer_error(self, status: int, body: bytes | bytearray, key: str) -> StoreError:
        """The error an S3 error answer (``status``, its XML ``body``) to a GET of ``key`` is:
        the very one :meth:`get_range`'s try raises for it."""
        return error_for_answer(
            status, _error_code(body), key=key, dataset=self._dataset, store=self.description
        )

    @property
    def retry(self) -> RetryPolicy:
        """The source's retry policy (its per-try bounds are the GET loop's too)."""
        return self._retry

    @property
    def origin(self) -> tuple[str, int, ssl.SSLContext | None]:
        """Where the GETs go: host, port, and the TLS context (None: plain HTTP)."""
        return self._pool.host, self._pool.port, self._tls

    def close(self) -> None:
        self._reads.close()
        self._pool.close()

    # --- internals --------------------------------------------------------------------------

    def _target(
        self, key: str, offset: int, length: int, etag: str | None
    ) -> tuple[str, list[tuple[str, str]]]:
        """The URL path and the unsigned headers of a ranged GET."""
        # Quoted as botocore quotes a key in a URL path: UTF-8, everything but "/" and "~".
        path = self._path_start + quote(self._prefix + key, safe="/~")
        headers = [
            ("Range", f"bytes={offset}-{offset + length - 1}"),
            ("User-Agent", USER_AGENT),
            ("Accept-Encoding", "identity"),  # no header would allow any content coding
        ]
        if etag is not None:
            headers.append(("If-Match", f'"{etag}"'))
        return path, headers

    def _signature(self, path: str) -> list[tuple[str, str]]:
        # Frozen per request: refreshable (temporary) credentials renew themselves here.
        credentials = self._credentials.get_frozen_credentials()
        return self._signer.headers(
            host=self._pool.host_header,
            path=path,
            access_key=credentials.access_key,
            secret_key=credentials.secret_key,
            token=credentials.token,
        )

    def _get_body(
        self,
        key: str,
        path: str,
        headers: list[tuple[str, str]],
        etag: str | None,
        length: int,
        attempt: Attempt,
    ) -> bytes:
        """One try: sign, send, check the answer's headers, read its body in one call."""
        signature = self._signature(path)
        # The headers first: a lost try stops before the body.
        response = self._pool.get(path, headers + signature, head_timeout=attempt.head_timeout_s)
        attempt.first_byte()
        complete = False
        try:
            attempt.check_abandoned()
            if response.status >= 300:
                raise self.answer_error(response.status, response.read(ERROR_BODY_LIMIT), key)
            # A store that ignores If-Match must still not hand us another version's bytes.
            returned_etag = response.headers.get("etag")
            if etag is not None and returned_etag is not None and returned_etag.strip('"') != etag:
                raise self._error(ObjectChanged, CHANGED, key)
            announced = int(response.headers.get("content-length", 0))
            if announced > length:  # it ignored the Range header: never swallow a whole object
                raise body_length_error(
                    announced, length, key=key, store=self.description, dataset=self._dataset
                )
            try:
                body = response.read()
            except BodyCutShort as exc:
                # The connection died mid-body (IncompleteRead is one): retry, never hand out
                # the partial bytes.
                cause = f"the body was cut short ({type(exc).__name__})"
                raise self._error(ShortBody, cause, key) from exc
            complete = True
            return body
        finally:
            if not complete:
                response.close()  # unread bytes: this connection cannot carry another request


@dataclass(frozen=True, slots=True)
class _Probe:
    """What the probe GET taught: where requests go, how they are signed, over what TLS."""

    url_start: str  # scheme://host[:port]
    path_start: str  # the URL path before the (quoted) key: "/bucket/" or "/"
    region: str  # the signing region
    credentials: Any  # botocore's credentials object (refreshable ones renew themselves)
    tls: ssl.SSLContext | None  # for https: verifying as botocore does; None for http


def _probe(config: StoreConfig, endpoint: str | None, source: SourceURI) -> _Probe:
    """Let a botocore client set up exactly as S3Store's build and sign a GET of a probe key
    (stopped before it is sent), and read the URL and signing scope off it."""
    session = make_session(config)
    client = make_client(config, endpoint, session=session)
    probed: list[botocore.awsrequest.AWSPreparedRequest] = []

    def stop(request: botocore.awsrequest.AWSPreparedRequest, **_: Any) -> None:
        probed.append(request)
        raise _Probed

    client.meta.events.register_first("before-send.s3.GetObject", stop)
    try:
        client.get_object(Bucket=source.bucket, Key=source.prefix + PROBE_KEY)
    except _Probed:
        pass
    finally:
        client.close()
    request = probed[0]
    url = urlsplit(request.url)
    quoted_key = quote(source.prefix + PROBE_KEY, safe="/~")
    authorization = request.headers.get("Authorization", b"")
    if isinstance(authorization, bytes):  # prepared requests hold their headers encoded
        authorization = authorization.decode("ascii", "replace")
    scope = re.match(
        r"AWS4-HMAC-SHA256 Credential=[^/]+/\d{8}/([^/]+)/([^/]+)/aws4_request,", authorization
    )
    _refuse_unsupported(request, url, quoted_key, scope)
    assert scope is not None  # _refuse_unsupported refused a request without one
    return _Probe(
        url_start=f"{url.scheme}://{url.netloc}",
        path_start=url.path[: -len(quoted_key)],
        region=scope.group(1),
        credentials=session.get_credentials(),
        tls=_tls_context(session) if url.scheme == "https" else None,
    )


def _refuse_unsupported(
    request: botocore.awsrequest.AWSPreparedRequest,
    url: SplitResult,
    quoted_key: str,
    scope: re.Match[str] | None,
) -> None:
    """Raise :class:`BulkClientUnsupported` for what this client does not reproduce of
    botocore's GET; the fetchers then use S3Store (boto3), which handles them all."""
    # An HTTP(S) proxy from the environment: botocore tunnels through it (CONNECT, proxy
    # authentication, no_proxy rules); this client connects directly only.
    if botocore.utils.get_environ_proxies(request.url).get(url.scheme):
        raise BulkClientUnsupported("an HTTP proxy is configured for the endpoint")
    # Anything but plain SigV4 for the "s3" service: S3 Express One Zone's session auth,
    # multi-region access points (SigV4a), Outposts ("s3-outposts"), SigV2 forced in a profile.
    if scope is None or scope.group(2) != "s3":
        raise BulkClientUnsupported("the store's requests are not signed with plain SigV4 for s3")
    # A URL that is not "where the key goes" + the quoted key (a query string, say): the
    # endpoint rules built something this client would not rebuild per key.
    if url.query or not url.path.endswith(quoted_key):
        raise BulkClientUnsupported("the store's GET URL is not of the form endpoint + key")


def _tls_context(session: botocore.session.Session) -> ssl.SSLContext:
    """A TLS context that verifies as botocore does: botocore's context (protocol versions,
    ciphers), certificates and host names checked against the CA bundle from the profile
    (``ca_bundle``, ``AWS_CA_BUNDLE``), else ``REQUESTS_CA_BUNDLE``, else certifi's; a bundle
    that is a directory is a CA directory."""
    verify = (
        session.get_config_variable("ca_bundle") or os.environ.get("REQUESTS_CA_BUNDLE") or True
    )
    ca_path = botocore.httpsession.get_cert_path(verify)
    # botocore carries no annotations: its context is an ssl.SSLContext.
    context: ssl.SSLContext = botocore.httpsession.create_urllib3_context()
    context.verify_mode = ssl.CERT_REQUIRED
    context.check_hostname = True
    if os.path.isdir(ca_path):
        context.load_verify_locations(capath=ca_path)
    else:
        context.load_verify_locations(cafile=ca_path)
    return context


def _error_code(body: bytes | bytearray) -> str:
    """The <Code> of an S3 error answer's XML body ("" when there is none)."""
    match = _ERROR_CODE.search(body)
    return match.group(1).decode("utf-8", "replace") if match else ""
