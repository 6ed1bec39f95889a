"""Helpers shared by the block cache tests."""

from __future__ import annotations

import os

from cachefs.cache.base import BlockKey

# Tests use page-sized blocks: a tier counts each block's size rounded up to its filesystem's
# allocation unit (4 KiB pages or blocks here), so a whole number of BLOCKs fills it exactly.
BLOCK = 4096


def key(index: int, source_id: int = 1) -> BlockKey:
    return BlockKey.make(source_id, f"dir/object-{index}", "etag-1", index)


def block_data(index: int, size: int = BLOCK) -> bytes:
    """Distinct, position-dependent bytes, so a block served for the wrong key is caught."""
    pattern = index.to_bytes(4, "big") + bytes(range(251))
    return (pattern * (size // len(pattern) + 1))[:size]


def block_files_du(tier_dir: str) -> int:
    """Bytes the block files of a tier directory take on its filesystem, as ``du`` counts them
    (temp files and the marker excluded)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(tier_dir):
        dirnames[:] = [name for name in dirnames if name != "tmp"]
        for name in filenames:
            if name.startswith("."):
                continue
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:  # removed while walking
                pass
    return total
