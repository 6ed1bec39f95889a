"""Data shapes shared by the worker, the CLI and (later) the coordinator.

Plain dataclasses with JSON round-trips; no worker internals. Credentials are referenced
(profile name, file path, or the worker's environment) and never stored here.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields

from cachefs.errors import ConfigError

DEFAULT_BLOCK_SIZE = 4 << 20
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
    timeout_s: float = 30.0  # per store request (connect + read); retries fit in 2x this
    refresh_interval_s: float | None = None  # periodic snapshot refresh; None = explicit only
    # Filled in by the registry:
    slot: int = 0  # inode-space slot under the mount (never reused while the state dir lives)
    generation: int = 0  # snapshot generation currently served
    created_at: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> DatasetSpec:
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
        if not isinstance(spec.timeout_s, int | float) or not 0 < spec.timeout_s <= 600:
            raise ConfigError("timeout_s must be in (0, 600] seconds")
        return spec
