"""What opening a block cache checks and repairs before it serves: the tier configuration,
each tier's id in the index (a tier directory that was emptied or replaced, or a tier no longer
configured, loses its entries), block files no entry describes (after an unclean shutdown), and
entries of an older index format. :class:`~cachefs.cache.tiered.TieredBlockCache` calls these
from its constructor, in that order; nothing here runs after it has opened."""

from __future__ import annotations

import logging
import os
import resource

from cachefs.cache.index import BlockIndex, Entry, IndexWriter, TierRecord
from cachefs.cache.tier import Tier, TierConfig, prepare_directory
from cachefs.errors import ConfigError

log = logging.getLogger(__name__)

ADMISSION_AVOID_EVICTION = "avoid-eviction"
ADMISSION_LRU = "lru"
ADMISSION_POLICIES = (ADMISSION_AVOID_EVICTION, ADMISSION_LRU)
MAX_TIERS = 256  # tier ids are one byte in the index
#: Block file descriptors kept open, all tiers together (at most a quarter of RLIMIT_NOFILE:
#: sockets to the store and to peers, LMDB and /dev/fuse need the rest).
OPEN_BLOCK_FILES = 256


def validate(tiers: list[TierConfig], admission: str) -> None:
    if admission not in ADMISSION_POLICIES:
        raise ConfigError(
            f"cache admission policy {admission!r} is unknown "
            f"(choose one of: {', '.join(ADMISSION_POLICIES)})"
        )
    if not tiers:
        raise ConfigError("the block cache needs at least one tier")
    if len(tiers) > MAX_TIERS:
        raise ConfigError(f"the block cache supports at most {MAX_TIERS} tiers")
    names = [tier.name for tier in tiers]
    paths = [os.path.abspath(tier.path) for tier in tiers]
    for what, values in (("name", names), ("directory", paths)):
        duplicates = sorted({value for value in values if values.count(value) > 1})
        if duplicates:
            raise ConfigError(f"cache tiers must differ in {what}; repeated: {duplicates}")


def open_files_per_tier(tiers: int) -> int:
    """Each tier's share of OPEN_BLOCK_FILES, within a quarter of the descriptor limit."""
    total = OPEN_BLOCK_FILES
    soft_limit, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft_limit != resource.RLIM_INFINITY:
        total = min(total, soft_limit // 4)
    return total // tiers


def attach_tiers(index: BlockIndex, configs: list[TierConfig]) -> tuple[list[Tier], list[Tier]]:
    """Give each configured tier its id, and drop index entries that no longer point at
    files: tiers whose directory was wiped or replaced, and tiers no longer configured.

    Returns all tiers, and those new to the index (their directories may hold files that no
    entry describes)."""
    records = index.tier_records()
    instance_ids = [prepare_directory(config.path) for config in configs]
    taken_ids = {record.tier_id for record in records.values()}
    free_ids = (tier_id for tier_id in range(MAX_TIERS) if tier_id not in taken_ids)
    tiers = []
    new_tiers = []
    with index.write() as writer:
        for config, instance_id in zip(configs, instance_ids, strict=True):
            record = records.pop(config.name, None)
            known = record is not None and record.instance_id == instance_id
            if record is not None and not known:
                dropped = _drop_tier_entries(writer, record.tier_id)
                log.warning(
                    "cache tier %r: directory %s was emptied or replaced since the last run; "
                    "dropped %d index entries",
                    config.name,
                    config.path,
                    dropped,
                )
            if record is None or not known:
                tier_id = next(free_ids) if record is None else record.tier_id
                record = TierRecord(tier_id, instance_id)
                writer.register_tier(config.name, record)
            tier = Tier(config, record.tier_id, open_files_per_tier(len(configs)))
            tiers.append(tier)
            if not known:
                new_tiers.append(tier)
        for name, record in records.items():
            dropped = _drop_tier_entries(writer, record.tier_id)
            writer.unregister_tier(name)
            log.warning(
                "cache tier %r is no longer configured; dropped its %d index entries "
                "(its files were left in place)",
                name,
                dropped,
            )
    return tiers, new_tiers


def _drop_tier_entries(writer: IndexWriter, tier_id: int) -> int:
    entries = writer.entries_of_tier(tier_id)
    for raw, entry in entries:
        writer.remove(raw, entry)
    return len(entries)


def sweep_orphans(index: BlockIndex, tiers: list[Tier]) -> None:
    """Delete block files that have no index entry, so disk use matches the accounting.
    Needed after an unclean shutdown (files written just before a crash, or whose entry was
    lost) and for tier directories the index does not know."""
    for tier in tiers:
        removed = 0
        for raw, file_id, path in tier.iter_block_files():
            value = index.get(raw)
            entry = None if value is None else Entry.unpack(value)
            if entry is None or (entry.tier_id, entry.file_id) != (tier.tier_id, file_id):
                os.unlink(path)
                removed += 1
        if removed:
            log.info("cache tier %r: removed %d orphaned block files", tier.name, removed)


def upgrade_legacy_entries(index: BlockIndex, tier_by_id: dict[int, Tier]) -> bool:
    """Bring an index of format 1 to the current one, in one transaction: each entry gets
    its footprint (its totals counted its size), and the index the new format version.
    The entries' chunk checksums are left for the first read of each block, which verifies
    the whole block against its checksum from format 1 and computes them (reading every
    block here would make opening a large SSD tier take minutes). Returns whether any
    entry was upgraded."""
    upgraded = 0
    with index.write() as writer:
        for raw, entry in list(writer.legacy_entries()):
            tier = tier_by_id[entry.tier_id]  # other tiers' entries are dropped
            writer.remove(raw, entry)
            writer.insert(raw, entry._replace(footprint=tier.footprint(entry.size)))
            upgraded += 1
        writer.mark_format_current()
    log.info("block cache index %s: upgraded %d entries to format 2", index.path, upgraded)
    return upgraded > 0
