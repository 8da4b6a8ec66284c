#!/usr/bin/env bash
# The main job, locally (no cluster, no GPU): set up .venv with the agent's own dependencies
# (scripts/agent-env.sh: no torch, vLLM or test tools), then run the node agent in local mode
# on examples/regions: it creates, populates and locks each region under /dev/shm/kvshm, prints
# status as it goes and serves /metrics, /healthz and /readyz on :9464 until Ctrl-C. Editing or
# deleting a YAML file changes or drains the region. Extra arguments go to kvshm-agent, e.g.
# --once (reconcile, print the table, exit) or --root DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/agent-env.sh
exec "$VENV/bin/kvshm-agent" --local examples/regions "$@"
