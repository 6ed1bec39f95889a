"""A fake Alibaba Cloud OSS endpoint: a real HTTP server on 127.0.0.1, in-memory buckets.

Why a fake: no OSS-compatible server can run here. The real service needs the network (this
machine reaches only package registries), Alibaba ships no local/offline OSS binary, and moto
and similar emulators speak S3, whose signatures and error details differ. So ``oss2`` — the
real SDK, unmodified — is pointed at this server, which implements the part of the OSS REST
protocol that :mod:`cachefs.store.oss` uses, as documented by Alibaba and as oss2 sends it:

- **Addressing**: oss2 uses path style (``http://127.0.0.1:port/bucket/key``) for IP and
  ``localhost`` endpoints, which is all a loopback test can use (virtual-hosted
  ``bucket.host`` names would need DNS); virtual-hosted requests are refused with 400.
- **Authentication**: OSS V1 signatures, ``Authorization: OSS <AccessKeyId>:<Signature>`` with
  Signature = base64(HMAC-SHA1(secret, VERB \\n Content-MD5 \\n Content-Type \\n Date \\n
  CanonicalizedOSSHeaders + CanonicalizedResource)); the canonicalized OSS headers are the
  lower-cased ``x-oss-*`` headers sorted by name, the canonicalized resource is
  ``/bucket/key`` (decoded) plus the sorted sub-resource query parameters. An unknown key id
  gets 403 ``InvalidAccessKeyId``, a wrong signature 403 ``SignatureDoesNotMatch``, no
  signature 403 ``AccessDenied`` — as from the real service. No clock-skew check.
- **GetBucket** (ListObjects) V1 (``marker``) and V2 (``list-type=2``, ``continuation-token``,
  ``start-after``), ``prefix``, ``max-keys`` (1..1000, default 100), ``encoding-type=url``; keys
  in UTF-8 byte order. ``delimiter`` is not implemented (400).
- **HeadObject** and **GetObject** with ``Range: bytes=a-b`` / ``a-`` / ``-n``, ``If-Match``
  (412 ``PreconditionFailed``), and OSS's range leniency: an unsatisfiable range returns the
  whole object with 200 unless ``x-oss-range-behavior: standard`` asks for a 416.
- **Errors** as OSS sends them: an XML ``<Error>`` body with Code/Message/RequestId/HostId, and
  for HEAD (no body) the same XML base64-encoded in the ``x-oss-err`` header.

Objects are added by the test (``server.put(bucket, key, data)``), not over HTTP. To inject
5xx/resets/delays, put a :class:`tests.fakes.fault_proxy.FaultProxy` in front of it.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import ipaddress
import re
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit
from xml.sax.saxutils import escape

# Query parameters that are part of the signed resource (Alibaba's documented list).
_SUB_RESOURCES = frozenset(
    {
        "acl", "append", "bucketInfo", "callback", "callback-var", "cname", "comp",
        "continuation-token", "cors", "delete", "encryption", "endTime", "img", "inventory",
        "lifecycle", "live", "location", "logging", "objectMeta", "partNumber", "policy",
        "position", "qos", "referer", "replication", "replicationLocation",
        "replicationProgress", "requestPayment", "response-cache-control",
        "response-content-disposition", "response-content-encoding",
        "response-content-language", "response-content-type", "response-expires", "restore",
        "security-token", "startTime", "stat", "status", "style", "styleName", "symlink",
        "tagging", "uploadId", "uploads", "versionId", "versioning", "versions", "vod",
        "website", "x-oss-process", "x-oss-traffic-limit",
    }
)  # fmt: skip
_MAX_KEYS_LIMIT = 1000
_DEFAULT_MAX_KEYS = 100
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


@dataclass(frozen=True)
class StoredObject:
    data: bytes
    etag: str  # upper-case hex MD5, as OSS reports for simple uploads; no quotes
    last_modified: int  # whole seconds since the epoch (OSS's resolution)


class FakeOSSServer:
    """See the module docstring. Thread-safe; ``start()``/``stop()`` or use as a context."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        access_key_id: str = "cachefs-test-oss-id",
        access_key_secret: str = "cachefs-test-oss-secret",
    ):
        self.host = host
        self.port = 0
        self.access_key_id = access_key_id
        self.access_key_secret = access_key_secret
        self._secrets = {access_key_id: access_key_secret}
        self._buckets: dict[str, dict[str, StoredObject]] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The environment variables the OSS store reads its credentials from."""
        return {
            "OSS_ACCESS_KEY_ID": self.access_key_id,
            "OSS_ACCESS_KEY_SECRET": self.access_key_secret,
        }

    def start(self) -> FakeOSSServer:
        server = ThreadingHTTPServer((self.host, self.port), _OSSHandler)
        server.daemon_threads = True
        server.block_on_close = False
        server.oss = self  # type: ignore[attr-defined]
        self._server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"fake-oss-{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> FakeOSSServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --- test-side population --------------------------------------------------------------

    def create_bucket(self, bucket: str) -> None:
        with self._lock:
            self._buckets.setdefault(bucket, {})

    def put(self, bucket: str, key: str, data: bytes, *, last_modified: int | None = None) -> str:
        """Store an object (creating the bucket if needed); return its ETag (no quotes)."""
        stored = StoredObject(
            data=bytes(data),
            etag=hashlib.md5(data).hexdigest().upper(),
            last_modified=int(time.time()) if last_modified is None else last_modified,
        )
        with self._lock:
            self._buckets.setdefault(bucket, {})[key] = stored
        return stored.etag

    def delete(self, bucket: str, key: str) -> None:
        with self._lock:
            self._buckets[bucket].pop(key, None)

    # --- used by the handler ---------------------------------------------------------------

    def secret_of(self, access_key_id: str) -> str | None:
        return self._secrets.get(access_key_id)

    def bucket_keys(self, bucket: str) -> list[str] | None:
        """The bucket's keys in UTF-8 byte order, or None if there is no such bucket."""
        with self._lock:
            objects = self._buckets.get(bucket)
            keys = None if objects is None else list(objects)
        return None if keys is None else sorted(keys, key=lambda key: key.encode())

    def lookup(self, bucket: str, key: str) -> tuple[bool, StoredObject | None]:
        """(bucket exists, object or None)."""
        with self._lock:
            objects = self._buckets.get(bucket)
            return objects is not None, None if objects is None else objects.get(key)


