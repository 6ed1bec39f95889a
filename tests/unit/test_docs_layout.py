"""README.md's Layout lists every module of cachefs/, coordinator/ and tf_dataset/, and every
path it names exists: a module added, moved or removed shows here until the README says so."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("cachefs", "coordinator", "tf_dataset")
#: Generated code listed by its directory only (cachefs/csi/proto/README.md says how it is made).
LISTED_AS_A_DIRECTORY = ("cachefs/csi/proto",)
#: An entry's name starts within this many columns; deeper lines continue a description.
ENTRY_INDENT = 10


def layout_paths() -> list[str]:
    """The paths the Layout block names, from its indentation (two spaces per level)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    block = re.search(r"^## Layout\n.*?^```\n(.*?)^```", text, re.S | re.M)
    assert block, "README.md has no Layout block"
    paths, parents = [], []
    for line in block.group(1).splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent > ENTRY_INDENT:
            continue
        name = line.split()[0]
        depth = indent // 2
        parents = parents[:depth]
        path = "/".join([*parents, name.rstrip("/")])
        paths.append(path)
        if name.endswith("/"):
            parents.append(name.rstrip("/"))
    return paths


def modules() -> set[str]:
    found = set()
    for package in PACKAGES:
        for directory, subdirectories, files in os.walk(os.path.join(ROOT, package)):
            subdirectories[:] = [d for d in subdirectories if d != "__pycache__"]
            relative = os.path.relpath(directory, ROOT)
            if relative.startswith(LISTED_AS_A_DIRECTORY):
                continue
            found.add(relative)
            found.update(
                f"{relative}/{name}"
                for name in files
                if name.endswith(".py") and name not in ("__init__.py", "__main__.py")
            )
    return found


def test_the_layout_lists_every_module():
    listed = set(layout_paths())
    missing = sorted(modules() - listed)
    assert not missing, f"README.md's Layout does not list: {', '.join(missing)}"


def test_every_path_the_layout_names_exists():
    gone = [path for path in layout_paths() if not os.path.exists(os.path.join(ROOT, path))]
    assert not gone, f"README.md's Layout names what does not exist: {', '.join(gone)}"
