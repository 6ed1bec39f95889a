"""Data shapes shared by the worker, the CLI and (later) the coordinator.

Plain dataclasses with JSON round-trips; no worker internals. Credentials are referenced
(profile name, file path, or the worker's environment) and never stored here.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import xxhash

from cachefs.errors import ConfigError
from cachefs.units import parse_duration

DEFAULT_BLOCK_SIZE = 4 << 20
#: The whole budget of one store request (every try, hedge and backoff included).
DEFAULT_STORE_TIMEOUT_S = 60.0
#: How long one try of a store read may wait for the store to start answering (connect and
#: response headers), or for more of a body that stopped mid-way, before it is replaced.
DEFAULT_FIRST_BYTE_TIMEOUT_S = 5.0
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_dataset_name(name: str) -> str:
    if not _NAME_RE.match(name or ""):
        raise ConfigError(
            f"invalid dataset name {name!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


@dataclass
class DatasetSpec:
    """What the user asked for with ``cachefs dataset add`` (durable, in the registry)."""

    name: str
    uri: str
    endpoint: str | None = None
    region: str | None = None
    path_style: bool | None = None
    profile: str | None = None
    credentials_file: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    timeout_s: float = DEFAULT_STORE_TIMEOUT_S  # one store request, all its tries included
    first_byte_timeout_s: float = DEFAULT_FIRST_BYTE_TIMEOUT_S  # per try (at most timeout_s)
    refresh_interval_s: float | None = None  # periodic snapshot refresh; None = explicit only
    # Sharing and cleanup, enforced by the coordinator's CacheManager:
    max_jobs_per_copy: int | None = None  # running jobs per cached copy; None = no limit
    overflow: str = "suspend"  # a job over the limit: "suspend" it, or "clone" the copy
    cleanup: str = "lock"  # "lock" (never freed), "ttl:<duration>" (idle copy) or "lru"
    # Filled in by the registry:
    slot: int = 0  # inode-space slot under the mount (never reused while the state dir lives)
    generation: int = 0  # snapshot generation currently served
    created_at: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DatasetSpec:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown dataset field(s): {', '.join(sorted(unknown))}")
        if "name" not in data or "uri" not in data:
            raise ConfigError("a dataset needs a 'name' and a 'uri'")
        spec = cls(**data)
        check_dataset_name(spec.name)
        if not isinstance(spec.block_size, int) or not (64 << 10) <= spec.block_size <= (64 << 20):
            raise ConfigError("block_size must be between 64 KiB and 64 MiB")
        for name in ("timeout_s", "first_byte_timeout_s"):
            value = getattr(spec, name)
            if not isinstance(value, int | float) or not 0 < value <= 600:
                raise ConfigError(f"{name} must be in (0, 600] seconds")
        limit = spec.max_jobs_per_copy
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ConfigError(f"max_jobs_per_copy must be a positive integer, got {limit!r}")
        if spec.overflow not in OVERFLOW_POLICIES:
            raise ConfigError(
                f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}, got {spec.overflow!r}"
            )
        CleanupPolicy.parse(spec.cleanup)
        return spec


OVERFLOW_POLICIES = ("suspend", "clone")


@dataclass(frozen=True)
class CleanupPolicy:
    """When a dataset's cached blocks may be freed (the reserve is never freed):

    - ``lock``: never;
    - ``ttl:<duration>``: a copy that no job used and no node read for that long is freed;
    - ``lru``: under capacity pressure on a node, the least recently used such dataset first.
    """

    kind: str
    ttl_s: float | None = None

    @classmethod
    def parse(cls, text: str) -> CleanupPolicy:
        if not isinstance(text, str):
            raise ConfigError(f"cleanup must be lock, lru or ttl:<duration>, got {text!r}")
        if text in ("lock", "lru"):
            return cls(text)
        if text.startswith("ttl:"):
            try:
                ttl_s = parse_duration(text[4:])
            except ConfigError:
                ttl_s = 0.0
            if ttl_s > 0:
                return cls("ttl", ttl_s)
        raise ConfigError(
            f"cleanup must be lock, lru or ttl:<duration> (e.g. ttl:6h), got {text!r}"
        )


# --- the distributed cache: shards and their owners ----------------------------------------------

# Per dataset; the unit of placement and locality (docs/architecture.md, "Who owns what").
SHARDS = 1024


def shard_owner(dataset: str, shard: int, nodes: list[str] | tuple[str, ...]) -> str | None:
    """The node owning ``shard`` of ``dataset`` among ``nodes`` (rendezvous hashing), or None.

    Every node scores ``xxh3_64(dataset, shard, node)`` and the highest wins, so removing a
    node re-owns only the shards it owned, and adding one takes only the shards it now wins.
    The coordinator and every worker compute this the same way from the same node list.
    """
    if not nodes:
        return None
    prefix = f"{dataset}\0{shard}\0".encode()
    return max(nodes, key=lambda node: (xxhash.xxh3_64_intdigest(prefix + node.encode()), node))


def owner_table(dataset: str, nodes: list[str] | tuple[str, ...]) -> list[str | None]:
    """``shard_owner`` for every shard of ``dataset`` (index = shard)."""
    return [shard_owner(dataset, shard, nodes) for shard in range(SHARDS)]
