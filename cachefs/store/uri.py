"""Parsing and validation of dataset source URIs and store endpoints.

A source URI says where a dataset's objects live:

- ``s3://bucket/prefix``  — an S3 (or S3-compatible) bucket, optionally under a key prefix;
- ``oss://bucket/prefix`` — an Alibaba Cloud OSS bucket, optionally under a key prefix;
- ``file:///abs/dir``     — a local directory.

The part after the bucket is taken *literally* as a key prefix (no percent-decoding, ``?`` and
``#`` are ordinary characters), because that is how S3 and OSS tools (``aws s3``, ``ossutil``)
read such URIs. Anything that could make the mount show a different tree than the user asked
for (``..``/``.`` segments, empty segments, control characters) is rejected with a message that
names the problem instead of being silently "cleaned up".
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from cachefs.errors import ConfigError, InvalidURI

SCHEMES = ("s3", "oss", "file")

# S3 general-purpose bucket naming rules (the same ones S3-compatible stores follow):
# 3-63 characters of lowercase letters, digits, dots and hyphens, starting and ending with a
# letter or digit, no two adjacent dots, and not shaped like an IPv4 address.
_S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# OSS bucket naming rules: 3-63 characters of lowercase letters, digits and hyphens, starting
# and ending with a letter or digit.
_OSS_BUCKET = re.compile(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]")


@dataclass(frozen=True, slots=True)
class SourceURI:
    """A parsed source URI.

    For ``s3``/``oss``: ``bucket`` is the bucket name and ``prefix`` the key prefix ("" or ending
    in "/"), ``path`` is "". For ``file``: ``path`` is the absolute directory without a trailing
    "/" (never the filesystem root itself), ``bucket`` and ``prefix`` are "".
    """

    scheme: str
    bucket: str = ""
    prefix: str = ""
    path: str = ""

    def __str__(self) -> str:
        if self.scheme == "file":
            return f"file://{self.path}"
        return f"{self.scheme}://{self.bucket}/{self.prefix}"


def parse_uri(uri: str) -> SourceURI:
    """Parse and validate a dataset source URI; raise InvalidURI saying what is wrong."""
    if not isinstance(uri, str) or not uri:
        raise InvalidURI(
            "source URI is empty: expected s3://bucket/prefix, oss://bucket/prefix "
            "or file:///absolute/dir"
        )
    _reject_control_characters(uri, what="source URI")
    scheme, sep, rest = uri.partition("://")
    scheme = scheme.lower()
    if not sep and uri.lower().startswith("file:"):
        raise InvalidURI(
            f"source URI {uri!r} is not an absolute local path: write file:///absolute/dir"
        )
    if not sep or scheme not in SCHEMES:
        raise InvalidURI(
            f"source URI {uri!r} has an unknown scheme: expected s3://, oss:// or file://"
        )
    if scheme == "file":
        return SourceURI("file", path=_parse_file_path(uri, rest))
    bucket, _, prefix = rest.partition("/")
    _check_bucket_name(uri, scheme, bucket)
    return SourceURI(scheme, bucket=bucket, prefix=_normalise_prefix(uri, prefix))


def check_endpoint(endpoint: str) -> str:
    """Validate a store endpoint URL (``http(s)://host[:port]``); return it without a trailing
    "/". Credentials embedded in the URL are refused: endpoints appear in messages and logs."""
    _reject_control_characters(endpoint, what="endpoint")
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"endpoint {endpoint!r} is not a URL like http://host:port or https://host"
        )
    if parts.username is not None or parts.password is not None:
        # Do not echo the endpoint back: the user name/password part may be a secret.
        raise ConfigError(
            "endpoint must not contain a user name or password; give credentials through "
            "the environment or a credentials file"
        )
    if parts.query or parts.fragment:
        raise ConfigError(f"endpoint {endpoint!r} must not have a query or fragment")
    try:
        parts.port  # noqa: B018 - urlsplit validates the port lazily, on access
    except ValueError as err:
        raise ConfigError(f"endpoint {endpoint!r} has an invalid port") from err
    return endpoint.rstrip("/")


def _reject_control_characters(text: str, *, what: str) -> None:
    for char in text:
        if ord(char) < 0x20 or ord(char) == 0x7F:
            name = "NUL" if char == "\0" else f"U+{ord(char):04X}"
            raise InvalidURI(f"{what} {text!r} contains the control character {name}")


def _check_bucket_name(uri: str, scheme: str, bucket: str) -> None:
    if not bucket:
        raise InvalidURI(f"source URI {uri!r} has no bucket name: expected {scheme}://bucket/...")
    if scheme == "s3":
        valid = (
            _S3_BUCKET.fullmatch(bucket) is not None
            and ".." not in bucket
            and not _is_ipv4_address(bucket)
        )
        rules = "3-63 lowercase letters, digits, '.' or '-', starting and ending with a letter or "
        rules += "digit, no '..', not an IP address"
    else:
        valid = _OSS_BUCKET.fullmatch(bucket) is not None
        rules = "3-63 lowercase letters, digits or '-', starting and ending with a letter or digit"
    if not valid:
        raise InvalidURI(
            f"source URI {uri!r}: {bucket!r} is not a valid {scheme} bucket name ({rules})"
        )


def _is_ipv4_address(name: str) -> bool:
    try:
        ipaddress.IPv4Address(name)
    except ValueError:
        return False
    return True


def _normalise_prefix(uri: str, prefix: str) -> str:
    """``"a/b"`` and ``"a/b/"`` both mean the prefix ``"a/b/"``; ``""`` means the whole bucket."""
    if not prefix:
        return ""
    segments = prefix.removesuffix("/").split("/")
    _check_segments(uri, segments, what="key prefix")
    return "/".join(segments) + "/"


def _parse_file_path(uri: str, rest: str) -> str:
    host, _, path = rest.partition("/")
    if host not in ("", "localhost"):
        raise InvalidURI(
            f"source URI {uri!r} is not an absolute local path: write file:///absolute/dir "
            "(three slashes; file URIs cannot be relative or name another host)"
        )
    if not path or path == "/":
        raise InvalidURI(f"source URI {uri!r} has no directory path: expected file:///absolute/dir")
    segments = path.removesuffix("/").split("/")
    _check_segments(uri, segments, what="path")
    return "/" + "/".join(segments)


def _check_segments(uri: str, segments: list[str], *, what: str) -> None:
    for segment in segments:
        if segment == "":
            raise InvalidURI(f"source URI {uri!r}: the {what} has an empty segment ('//')")
        if segment in (".", ".."):
            raise InvalidURI(f"source URI {uri!r}: the {what} contains a {segment!r} segment")
