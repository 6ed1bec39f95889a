"""The object-store layer (SEAM A): what a dataset's bytes are read from.

``open_store(config)`` picks the implementation from the URI scheme: ``s3://`` (botocore),
``oss://`` (oss2, an optional extra) or ``file://`` (a local directory). Implementations are
imported lazily, so a worker serving only local datasets never pays for importing an SDK.
"""

from __future__ import annotations

from cachefs.errors import ConfigError
from cachefs.store.base import ObjectInfo, ObjectStore, RetryPolicy, StoreConfig
from cachefs.store.uri import SourceURI, parse_uri

__all__ = [
    "ObjectInfo",
    "ObjectStore",
    "RetryPolicy",
    "SourceURI",
    "StoreConfig",
    "open_store",
    "parse_uri",
]


def open_store(config: StoreConfig) -> ObjectStore:
    """Open the store ``config.uri`` names; raises InvalidURI/ConfigError for bad config."""
    scheme = parse_uri(config.uri).scheme
    if scheme == "s3":
        from cachefs.store.s3 import S3Store

        return S3Store(config)
    if scheme == "oss":
        try:
            from cachefs.store.oss import OSSStore
        except ModuleNotFoundError as err:
            if err.name != "oss2":
                raise
            raise ConfigError(
                f"{config.uri!r} is an OSS source, which needs the oss2 package: "
                "pip install 'cachefs-dl[oss]' (the extra of this distribution)"
            ) from None
        return OSSStore(config)
    from cachefs.store.local import LocalStore

    return LocalStore(config)
