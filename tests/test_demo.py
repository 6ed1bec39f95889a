"""The demo's dataset generator is deterministic, also when re-run over an existing tree."""

from __future__ import annotations

import hashlib
import os

from cachefs.demo import generate_image_tree


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
