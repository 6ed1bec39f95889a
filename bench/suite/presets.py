"""Sizes of one suite run. ``default`` is the committed run; ``quick`` checks that everything
works in a few minutes; ``full`` is closer to a real training set, for a quiet machine."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class Preset:
    name: str
    small_files: int  # ImageNet-like files (~110 KB mean) read warm and after preload
    cold_files: int  # a shuffled subset of them, read cold (every read goes to the store)
    readers: tuple[int, ...]  # reader threads of the small-file passes
    samples: int  # emulator samples (114,660 B each)
    emulator_batches: int  # batches per accelerator per trial
    emulator_scale: float  # batch and compute scaled by this (demand per accelerator unchanged)
    emulator_max: int  # the search's bound on N
    shards: int  # large TFRecord-like shards
    shard_min: int
    shard_max: int
    meta_entries: int  # namespace cachefs serves for find/stat (local file:// source)
    meta_peer_entries: int  # the smaller S3 namespace that every system lists
    cluster_files: int  # multi-node benchmark (0: skip)
    repeats: int  # runs per warm pass; the fastest is kept

    @property
    def large_bytes_bound(self) -> int:
        return self.shards * self.shard_max


PRESETS = {
    "quick": Preset(
        name="quick",
        small_files=600,
        cold_files=200,
        readers=(1, 4, 16),
        samples=1_000,
        emulator_batches=8,
        emulator_scale=0.1,
        emulator_max=16,
        shards=2,
        shard_min=64 * MiB,
        shard_max=80 * MiB,
        meta_entries=20_000,
        meta_peer_entries=200,
        cluster_files=0,
        repeats=1,
    ),
    "default": Preset(
        name="default",
        small_files=4_000,
        cold_files=600,
        readers=(1, 4, 16),
        samples=4_000,
        emulator_batches=20,
        emulator_scale=0.1,
        emulator_max=32,
        shards=4,
        shard_min=64 * MiB,
        shard_max=256 * MiB,
        meta_entries=1_281_167,
        meta_peer_entries=300,
        cluster_files=1_000,
        repeats=2,
    ),
    "full": Preset(
        name="full",
        small_files=20_000,
        cold_files=2_000,
        readers=(1, 4, 16),
        samples=10_000,
        emulator_batches=50,
        emulator_scale=1.0,
        emulator_max=64,
        shards=8,
        shard_min=64 * MiB,
        shard_max=256 * MiB,
        meta_entries=1_281_167,
        meta_peer_entries=2_000,
        cluster_files=2_000,
        repeats=3,
    ),
}
