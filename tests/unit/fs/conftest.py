"""Fixtures shared by the tests of cachefs/fs."""

from __future__ import annotations

import pytest

from cachefs.cache.base import CHUNK_SIZE
from cachefs.fs.fuse_ops import native_read_table


@pytest.fixture
def table():
    """The patched pyfuse3's native READ table (one per process), empty, holding at most 1,000
    blocks and names, and emptied again after the test."""
    table = native_read_table(True, True)
    table.clear()
    table.configure(CHUNK_SIZE, 1000, 1000)
    yield table
    table.clear()
