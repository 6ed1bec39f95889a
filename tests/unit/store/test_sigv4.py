"""The lean client's SigV4 signer against botocore's own (the reference) for the same request,
and its cached signing key across days and secrets. Real verification by a server that checks
signatures is in tests/e2e/store/test_s3_bulk.py (moto with authentication on)."""

from __future__ import annotations

import datetime
from urllib.parse import quote

import botocore.auth
import botocore.awsrequest
import botocore.credentials
import pytest

from cachefs.store.sigv4 import GetSigner

NOW = datetime.datetime(2026, 11, 27, 15, 4, 5)
KEYS = ["plain.bin", "dir/sub/file.jpg", "a b+c&d=e?f#g", "ünï/çødé ✓", "a/../b/./c", "%41~!*'()"]


def botocore_headers(host: str, path: str, credentials, monkeypatch) -> dict[str, str]:
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: NOW)
    request = botocore.awsrequest.AWSRequest("GET", f"http://{host}{path}", headers={})
    botocore.auth.S3SigV4Auth(credentials, "s3", "eu-west-3").add_auth(request)
    return {name.lower(): value for name, value in request.headers.items()}


@pytest.mark.parametrize("token", [None, "session-token/with+odd=chars"])
@pytest.mark.parametrize("key", KEYS)
def test_the_signature_is_botocores_for_the_same_get(key, token, monkeypatch):
    credentials = botocore.credentials.Credentials("AKIDEXAMPLE", "secret/with+chars", token)
    host = "127.0.0.1:9000"
    path = "/bucket/" + quote("prefix/" + key, safe="/~")
    expected = botocore_headers(host, path, credentials, monkeypatch)
    ours = dict(
        GetSigner("eu-west-3").headers(
            host=host,
            path=path,
            access_key="AKIDEXAMPLE",
            secret_key="secret/with+chars",
            token=token,
            now=NOW.replace(tzinfo=datetime.timezone.utc).timestamp(),
        )
    )
    assert ours["Authorization"] == expected["authorization"]
    assert ours["x-amz-date"] == expected["x-amz-date"]
    assert ours["x-amz-content-sha256"] == expected["x-amz-content-sha256"]
    assert ours.get("x-amz-security-token") == expected.get("x-amz-security-token")


def test_the_signing_key_follows_the_day_and_the_secret():
    """The per-day key is cached: a new day or a rotated secret must not reuse it."""
    signer = GetSigner("us-east-1")

    def signature(secret: str, when: float) -> str:
        headers = dict(
            signer.headers(
                host="h", path="/b/k", access_key="A", secret_key=secret, token=None, now=when
            )
        )
        return headers["Authorization"]

    day = NOW.replace(tzinfo=datetime.timezone.utc).timestamp()
    first = signature("s1", day)
    assert signature("s1", day) == first
    fresh = GetSigner("us-east-1")
    next_day = day + 86400
    assert (
        signature("s1", next_day)
        == dict(
            fresh.headers(
                host="h", path="/b/k", access_key="A", secret_key="s1", token=None, now=next_day
            )
        )["Authorization"]
    )
    rotated = signature("s2", next_day)
    assert rotated != signature("s1", next_day)
    assert (
        rotated
        == dict(
            GetSigner("us-east-1").headers(
                host="h", path="/b/k", access_key="A", secret_key="s2", token=None, now=next_day
            )
        )["Authorization"]
    )
