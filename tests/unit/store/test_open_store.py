"""open_store picks the implementation from the URI scheme."""

from __future__ import annotations

import sys

import pytest

from cachefs.errors import ConfigError, InvalidURI
from cachefs.store import StoreConfig, open_store
from cachefs.store.local import LocalStore
from cachefs.store.oss import OSSStore
from cachefs.store.s3 import S3Store


def test_each_scheme_opens_its_store(tmp_path, monkeypatch):
    monkeypatch.setenv("OSS_ACCESS_KEY_ID", "id")
    monkeypatch.setenv("OSS_ACCESS_KEY_SECRET", "secret")

    local = open_store(StoreConfig(uri=f"file://{tmp_path}"))
    s3 = open_store(StoreConfig(uri="s3://bucket/x", endpoint="http://127.0.0.1:9"))
    oss = open_store(StoreConfig(uri="oss://bucket/x", endpoint="http://127.0.0.1:9"))

    assert isinstance(local, LocalStore) and local.description == f"file://{tmp_path}"
    assert isinstance(s3, S3Store) and s3.description == "s3://bucket/x/ at http://127.0.0.1:9"
    assert isinstance(oss, OSSStore) and oss.description == "oss://bucket/x/ at http://127.0.0.1:9"
    for store in (local, s3, oss):
        store.close()


def test_an_invalid_uri_is_refused_before_anything_is_opened():
    with pytest.raises(InvalidURI, match="unknown scheme"):
        open_store(StoreConfig(uri="ftp://bucket/x"))


def test_oss_without_oss2_installed_says_how_to_install_it(monkeypatch):
    # Simulate the optional extra being absent: importing a module mapped to None fails.
    monkeypatch.setitem(sys.modules, "oss2", None)
    monkeypatch.delitem(sys.modules, "cachefs.store.oss")

    with pytest.raises(ConfigError, match=r"pip install .cachefs-dl\[oss\]."):
        open_store(StoreConfig(uri="oss://bucket/x", endpoint="http://127.0.0.1:9"))
