"""S3Store credentials: where they come from, how rejection looks, and that secrets never leak.

moto accepts any credentials by default, which would make "wrong credentials" untestable. So
this module starts its own moto server and switches on moto's IAM authentication
(``MotoServer.require_auth``, moto's ``/moto-api/reset-auth``): from then on moto verifies
SigV4 signatures against the one IAM user it knows and answers unknown access keys with 403
``InvalidAccessKeyId`` and wrong secrets with 403 ``SignatureDoesNotMatch`` — the real S3
responses, produced by a real signature check, not injected. A dedicated server, because
authentication cannot be switched off again and the shared ``moto_s3`` must stay permissive.

The datasets here are whole buckets: moto's signature check mis-canonicalises a "/" inside a
query parameter (``prefix=ds/``) and rejects correctly signed listings of a prefix; real S3
does not (and the prefix logic is covered against the permissive server in test_s3.py).
"""

from __future__ import annotations

import pytest

from cachefs.errors import ConfigError, StoreAuthError
from cachefs.store.base import RetryPolicy, StoreConfig
from cachefs.store.s3 import S3Store
from tests.fakes.moto import MotoServer

NO_RETRY = RetryPolicy(attempts=1)
WRONG_SECRET = "wrong-secret-that-must-never-be-printed"


@pytest.fixture(scope="module")
def auth_server():
    server = MotoServer()
    server.start()
    try:
        bucket = server.make_bucket()
        server.put(bucket, "file.txt", b"authenticated bytes")
        key_id, secret = server.require_auth()
        yield server, bucket, key_id, secret
    finally:
        server.stop()


@pytest.fixture
def no_aws_env(monkeypatch):
    """No AWS_* credentials in the environment (the session's moto_s3 may have set some)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)


def write_credentials(path, profile: str, key_id: str, secret: str) -> str:
    path.write_text(
        f"[{profile}]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n"
    )
    return str(path)


def open_store(server, bucket, **config) -> S3Store:
    return S3Store(
        StoreConfig(
            uri=f"s3://{bucket}",
            endpoint=server.endpoint,
            dataset="ds",
            retry=NO_RETRY,
            **config,
        )
    )


def test_valid_credentials_from_the_environment_work(auth_server, monkeypatch):
    server, bucket, key_id, secret = auth_server
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)

    store = open_store(server, bucket)

    assert [info.key for info in store.list()] == ["file.txt"]
    assert store.get_range("file.txt", 0, 13) == b"authenticated"


def test_an_unknown_access_key_is_rejected_without_leaking_the_secret(auth_server, monkeypatch):
    server, bucket, _, _ = auth_server
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG_SECRET)
    store = open_store(server, bucket)

    for operation in (lambda: list(store.list()), lambda: store.get_range("file.txt", 0, 1)):
        with pytest.raises(StoreAuthError) as caught:
            operation()
        message = str(caught.value)
        assert "credentials rejected by S3: InvalidAccessKeyId" in message
        assert "'ds'" in message and server.endpoint in message
        assert WRONG_SECRET not in message


def test_a_wrong_secret_is_rejected_without_leaking_it(auth_server, monkeypatch):
    server, bucket, key_id, _ = auth_server
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG_SECRET)
    store = open_store(server, bucket)

    with pytest.raises(StoreAuthError) as caught:
        store.get_range("file.txt", 0, 1)

    assert "SignatureDoesNotMatch" in str(caught.value)
    assert WRONG_SECRET not in str(caught.value)


def test_head_rejection_has_no_code_but_is_still_an_auth_error(auth_server, monkeypatch):
    # HEAD responses have no body, so S3 can only say "403".
    server, bucket, _, _ = auth_server
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG_SECRET)

    with pytest.raises(StoreAuthError, match="credentials rejected by S3: 403"):
        open_store(server, bucket).head("file.txt")


def test_a_credentials_file_wins_over_the_environment(auth_server, monkeypatch, tmp_path):
    server, bucket, key_id, secret = auth_server
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG_SECRET)
    credentials = write_credentials(tmp_path / "creds", "default", key_id, secret)

    store = open_store(server, bucket, credentials_file=credentials)

    assert store.get_range("file.txt", 0, 5) == b"authe"


def test_a_named_profile_of_a_credentials_file_is_used(auth_server, no_aws_env, tmp_path):
    server, bucket, key_id, secret = auth_server
    credentials = tmp_path / "creds"
    write_credentials(credentials, "default", "AKIAUNKNOWNKEY000000", WRONG_SECRET)
    with credentials.open("a") as file:
        file.write(f"[reader]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n")

    store = open_store(server, bucket, credentials_file=str(credentials), profile="reader")

    assert store.head("file.txt").size == len(b"authenticated bytes")


def test_a_missing_profile_is_an_auth_error_naming_it(auth_server, no_aws_env, tmp_path):
    server, bucket, key_id, secret = auth_server
    credentials = write_credentials(tmp_path / "creds", "default", key_id, secret)

    with pytest.raises(StoreAuthError, match="'nosuchprofile' not found") as caught:
        open_store(server, bucket, credentials_file=credentials, profile="nosuchprofile")

    assert secret not in str(caught.value)


def test_an_unreadable_credentials_file_is_a_config_error(auth_server, tmp_path):
    server, bucket, _, _ = auth_server
    missing = str(tmp_path / "does-not-exist")

    with pytest.raises(ConfigError, match="does-not-exist"):
        open_store(server, bucket, credentials_file=missing)


def test_no_credentials_at_all_is_an_auth_error_saying_what_to_set(auth_server, no_aws_env):
    server, bucket, _, _ = auth_server

    with pytest.raises(StoreAuthError, match="AWS_ACCESS_KEY_ID"):
        open_store(server, bucket).head("file.txt")
