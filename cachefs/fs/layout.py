"""How a file is cut into blocks: block ``i`` holds bytes ``[i * block_size, min((i + 1) *
block_size, size))`` of the object version the snapshot names, and is cached under a key of
that version (:meth:`BlockKey.make`). The short-circuit resolver (what a reader may read from
the cache's files) and the prefetcher (what to fetch for a hint) both walk a file with
:func:`file_blocks`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from cachefs.cache.base import BlockKey
from cachefs.fs.blocks import DataSource
from cachefs.meta.records import Entry


@dataclass(slots=True)  # not frozen: resolving a batch of files makes one per block, quickly
class BlockSpan:
    index: int
    offset: int  # of the block's first byte in the file
    length: int  # block_size, less for the last block
    key: BlockKey


def file_blocks(source: DataSource, entry: Entry) -> Iterator[BlockSpan]:
    """The blocks of one file of ``source`` (``entry``: the file as its snapshot lists it)."""
    block_size = source.block_size
    for index in range((entry.size + block_size - 1) // block_size):
        offset = index * block_size
        yield BlockSpan(
            index,
            offset,
            min(block_size, entry.size - offset),
            BlockKey.make(source.source_id, entry.key, entry.etag, index),
        )
