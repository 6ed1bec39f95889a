"""Preload jobs: what to load (a :class:`Selection`) and how far it got. One model for both
places a job runs from: the coordinator (a cluster) and a single `cachefs up` worker
(cachefs/cluster/local_preload.py), which is why it lives here and not in coordinator/.

A job is split by shard: the owner of each shard (in the job's copy) plans the blocks of that
shard that the selection picks, fetches the missing ones and reports cumulative progress per
shard in its heartbeats. The coordinator keeps, per shard, the latest report of the shard's
*current* owner — if a node dies, its shards' new owners report from scratch — and calls the job
complete only when every shard's owner reports its share cached and verified. Reports are
cumulative, so a restarted coordinator catches up from the next round of heartbeats.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

from cachefs.errors import ConfigError
from cachefs.protocol import SHARDS

STATES = ("scheduled", "running", "completed", "failed", "cancelled")
MAX_FAILURES_PER_SHARD = 20  # listed by key; the count is always exact


@dataclass(frozen=True)
class Selection:
    """Which bytes to preload: objects under ``paths`` (all if empty); of those, ``fraction``
    of the bytes of each shard, or ``bytes`` in total (spread over shards in proportion to their
    size); starting at unix time ``at`` (now if None)."""

    paths: tuple[str, ...] = ()
    fraction: float | None = None
    bytes: int | None = None
    at: float | None = None

    def __post_init__(self) -> None:
        if self.fraction is not None and self.bytes is not None:
            raise ConfigError("give a fraction or a byte budget, not both")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ConfigError("fraction must be in (0, 1]")
        if self.at is not None and not math.isfinite(self.at):
            raise ConfigError("the start time must be a finite unix time")
        if self.bytes is not None and self.bytes <= 0:
            raise ConfigError("the byte budget must be positive")
        for path in self.paths:
            if "\0" in path or path.startswith("/") or ".." in path.split("/"):
                raise ConfigError(f"bad path prefix {path!r}: relative, no '..', no NUL")
        object.__setattr__(self, "paths", tuple(self.paths))

    def describe(self) -> str:
        what = ", ".join(self.paths) if self.paths else "everything"
        if self.fraction is not None:
            what += f", {100 * self.fraction:g}% of the bytes"
        if self.bytes is not None:
            what += f", {self.bytes} bytes"
        return what

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "paths": list(self.paths)}


class ShardReport(TypedDict):
    """The latest cumulative report of one shard's owner, as a job keeps it (and stores it:
    the coordinator's state and a single node's preloads.json hold these as JSON)."""

    node: str  # the owner that reported it
    objects: int  # planned for the shard
    bytes: int
    done_objects: int  # cached and verified so far
    done_bytes: int
    failed: dict[str, str]  # key -> reason, the first MAX_FAILURES_PER_SHARD
    failed_count: int  # every failure, listed or not
    complete: bool  # the owner has worked through every planned object (done or failed)


@dataclass
class PreloadJob:
    id: str
    dataset: str
    copy: str
    selection: Selection
    created_at: float
    state: str = "scheduled"
    started_at: float | None = None
    finished_at: float | None = None
    shards: dict[int, ShardReport] = field(default_factory=dict)  # shard -> latest owner report

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "dataset": self.dataset,
            "copy": self.copy,
            "selection": self.selection.to_json(),
            "created_at": self.created_at,
            "state": self.state,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "shards": {str(shard): report for shard, report in self.shards.items()},
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> PreloadJob:
        return cls(
            id=doc["id"],
            dataset=doc["dataset"],
            copy=doc["copy"],
            selection=Selection(**doc["selection"]),
            created_at=doc["created_at"],
            state=doc["state"],
            started_at=doc["started_at"],
            finished_at=doc["finished_at"],
            shards={int(shard): report for shard, report in doc["shards"].items()},
        )

    def assignment(self) -> dict[str, Any]:
        """What a worker needs to run its shards of the job."""
        return {
            "id": self.id,
            "dataset": self.dataset,
            "copy": self.copy,
            "selection": self.selection.to_json(),
        }

    def record(self, shard: int, node: str, report: dict[str, Any]) -> bool:
        """Keep ``node``'s cumulative report for ``shard``; True if it changed anything."""
        failed = dict(list(report.get("failed", {}).items())[:MAX_FAILURES_PER_SHARD])
        entry: ShardReport = {
            "node": node,
            "objects": int(report.get("objects", 0)),
            "bytes": int(report.get("bytes", 0)),
            "done_objects": int(report.get("done_objects", 0)),
            "done_bytes": int(report.get("done_bytes", 0)),
            "failed": failed,
            "failed_count": int(report.get("failed_count", len(failed))),
            "complete": bool(report.get("complete", False)),
        }
        if self.shards.get(shard) == entry:
            return False
        self.shards[shard] = entry
        return True

    def _current(self, owners: list[str | None]) -> dict[int, ShardReport]:
        """Reports that count: from each shard's current owner while the job runs; all of them
        once it is over (the owners then may have changed, the record stays)."""
        if self.state != "running":
            return self.shards
        return {
            shard: report
            for shard, report in self.shards.items()
            if report["node"] == owners[shard]
        }

    def advance(self, now: float, owners: list[str | None] | None = None) -> bool:
        """Move the job along its states; True if it changed."""
        if self.state == "scheduled" and (self.selection.at is None or self.selection.at <= now):
            self.state, self.started_at = "running", now
            return True
        if self.state != "running" or owners is None:
            return False
        reports = self._current(owners)
        if len(reports) < SHARDS or not all(r["complete"] for r in reports.values()):
            return False
        failed = any(r["failed_count"] for r in reports.values())
        self.state = "failed" if failed else "completed"
        self.finished_at = now
        return True

    def progress(self, owners: list[str | None], now: float) -> dict[str, Any]:
        reports = self._current(owners)
        total_objects = sum(r["objects"] for r in reports.values())
        total_bytes = sum(r["bytes"] for r in reports.values())
        done_objects = sum(r["done_objects"] for r in reports.values())
        done_bytes = sum(r["done_bytes"] for r in reports.values())
        failures = [
            {"key": key, "reason": reason, "node": r["node"]}
            for r in reports.values()
            for key, reason in r["failed"].items()
        ]
        end = self.finished_at or now
        elapsed = end - self.started_at if self.started_at else 0.0
        rate = done_bytes / elapsed if elapsed > 0 else 0.0
        remaining = max(0, total_bytes - done_bytes)
        planned = len(reports) == SHARDS
        return {
            **self.to_json(),
            "shards": None,  # per-shard detail stays internal; the totals are below
            "shards_total": SHARDS,
            "shards_reported": len(reports),
            "shards_done": sum(1 for r in reports.values() if r["complete"]),
            "planned": planned,  # every shard's owner has reported: the totals are final
            "objects": total_objects,
            "objects_done": done_objects,
            "bytes": total_bytes,
            "bytes_done": done_bytes,
            "elapsed_s": elapsed,
            "rate_bytes_per_s": rate,
            "eta_s": remaining / rate if rate > 0 and self.state == "running" else None,
            "failed_count": sum(r["failed_count"] for r in reports.values()),
            "failed": failures,
        }
