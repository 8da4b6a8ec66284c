# The kvshm agent and operator image (one image, two commands: kvshm-agent, kvshm-operator).
# No torch here: the serving image installs kvshm[vllm] into vLLM's (examples/serving/Dockerfile).
#
#   docker build -t kvshm:dev --build-arg REVISION="$(git rev-parse HEAD)" .
#
# Both stages use one base pinned to an exact Python and Debian release (hadolint checks it).
# Release builds also pin its digest, resolved when the release is cut, in both FROM lines:
# FROM python:3.11.13-slim-bookworm@sha256:<digest from `docker buildx imagetools inspect`>.
# Health: Kubernetes ignores HEALTHCHECK, so the chart probes the processes' own endpoints:
# agent GET /healthz (liveness) and /readyz (readiness) on :9464, operator (kopf) GET /healthz on
# :8080; /metrics on :9464 (agent) and :9465 (operator).
FROM python:3.11.13-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/kvshm
WORKDIR /src
# only what the wheel is built from (.dockerignore keeps the rest out of the context): the image
# does not change with tests or docs
COPY pyproject.toml README.md ./
COPY constraints/runtime.txt ./constraints/runtime.txt
# the source roots the agent and operator run (docs/ARCHITECTURE.md, Components): agent/,
# operator/, common/ (api, endpoints, region, ipc) and cli/ (the `kvshm` command); not serving/ (transfer and
# the vLLM plugin, which need torch)
COPY agent ./agent
COPY common ./common
COPY cli ./cli
COPY operator ./operator
# the agent and operator extras only (kubernetes, kopf, prometheus-client): no torch; at the
# versions the tests ran (constraints/runtime.txt), not whatever is newest at build time. Then
# pip and setuptools leave the venv: nothing in the image installs anything.
RUN /opt/kvshm/bin/pip install --no-compile --constraint constraints/runtime.txt ".[agent,operator]" \
    && /opt/kvshm/bin/python -c "import kvshm.agent.cli, kvshm.operator.main, kvshm.cli" \
    && if /opt/kvshm/bin/python -c "import kvshm.transfer" 2>/dev/null; then \
         echo "the serving pods' code (serving/) must not be in the agent/operator image" >&2; exit 1; fi \
    && if /opt/kvshm/bin/python -c "import torch" 2>/dev/null; then \
         echo "torch must not be in the agent/operator image" >&2; exit 1; fi \
    && /opt/kvshm/bin/python -m pip uninstall --yes pip setuptools \
    && /opt/kvshm/bin/python -m compileall -q /opt/kvshm/lib

FROM python:3.11.13-slim-bookworm
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="kvshm" \
      org.opencontainers.image.description="kvshm node agent and operator: a shared, pre-populated CPU tier for vLLM's KV-cache offload region" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11.13-slim-bookworm"
COPY --from=build /opt/kvshm /opt/kvshm
ENV PATH=/opt/kvshm/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Non-root by default (the operator and `helm test` run so); the agent's DaemonSet runs it as
# root with every capability dropped but IPC_LOCK/CHOWN/FOWNER/DAC_OVERRIDE, because it creates
# region files for other users under a root-owned hostPath and reaches them inside their owners'
# 0700 directories.
USER 65532:65532
WORKDIR /tmp
EXPOSE 9464 9465 8080
CMD ["kvshm-agent", "--help"]
