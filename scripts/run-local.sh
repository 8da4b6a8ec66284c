#!/usr/bin/env bash
# The main job, locally (no cluster, no GPU): set up .venv, then create, populate and lock the
# example region and attach to it from one process per worker, reporting what was done and how
# fast. Extra arguments go to `kvshm demo` (e.g. --blocks 65536 for 16 GiB).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
exec "$VENV/bin/kvshm" demo examples/regions/demo.yaml "$@"
