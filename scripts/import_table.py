"""docs/architecture.md's import tables, made from the import-linter contracts (pyproject.toml)
and the imports the code really has (grimp, the graph lint-imports checks).

    .venv/bin/python scripts/import_table.py            # print the tables
    .venv/bin/python scripts/import_table.py --write    # put them into docs/architecture.md
    .venv/bin/python scripts/import_table.py --check    # exit 1 if the doc differs

The tables sit between the markers ``<!-- import-table:begin -->`` and ``<!-- import-table:end
-->``. The first lists the worker's layers contract top to bottom; the second every other module
of ``cachefs`` (a package counts as one) with the contracts that bound it. What each row
imports is generated; what it does is the doc's own text, kept on rewrite (a new row starts
with the first sentence of its module's docstring). tests/unit/test_docs_imports.py runs --check.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

import grimp
import tomllib

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
BEGIN = "<!-- import-table:begin -->"
END = "<!-- import-table:end -->"
#: The contract whose layers the first table lists.
LAYERS_OF = "cachefs."
#: Imports of packages outside the project that a row shows (the contracts name them).
SHOWN_EXTERNAL = ("pyfuse3",)


def contracts() -> list[dict[str, object]]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        config = tomllib.load(f)
    found: list[dict[str, object]] = config["tool"]["importlinter"]["contracts"]
    return found


def worker_layers(all_contracts: list[dict[str, object]]) -> list[str]:
    for contract in all_contracts:
        layers = contract.get("layers")
        if (
            contract.get("type") == "layers"
            and isinstance(layers, list)
            and all(isinstance(layer, str) and layer.startswith(LAYERS_OF) for layer in layers)
        ):
            return [str(layer) for layer in layers]
    raise SystemExit(f"no layers contract of {LAYERS_OF}* modules in pyproject.toml")


def component_of(module: str, layers: list[str]) -> str:
    """The row a module belongs to: the layer that holds it, else its top-level module or
    package under cachefs (a module of cachefs.fs, which the layers split, is its own row)."""
    for layer in sorted(layers, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    parts = module.split(".")
    if parts[0] != "cachefs":
        return parts[0]  # coordinator, tf_dataset, an external package
    if len(parts) >= 3 and parts[1] == "fs":
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def imports_by_component(layers: list[str]) -> dict[str, set[str]]:
    sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph(
        "cachefs", "coordinator", "tf_dataset", include_external_packages=True
    )
    found: dict[str, set[str]] = {}
    for module in graph.modules:
        if module.split(".")[0] != "cachefs" or module.startswith("cachefs.csi.proto"):
            continue
        row = component_of(module, layers)
        targets = found.setdefault(row, set())
        for imported in graph.find_modules_directly_imported_by(module):
            root = imported.split(".")[0]
            if root not in ("cachefs", "coordinator", "tf_dataset", *SHOWN_EXTERNAL):
                continue
            target = component_of(imported, layers)
            if target != row and not (imported == "cachefs" and row == "cachefs"):
                targets.add(target)
    # No rows: the package root (its version), __main__, and a package the layers split (its
    # __init__; its modules have rows of their own).
    for row in ["cachefs", "cachefs.__main__", *found]:
        if (
            row == "cachefs"
            or row == "cachefs.__main__"
            or any(layer.startswith(row + ".") for layer in layers)
        ):
            found.pop(row, None)
    return found


def path_of(component: str) -> str:
    """``cachefs/fs/core.py`` or ``cachefs/cache/``."""
    relative = Path(*component.split("."))
    if (ROOT / relative).is_dir():
        return f"`{relative}/`"
    return f"`{relative}.py`"


def short(component: str) -> str:
    return component.removeprefix("cachefs.")


def first_sentence(component: str) -> str:
    """The first sentence of the module's (or package's) docstring."""
    relative = ROOT.joinpath(*component.split("."))
    source = relative / "__init__.py" if relative.is_dir() else relative.with_suffix(".py")
    doc = ast.get_docstring(ast.parse(source.read_text())) or ""
    text = " ".join(doc.split())
    match = re.match(r"(.+?\.)(\s|$)", text)
    return (match.group(1) if match else text).rstrip(".")


def written_cells(doc: str) -> dict[str, tuple[str | None, str]]:
    """What the doc's rows say by hand, by module cell: (layer label or None, does)."""
    cells: dict[str, tuple[str | None, str]] = {}
    for line in doc.splitlines():
        if not line.startswith("| ") or "`cachefs/" not in line:
            continue
        row = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if row[0].startswith("`cachefs/"):  # beside the layers: module | does | ...
            cells[row[0]] = (None, row[1])
        else:  # a layer: layer | module | does | ...
            cells[row[1]] = (row[0], row[2])
    return cells


def bounding_contracts(component: str, all_contracts: list[dict[str, object]]) -> list[str]:
    names = []
    for contract in all_contracts:
        sources = contract.get("source_modules")
        if contract.get("type") != "forbidden" or not isinstance(sources, list):
            continue
        if any(component == s or component.startswith(f"{s}.") for s in sources):
            names.append(str(contract["name"]))
    return names


def render(doc: str) -> str:
    all_contracts = contracts()
    layers = worker_layers(all_contracts)
    imports = imports_by_component(layers)
    kept = written_cells(doc)

    def imported(component: str) -> str:
        names = sorted(short(target) for target in imports.get(component, ()))
        return ", ".join(f"`{name}`" for name in names) or "nothing of the project"

    lines = [
        "The worker's layers (the `layers` contract in `pyproject.toml`), top to bottom: a layer",
        "may import the layers below it, never one above. The last column is what each imports",
        "today (its direct imports of the project's modules, and of pyfuse3).",
        "",
        "| layer | module | does | imports |",
        "|---|---|---|---|",
    ]
    for layer in layers:
        module = path_of(layer)
        label, does = kept.get(module, (None, ""))
        does = does or first_sentence(layer)
        lines.append(f"| {label or short(layer)} | {module} | {does} | {imported(layer)} |")
    lines += [
        "",
        "Beside the layers: every other module, with the `forbidden` contracts that bound it.",
        "",
        "| module | does | imports | bounded by |",
        "|---|---|---|---|",
    ]
    for component in sorted(set(imports) - set(layers)):
        module = path_of(component)
        does = kept.get(module, (None, ""))[1] or first_sentence(component)
        bounds = "; ".join(bounding_contracts(component, all_contracts)) or "-"
        lines.append(f"| {module} | {does} | {imported(component)} | {bounds} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="update docs/architecture.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if the doc differs")
    args = parser.parse_args()
    doc = DOC.read_text()
    table = "\n" + render(doc) + "\n"
    if not (args.write or args.check):
        print(table.strip())
        return 0
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    if args.write:
        DOC.write_text(doc[:start] + table + doc[end:])
    elif doc[start:end] != table:
        print(
            "docs/architecture.md's import tables differ from the code: "
            "run .venv/bin/python scripts/import_table.py --write",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
