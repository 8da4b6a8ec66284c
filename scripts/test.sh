#!/usr/bin/env bash
# Every test, from a fresh clone: makes its own venv and tools, then ruff, mypy, the import
# contracts (lint-imports; [tool.importlinter] in pyproject.toml) and pytest.
# Fails on any failure, and on any test skipped for a reason other than "no CUDA device".
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh

echo "== ruff"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
echo "== mypy"
"$VENV/bin/mypy"
echo "== lint-imports"
"$VENV/bin/lint-imports"
echo "== pytest"
"$VENV/bin/python" -m pytest "$@"
