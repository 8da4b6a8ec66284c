# Sourced by scripts/*.sh: creates .venv (CPU torch pinned) and installs kvshm with every extra.
# Idempotent; re-installs only when pyproject.toml changed.
VENV="${KVSHM_VENV:-$PWD/.venv}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
stamp="$VENV/.kvshm-installed"
TORCH="torch==2.13.0+cpu"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
if [[ ! -x $VENV/bin/python ]]; then
    echo "== creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
if [[ ! -f $stamp || pyproject.toml -nt $stamp || scripts/setup.sh -nt $stamp
      || constraints/runtime.txt -nt $stamp ]]; then
    echo "== installing kvshm[dev] into $VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    # the CPU build of torch (an unpinned torch would pull gigabytes of CUDA wheels): a local
    # wheel where pip's find-links have one, else PyTorch's CPU index; then its dependencies
    "$VENV/bin/pip" install -q --no-index --no-deps "$TORCH" 2>/dev/null ||
        "$VENV/bin/pip" install -q --no-deps "$TORCH" --index-url "$TORCH_CPU_INDEX"
    "$VENV/bin/pip" install -q "$TORCH"
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
# the node tier's programs: Kubernetes' node binaries into .tools/kube, containerd, runc, CNI,
# docker, debootstrap and busybox from Debian (tests/node)
scripts/install-node.sh
