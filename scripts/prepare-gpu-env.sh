#!/usr/bin/env bash
# Prepares .gpu/ (git-ignored) to carry to a GPU machine whose python3 (3.12) has torch but no
# vLLM: vLLM 0.33.0's Python sources (the .py files of its wheel; no compiled extension is
# imported by the GPU tests and benchmarks) and wheels for Python 3.12 of the few packages its
# modules import that such a machine lacks. On the GPU machine:
#
#   source .gpu/env.sh && python3 -m pytest tests/region tests/transfer tests/vllm_plugin -m gpu
#
# Usage (here, with pip and the network): scripts/prepare-gpu-env.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-${VENV:-$PWD/.venv}/bin/python}"
GPU="$PWD/.gpu"
# what vLLM's modules that the tests and benchmarks import need beyond the GPU image's packages
# (the image has torch, numpy, triton, packaging, regex, requests, urllib3, idna, certifi, psutil)
WHEELS=(msgspec==0.22.0 pyzmq==27.3.0 cbor2==6.3.0 pybase64==1.5.1 cachetools==8.0.1)
# vLLM's config, block hashing and fs tier (bench/warm_restart/gpu.py runs its scheduler side):
# pydantic and transformers with what they import, at scripts/vllm-requirements.txt's pins
WHEELS+=(pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing_extensions==4.16.0 transformers==5.20.2 huggingface_hub==2.4.0 safetensors==0.8.0
    tokenizers==0.23.3 tqdm==4.70.1 PyYAML==6.0.4 httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0
    truststore==0.10.5 anyio==4.16.0 sniffio==1.3.1 cloudpickle==3.1.2 py-cpuinfo==9.0.0
    einops==0.8.2 xxhash==4.0.1 filelock==4.3.1 fsspec==2026.9.0 click==8.5.1
    # vllm.v1.request's structured output and parsers, and the HTTP stack its imports load
    xgrammar==0.2.8 apache-tvm-ffi==0.1.11 llguidance==1.7.6 partial-json-parser==0.2.1.1.post7
    oss-harmony==0.0.11 openai==3.54.0 fastapi==0.136.3 starlette==1.10.0 annotated-doc==0.0.7
    pillow==13.0.0 uvloop==0.23.0 prometheus_client==0.26.0 aiohttp==3.14.5
    aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 multidict==7.2.1
    propcache==0.5.4 yarl==1.25.1 charset-normalizer==3.5.3)
rm -rf "$GPU"
mkdir -p "$GPU/src" "$GPU/whl"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$work" "vllm==0.33.0"
"$PY" - "$work"/vllm-0.33.0-*.whl "$GPU/src" <<'EOF'
import sys
import zipfile

wheel, target = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as archive:
    names = [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")]
    names += [n for n in archive.namelist() if n.startswith("vllm-0.33.0.dist-info/")]
    archive.extractall(target, members=names)
print(f"vLLM 0.33.0: {len(names)} files")
EOF
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$GPU/whl" "${WHEELS[@]}"
# vLLM's 3,000 sources travel compressed (what a run may carry is bounded); env.sh unpacks them
tar -C "$GPU/src" -cJf "$GPU/vllm-src.tar.xz" .
rm -rf "$GPU/src"
cat >"$GPU/env.sh" <<'EOF'
# Sourced on the GPU machine from the repository root (scripts/prepare-gpu-env.sh made it).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/gpu-site \
    --upgrade .gpu/whl/*.whl || return 1
python3 -c 'import tarfile; tarfile.open(".gpu/vllm-src.tar.xz").extractall("/tmp/gpu-src")' || return 1
# kvshm's source roots as pyproject.toml lists them (their one spelling), then vLLM and its wheels
roots=$(python3 -c 'import tomllib; print(":".join(tomllib.load(open("pyproject.toml", "rb"))["tool"]["hatch"]["build"]["dev-mode-dirs"]))') || return 1
export PYTHONPATH="$(printf "$PWD/%s:" ${roots//:/ })/tmp/gpu-src:/tmp/gpu-site:$PWD"
export VLLM_TARGET_DEVICE=cpu PYTHONUNBUFFERED=1
EOF
du -sh "$GPU"
