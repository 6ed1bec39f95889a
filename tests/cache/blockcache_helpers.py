"""Helpers shared by the block cache tests."""

from __future__ import annotations

import os

from cachefs.cache.base import BlockKey

BLOCK = 1024  # tests use KiB-sized blocks


def key(index: int, source_id: int = 1) -> BlockKey:
    return BlockKey.make(source_id, f"dir/object-{index}", "etag-1", index)


def block_data(index: int, size: int = BLOCK) -> bytes:
    """Distinct, position-dependent bytes, so a block served for the wrong key is caught."""
    pattern = index.to_bytes(4, "big") + bytes(range(251))
    return (pattern * (size // len(pattern) + 1))[:size]


def block_files_bytes(tier_dir: str) -> int:
    """Bytes of all block files in a tier directory (temp files excluded)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(tier_dir):
        dirnames[:] = [name for name in dirnames if name != "tmp"]
        for name in filenames:
            if name.startswith("."):
                continue
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:  # removed while walking
                pass
    return total