class _OSSError(Exception):
    def __init__(self, status: int, code: str, message: str, **details: str):
        super().__init__(code)
        self.status = status
        self.code = code
        self.message = message
        self.details = details


class _OSSHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "AliyunOSS-fake"

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: one line per request would drown test output."""

    def do_GET(self) -> None:
        self._handle()

    do_HEAD = do_GET

    def do_PUT(self) -> None:
        self._handle(supported=False)

    do_POST = do_DELETE = do_PUT

    def _handle(self, *, supported: bool = True) -> None:
        self.request_id = uuid.uuid4().hex[:24].upper()
        # Drain any body so the connection stays usable for the next request.
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            if not supported:
                raise _OSSError(405, "MethodNotAllowed", "this fake serves only GET and HEAD")
            self._serve()
        except _OSSError as err:
            self._send_error(err)

    def _serve(self) -> None:
        oss: FakeOSSServer = self.server.oss  # type: ignore[attr-defined]
        bucket, key, query = self._parse_target()
        self._authenticate(oss, bucket, key, query)
        if not bucket:
            raise _OSSError(400, "InvalidRequest", "ListBuckets is not implemented by this fake")
        if not key:
            if self.command != "GET":
                raise _OSSError(405, "MethodNotAllowed", "HEAD on a bucket is not implemented")
            self._list_objects(oss, bucket, query)
            return
        exists, stored = oss.lookup(bucket, key)
        if not exists:
            raise _OSSError(
                404, "NoSuchBucket", "The specified bucket does not exist.", BucketName=bucket
            )
        if stored is None:
            raise _OSSError(404, "NoSuchKey", "The specified key does not exist.", Key=key)
        if_match = self.headers.get("If-Match")
        if if_match is not None and if_match.strip().strip('"') != stored.etag:
            raise _OSSError(
                412,
                "PreconditionFailed",
                "At least one of the pre-conditions you specified did not hold.",
                Condition="If-Match",
            )
        self._send_object(stored)

    def _parse_target(self) -> tuple[str, str, dict[str, str]]:
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]")
        if host != "localhost" and not _is_ip_address(host):
            raise _OSSError(
                400,
                "InvalidRequest",
                "virtual-hosted-style requests are not supported by this fake: use an IP endpoint",
            )
        target = urlsplit(self.path)
        bucket, _, raw_key = target.path.removeprefix("/").partition("/")
        try:
            key = unquote(raw_key, errors="strict")
            query = dict(parse_qsl(target.query, keep_blank_values=True, errors="strict"))
        except UnicodeDecodeError:
            raise _OSSError(400, "InvalidObjectName", "the key is not valid UTF-8") from None
        return bucket, key, query

    def _authenticate(self, oss: FakeOSSServer, bucket: str, key: str, query: dict) -> None:
        authorization = self.headers.get("Authorization")
        if not authorization:
            raise _OSSError(403, "AccessDenied", "You have no right to access this object.")
        scheme, _, credential = authorization.partition(" ")
        access_key_id, _, signature = credential.rpartition(":")
        if scheme != "OSS" or not access_key_id:
            raise _OSSError(400, "InvalidArgument", "only OSS V1 signatures are implemented")
        secret = oss.secret_of(access_key_id)
        if secret is None:
            raise _OSSError(
                403,
                "InvalidAccessKeyId",
                "The OSS Access Key Id you provided does not exist in our records.",
                OSSAccessKeyId=access_key_id,
            )
        string_to_sign = self._string_to_sign(bucket, key, query)
        expected = base64.b64encode(
            hmac.new(secret.encode(), string_to_sign.encode(), hashlib.sha1).digest()
        ).decode()
        if not hmac.compare_digest(expected, signature):
            raise _OSSError(
                403,
                "SignatureDoesNotMatch",
                "The request signature we calculated does not match the signature you provided.",
                StringToSign=string_to_sign,
                OSSAccessKeyId=access_key_id,
            )

    def _string_to_sign(self, bucket: str, key: str, query: dict[str, str]) -> str:
        oss_headers = sorted(
            (name.lower(), value)
            for name, value in self.headers.items()
            if name.lower().startswith("x-oss-")
        )
        canonical_headers = "".join(f"{name}:{value}\n" for name, value in oss_headers)
        sub_resources = sorted((k, v) for k, v in query.items() if k in _SUB_RESOURCES)
        resource = f"/{bucket}/{key}" if bucket else "/"
        if sub_resources:
            resource += "?" + "&".join(f"{k}={v}" if v else k for k, v in sub_resources)
        date = self.headers.get("x-oss-date") or self.headers.get("Date", "")
        return "\n".join(
            [
                self.command,
                self.headers.get("Content-MD5", ""),
                self.headers.get("Content-Type", ""),
                date,
                canonical_headers + resource,
            ]
        )

    # --- ListObjects -----------------------------------------------------------------------

    def _list_objects(self, oss: FakeOSSServer, bucket: str, query: dict[str, str]) -> None:
        keys = oss.bucket_keys(bucket)
        if keys is None:
            raise _OSSError(
                404, "NoSuchBucket", "The specified bucket does not exist.", BucketName=bucket
            )
        if query.get("delimiter"):
            raise _OSSError(400, "InvalidArgument", "delimiter is not implemented by this fake")
        encoding = query.get("encoding-type", "")
        if encoding not in ("", "url"):
            raise _OSSError(400, "InvalidArgument", "encoding-type must be 'url'")
        max_keys = _max_keys(query.get("max-keys", ""))
        prefix = query.get("prefix", "")
        version_2 = query.get("list-type") == "2"
        if version_2:
            token = query.get("continuation-token", "")
            after = _decode_token(token) if token else query.get("start-after", "")
        else:
            after = query.get("marker", "")
        matching = [k for k in keys if k.startswith(prefix) and k.encode() > after.encode()]
        page, truncated = matching[:max_keys], len(matching) > max_keys

        def text(value: str) -> str:
            return escape(quote(value, safe="") if encoding == "url" else value)

        xml = ["<?xml version='1.0' encoding='UTF-8'?>", "<ListBucketResult>"]
        xml += [f"<Name>{escape(bucket)}</Name>", f"<Prefix>{text(prefix)}</Prefix>"]
        xml += [f"<MaxKeys>{max_keys}</MaxKeys>", "<Delimiter></Delimiter>"]
        xml.append(f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>")
        if encoding:
            xml.append(f"<EncodingType>{encoding}</EncodingType>")
        if version_2:
            xml.append(f"<KeyCount>{len(page)}</KeyCount>")
            if truncated:
                next_token = _encode_token(page[-1])
                xml.append(f"<NextContinuationToken>{text(next_token)}</NextContinuationToken>")
        else:
            xml.append(f"<Marker>{text(after)}</Marker>")
            if truncated:
                xml.append(f"<NextMarker>{text(page[-1])}</NextMarker>")
        for key in page:
            _, stored = oss.lookup(bucket, key)
            if stored is None:
                continue  # deleted while we listed
            xml += [
                "<Contents>",
                f"<Key>{text(key)}</Key>",
                f"<LastModified>{_iso8601(stored.last_modified)}</LastModified>",
                f'<ETag>"{stored.etag}"</ETag>',
                "<Type>Normal</Type>",
                f"<Size>{len(stored.data)}</Size>",
                "<StorageClass>Standard</StorageClass>",
                "</Contents>",
            ]
        xml.append("</ListBucketResult>")
        self._send(200, "".join(xml).encode(), {"Content-Type": "application/xml"})

    # --- objects -----------------------------------------------------------------------------

    def _send_object(self, stored: StoredObject) -> None:
        size = len(stored.data)
        headers = {
            "Content-Type": "application/octet-stream",
            "ETag": f'"{stored.etag}"',
            "Last-Modified": email.utils.formatdate(stored.last_modified, usegmt=True),
            "Accept-Ranges": "bytes",
            "x-oss-object-type": "Normal",
        }
        byte_range = _parse_range(self.headers.get("Range"), size)
        if byte_range is None:
            status, body = 200, stored.data
        elif byte_range == "unsatisfiable":
            if self.headers.get("x-oss-range-behavior", "").lower() == "standard":
                raise _OSSError(
                    416,
                    "InvalidRange",
                    "The requested range is not satisfiable",
                    RangeRequested=self.headers.get("Range", ""),
                    ActualObjectSize=str(size),
                )
            status, body = 200, stored.data  # OSS's default: ignore a bad range
        else:
            first, last = byte_range
            status, body = 206, stored.data[first : last + 1]
            headers["Content-Range"] = f"bytes {first}-{last}/{size}"
        self._send(status, body, headers)

    # --- responses ---------------------------------------------------------------------------

    def _send_error(self, err: _OSSError) -> None:
        fields = {
            "Code": err.code,
            "Message": err.message,
            "RequestId": self.request_id,
            "HostId": self.headers.get("Host", ""),
            **err.details,
        }
        xml = "<?xml version='1.0' encoding='UTF-8'?>\n<Error>"
        xml += "".join(f"<{name}>{escape(value)}</{name}>" for name, value in fields.items())
        xml += "</Error>"
        headers = {"Content-Type": "application/xml"}
        if self.command == "HEAD":
            headers["x-oss-err"] = base64.b64encode(xml.encode()).decode()
        self._send(err.status, xml.encode(), headers)

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("x-oss-request-id", self.request_id)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _max_keys(value: str) -> int:
    if not value:
        return _DEFAULT_MAX_KEYS
    if not value.isdigit() or not 1 <= int(value) <= _MAX_KEYS_LIMIT:
        raise _OSSError(400, "InvalidArgument", f"max-keys must be 1..{_MAX_KEYS_LIMIT}")
    return int(value)


def _parse_range(header: str | None, size: int) -> tuple[int, int] | str | None:
    """(first, last) for a satisfiable single range, "unsatisfiable", or None (no Range)."""
    if header is None:
        return None
    match = _RANGE.fullmatch(header.strip())
    if match is None or match.groups() == ("", ""):
        return "unsatisfiable"
    first_text, last_text = match.groups()
    if not first_text:  # "bytes=-n": the last n bytes
        suffix = int(last_text)
        return (max(0, size - suffix), size - 1) if suffix and size else "unsatisfiable"
    first = int(first_text)
    last = min(int(last_text), size - 1) if last_text else size - 1
    return (first, last) if first <= last else "unsatisfiable"


def _encode_token(key: str) -> str:
    return base64.urlsafe_b64encode(key.encode()).decode()


def _decode_token(token: str) -> str:
    try:
        return base64.urlsafe_b64decode(token.encode()).decode()
    except ValueError:
        raise _OSSError(400, "InvalidArgument", "invalid continuation-token") from None


def _iso8601(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(seconds))
