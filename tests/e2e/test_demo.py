"""`cachefs demo`: its dataset generator is deterministic, also when re-run over an existing
tree, and the demo itself says truthfully where each read was served from."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys

from cachefs.demo import generate_image_tree
from cachefs.settings import default_ram_dir
from tests.waiting import WAIT_S
from tests.worker_process import REPO_ROOT


def tree_digest(root: str) -> dict[str, str]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_same_seed_same_tree_fresh_or_rerun(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    total = generate_image_tree(a, files=40, classes=4)
    first = tree_digest(a)
    os.remove(os.path.join(a, sorted(first)[3]))  # a damaged tree is repaired on re-run
    assert generate_image_tree(a, files=40, classes=4) == total
    assert tree_digest(a) == first
    generate_image_tree(b, files=40, classes=4)
    assert tree_digest(b) == first
    assert len(first) == 40 and total == sum(os.path.getsize(os.path.join(a, p)) for p in first)


def test_demo_says_where_each_read_was_served_from(tmp_path):
    """`cachefs demo` run as a user runs it (a real worker and mount): the second read is
    counted as cachefs cache hits (the page cache is dropped first), the third is served by
    the kernel's page cache and the demo says so, instead of a hit ratio near 0 after a fully
    cached read; every byte verified."""
    files = 40
    try:
        demo = subprocess.run(
            [
                sys.executable, "-m", "cachefs", "--log-level", "WARNING", "demo",
                "--workdir", str(tmp_path), "--files", str(files),
            ],
            env={**os.environ, "PYTHONPATH": REPO_ROOT},
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )  # fmt: skip
    finally:  # the RAM tier the demo's worker kept on tmpfs (for a warm restart)
        shutil.rmtree(default_ram_dir(str(tmp_path / "state")), ignore_errors=True)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    counted = [
        line.strip() for line in demo.stdout.splitlines() if line.startswith("   cachefs saw")
    ]
    assert len(counted) == 3, demo.stdout
    first, second, third = (COUNTS.match(line) for line in counted)
    assert first and second and third, counted
    hits, misses = int(first["hits"]), int(first["misses"])
    assert hits == 0 and misses >= files and first["ratio"] == "0.00", counted[0]
    hits, misses = int(second["hits"]), int(second["misses"])
    assert hits >= files and misses == 0 and second["ratio"] == "1.00", counted[1]
    assert second["rest"] is None
    if third["seen"] is not None:  # else: "saw none of these reads", the page cache served all
        assert int(third["misses"]) == 0 and int(third["seen"]) < files, counted[2]
        assert third["rest"], counted[2]
    assert f"verified {files} files byte-for-byte: 0 mismatches" in demo.stdout


COUNTS = re.compile(
    r"cachefs saw (?:none of these reads: the kernel's page cache served them all"
    r"|(?P<seen>\d+) block reads: (?P<hits>\d+) cache hits, (?P<misses>\d+) misses"
    r"(?:, \d+ of a block just fetched)? \(hit ratio (?P<ratio>[\d.]+)\)"
    r"(?P<rest>; the kernel's page cache served the rest)?)$"
)
