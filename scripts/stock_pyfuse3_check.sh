#!/usr/bin/env bash
# The filesystem tests (tests/e2e/fs, the mounts, and tests/unit/fs) against a stock pyfuse3,
# without cachefs's patch: cachefs must still work there (ordinary opens, every READ in Python),
# as it says once in its log. The stock build goes into its own directory, put ahead of .venv's
# patched one with PYTHONPATH (worker processes the tests start inherit it). Run after
# scripts/setup.sh, as root; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${STOCK_PYFUSE3_DIR:-/tmp/cachefs-stock-pyfuse3}
version=$(sed -n 's/^VERSION = "\(.*\)"$/\1/p' third_party/pyfuse3/build.py)
is_stock="import pyfuse3, sys; sys.exit(0 if pyfuse3.__version__ == '$version' and not hasattr(pyfuse3, 'CACHEFS_PATCH') else 1)"
if ! PYTHONPATH=$target .venv/bin/python -c "$is_stock" 2>/dev/null; then
  rm -rf "$target"
  .venv/bin/python -m pip install -q --no-deps --no-binary :all: --target "$target" \
    "pyfuse3==$version"
fi
PYTHONPATH=$target .venv/bin/python -c "$is_stock"
PYTHONPATH=$target .venv/bin/python -m pytest -q tests/unit/fs tests/e2e/fs "$@"
