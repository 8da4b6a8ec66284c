#!/usr/bin/env bash
# Puts vLLM's own code where tests/against_vllm can run it, on a CPU machine, with no 2nd torch:
#   - vLLM 0.33.0 and the packages its config/offload modules import, into the venv, every one
#     with --no-deps (scripts/vllm-requirements.txt pins them);
#   - vLLM 0.32.0's Python sources (the last single-file region release) unpacked into
#     <venv>/vllm-0.32.0, imported only by subprocesses that put it first on sys.path.
# Usage: scripts/install-vllm.sh <venv python>. Idempotent (see below when it is redone). Set
# PIP_FIND_LINKS to a directory holding the vLLM wheels to skip the download (pip's own
# variable; PyPI is used otherwise).
set -euo pipefail
python=$1
venv=$("$python" -c 'import sys; print(sys.prefix)')
requirements=scripts/vllm-requirements.txt
stamp="$venv/.vllm-installed"
old_release=0.32.0
old_tree="$venv/vllm-$old_release"

# redone when the pins or this script change, and after kvshm's own (re)install (pyproject.toml),
# which may have moved a package pinned here
fresh=true
for input in "$requirements" scripts/install-vllm.sh pyproject.toml "$venv/.kvshm-installed"; do
    [[ -f $stamp && ! $input -nt $stamp ]] || fresh=false
done
if $fresh; then
    exit 0
fi
echo "== installing vLLM (no dependencies resolved) into $venv"
torch_before=$("$python" -c 'import torch; print(torch.__version__)')
"$python" -m pip install -q --no-deps -r "$requirements"
torch_after=$("$python" -c 'import torch; print(torch.__version__)')
if [[ $torch_before != "$torch_after" ]]; then
    echo "install-vllm.sh: torch changed from $torch_before to $torch_after" >&2
    exit 1
fi

echo "== unpacking vLLM $old_release's Python sources into $old_tree"
download=$(mktemp -d)
trap 'rm -rf "$download"' EXIT
"$python" -m pip download -q --no-deps --only-binary=:all: -d "$download" "vllm==$old_release"
rm -rf "$old_tree"
"$python" - "$download"/vllm-"$old_release"-*.whl "$old_tree" <<'EOF'
import sys
import zipfile

wheel, target = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as archive:
    sources = [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")]
    archive.extractall(target, members=sources)
print(f"{len(sources)} files")
EOF
touch "$stamp"
