"""Source URI parsing and endpoint validation: a table of accepted and rejected inputs."""

from __future__ import annotations

import re

import pytest

from cachefs.errors import ConfigError, InvalidURI
from cachefs.store.uri import SourceURI, check_endpoint, parse_uri


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("s3://bucket", SourceURI("s3", bucket="bucket")),
        ("s3://bucket/", SourceURI("s3", bucket="bucket")),
        ("s3://bucket/imagenet", SourceURI("s3", bucket="bucket", prefix="imagenet/")),
        ("s3://bucket/imagenet/", SourceURI("s3", bucket="bucket", prefix="imagenet/")),
        ("S3://my.bucket-1/a/b", SourceURI("s3", bucket="my.bucket-1", prefix="a/b/")),
        # The prefix is literal: no percent-decoding, "?" and "#" are key characters.
        ("s3://bkt/a%20b?x#y", SourceURI("s3", bucket="bkt", prefix="a%20b?x#y/")),
        ("s3://bkt/données/", SourceURI("s3", bucket="bkt", prefix="données/")),
        ("oss://oss-bucket/train", SourceURI("oss", bucket="oss-bucket", prefix="train/")),
        ("file:///data/imagenet", SourceURI("file", path="/data/imagenet")),
        ("file:///data/imagenet/", SourceURI("file", path="/data/imagenet")),
        ("file://localhost/data", SourceURI("file", path="/data")),
    ],
)
def test_valid_uris(uri, expected):
    assert parse_uri(uri) == expected


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("", "empty"),
        ("bucket/prefix", "unknown scheme"),
        ("http://bucket/prefix", "unknown scheme"),
        ("gs://bucket/prefix", "unknown scheme"),
        ("s3://", "no bucket name"),
        ("s3:///prefix", "no bucket name"),
        ("s3://ab/x", "not a valid s3 bucket name"),
        ("s3://Bucket/x", "not a valid s3 bucket name"),
        ("s3://bucket_name/x", "not a valid s3 bucket name"),
        ("s3://-bucket/x", "not a valid s3 bucket name"),
        ("s3://my..bucket/x", "not a valid s3 bucket name"),
        ("s3://192.168.1.1/x", "not a valid s3 bucket name"),
        ("s3://" + "b" * 64 + "/x", "not a valid s3 bucket name"),
        ("oss://my.bucket/x", "not a valid oss bucket name"),
        ("oss://UPPER/x", "not a valid oss bucket name"),
        ("s3://bucket/a/../b", "'..' segment"),
        ("s3://bucket/./b", "'.' segment"),
        ("s3://bucket//b", "empty segment"),
        ("s3://bucket/a//b", "empty segment"),
        ("s3://bucket/a\0b", "control character NUL"),
        ("s3://bucket/a\nb", "control character U+000A"),
        ("file:relative/dir", "not an absolute local path"),
        ("file://relative/dir", "not an absolute local path"),
        ("file://otherhost/dir", "not an absolute local path"),
        ("file:///", "no directory path"),
        ("file:///data/../etc", "'..' segment"),
        ("file:////data", "empty segment"),
    ],
)
def test_invalid_uris_say_what_is_wrong(uri, message):
    with pytest.raises(InvalidURI, match=re.escape(message)):
        parse_uri(uri)


def test_source_uri_prints_canonically():
    assert str(parse_uri("s3://bucket/a/b")) == "s3://bucket/a/b/"
    assert str(parse_uri("oss://bucket")) == "oss://bucket/"
    assert str(parse_uri("file:///data/x/")) == "file:///data/x"


@pytest.mark.parametrize(
    "endpoint", ["http://127.0.0.1:9000", "https://s3.example.com/", "http://[::1]:80"]
)
def test_valid_endpoints(endpoint):
    assert check_endpoint(endpoint) == endpoint.rstrip("/")


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("127.0.0.1:9000", "not a URL"),
        ("ftp://host", "not a URL"),
        ("http://", "not a URL"),
        ("http://host:99999", "invalid port"),
        ("http://host/?a=b", "query or fragment"),
    ],
)
def test_invalid_endpoints(endpoint, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_endpoint(endpoint)


def test_an_endpoint_with_credentials_is_refused_without_echoing_them():
    with pytest.raises(ConfigError) as caught:
        check_endpoint("http://user:hunter2@127.0.0.1:9000")

    assert "hunter2" not in str(caught.value)
    assert "user name or password" in str(caught.value)
