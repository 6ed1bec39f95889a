#!/usr/bin/env bash
# The test command: set up, lint (ruff, import-linter layering, mypy), then the whole test suite with
# real FUSE mounts, a real S3 endpoint (moto server) and real worker processes, and its
# filesystem tests once more on a stock pyfuse3. Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports
.venv/bin/mypy  # strict on cachefs/ and coordinator/ (pyproject.toml [tool.mypy])
.venv/bin/python -m pytest -q "$@"
# The same filesystem tests on a stock pyfuse3 (no cachefs patch): it must keep working.
bash scripts/stock_pyfuse3_check.sh "$@"
