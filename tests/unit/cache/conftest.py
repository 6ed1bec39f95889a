"""Fixtures for the tiered block cache tests: real LMDB, real tier directories under tmp_path."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from cachefs.cache import TierConfig, TieredBlockCache
from tests.unit.cache.blockcache_helpers import BLOCK


@pytest.fixture
def make_cache(tmp_path) -> Iterator[Callable[..., TieredBlockCache]]:
    """``make_cache(ram=..., ssd=..., ram_reserve=..., **options)`` opens a cache over
    ``tmp_path/{index,ram,ssd}`` (``ssd=0`` leaves the SSD tier out); every cache still open at
    the end of the test is closed."""
    opened: list[TieredBlockCache] = []

    def make(
        ram: int = 8 * BLOCK,
        ssd: int = 0,
        *,
        ram_reserve: int = 0,
        ssd_reserve: int = 0,
        **options,
    ) -> TieredBlockCache:
        tiers = [TierConfig("ram", str(tmp_path / "ram"), ram, ram_reserve)]
        if ssd:
            tiers.append(TierConfig("ssd", str(tmp_path / "ssd"), ssd, ssd_reserve))
        cache = TieredBlockCache(str(tmp_path / "index"), tiers, **options)
        opened.append(cache)
        return cache

    yield make
    for cache in opened:
        cache.close()
