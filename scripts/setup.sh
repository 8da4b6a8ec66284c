# Sourced by scripts/*.sh: creates .venv (CPU torch pinned) and installs kvshm with every extra.
# Idempotent; re-installs only when pyproject.toml changed.
VENV="${KVSHM_VENV:-$PWD/.venv}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
stamp="$VENV/.kvshm-installed"
if [[ ! -x $VENV/bin/python ]]; then
    echo "== creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
if [[ ! -f $stamp || pyproject.toml -nt $stamp || scripts/setup.sh -nt $stamp
      || constraints/runtime.txt -nt $stamp ]]; then
    echo "== installing kvshm[dev] into $VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    # the CPU build of torch; an unpinned torch would pull gigabytes of CUDA wheels
    "$VENV/bin/pip" install -q "torch==2.13.0"
    # the agent and operator image's dependencies at the versions it builds with (Dockerfile):
    # the tests run what ships, and a release upstream changes neither until the file does
    "$VENV/bin/pip" install -q -e ".[dev]" --constraint constraints/runtime.txt
    touch "$stamp"
fi
# vLLM 0.33.0 (and 0.32.0's sources) for tests/against_vllm (vLLM's own code): no deps resolved
scripts/install-vllm.sh "$VENV/bin/python"
export PATH="$VENV/bin:$PATH"
# helm, hadolint, prometheus and promtool for the chart and monitoring tests (into .tools/bin)
scripts/install-tools.sh "$VENV/bin/python"
export PATH="$PWD/.tools/bin:$PATH"
