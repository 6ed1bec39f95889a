"""docs/architecture.md's import tables match the import-linter contracts and the imports the
code has (scripts/import_table.py makes them; a module added, moved or importing something new
needs `.venv/bin/python scripts/import_table.py --write`)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_architecture_docs_import_tables_match_the_code():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "import_table.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
