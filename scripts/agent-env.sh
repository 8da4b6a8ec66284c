# Sourced by scripts/run-local.sh: .venv with the node agent's own dependencies and nothing more
# (kvshm[agent]: kubernetes, prometheus-client, pyyaml; no torch, vLLM or test tools), at the
# versions the image ships (constraints/runtime.txt). Idempotent; reinstalls only when
# pyproject.toml or the constraints changed. Needs Python 3.11 with venv (Debian: python3-venv).
VENV="${KVSHM_VENV:-$PWD/.venv}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
stamp="$VENV/.kvshm-agent-installed"
if [[ ! -x $VENV/bin/python ]]; then
    echo "== creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
if [[ ! -f $stamp || pyproject.toml -nt $stamp || constraints/runtime.txt -nt $stamp
      || scripts/agent-env.sh -nt $stamp ]]; then
    echo "== installing kvshm[agent] into $VENV"
    "$VENV/bin/pip" install -q -e ".[agent]" --constraint constraints/runtime.txt
    touch "$stamp"
fi
