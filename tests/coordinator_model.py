"""Helpers for tests of the coordinator's model (Cluster, CacheManager) on a real LMDB store
with a fake clock: heartbeats are plain method calls, time moves only when a test says so."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefs.protocol import DatasetSpec
from coordinator.service import Coordinator
from coordinator.settings import CoordinatorSettings
from coordinator.state import LmdbStateStore

HEARTBEAT_S = 1.0
DOWN_AFTER_S = 3.0
T0 = 1_700_000_000.0
SETTINGS = CoordinatorSettings(heartbeat_interval_s=HEARTBEAT_S, down_after_s=DOWN_AFTER_S)


class FakeClock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def store(state_dir: Path) -> Iterator[LmdbStateStore]:
    opened = LmdbStateStore(state_dir)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def coordinator(store: LmdbStateStore, clock: FakeClock) -> Coordinator:
    return Coordinator(store, SETTINGS, clock=clock)


def spec(name: str, **kwargs) -> DatasetSpec:
    return DatasetSpec(**{"name": name, "uri": f"s3://bucket/{name}/", **kwargs})


def address(node: str) -> str:
    return f"127.0.0.{int(node.removeprefix('n')) + 1}:7070"


def beat(coordinator: Coordinator, node: str, **report) -> dict:
    return coordinator.heartbeat(node, {"address": address(node), **report})
