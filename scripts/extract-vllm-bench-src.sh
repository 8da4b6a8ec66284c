#!/usr/bin/env bash
# Extract the few vLLM 0.33 source files the region benchmarks run (bench/vllm_modules.py lists
# them and says which are vLLM's and which is plumbing) from vLLM's wheel into .vllm-src/
# (git-ignored), small enough to carry to a GPU machine that has no vLLM installed.
#
#   scripts/extract-vllm-bench-src.sh [path/to/vllm-0.33.0-*.whl] [destination]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
wheel="${1:-}"
destination="${2:-$repo/.vllm-src}"
if [[ -z "$wheel" ]]; then # no wheel given: fetch vLLM 0.33.0's from PyPI (no dependencies)
    download="$(mktemp -d)"
    trap 'rm -rf "$download"' EXIT
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$download" "vllm==0.33.0"
    wheel="$(ls "$download"/vllm-0.33.0-*.whl)"
fi
if [[ ! -f "$wheel" ]]; then
    echo "no vLLM 0.33 wheel at $wheel: pass its path (pip download vllm==0.33.0 --no-deps)" >&2
    exit 2
fi
rm -rf "$destination"
python3 "$repo/bench/vllm_modules.py" extract "$wheel" "$destination"
du -sh "$destination"
