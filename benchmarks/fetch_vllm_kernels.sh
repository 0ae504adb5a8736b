#!/usr/bin/env bash
# Extracts vLLM's LoRA Triton kernel files (vllm/lora/ops/triton_ops/) from the vLLM wheel into the
# git-ignored folder .vllm/ at the repository root, for benchmarks/vllm_kernels.py (side-by-side GPU
# runs). Nothing of vLLM is committed. Usage: bash benchmarks/fetch_vllm_kernels.sh [VERSION]
set -euo pipefail
version=${1:-0.33.0}
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "vllm==$version"
rm -rf "$root/.vllm"
mkdir -p "$root/.vllm"
python3 - "$tmp"/vllm-*.whl "$root/.vllm" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("vllm/lora/ops/triton_ops/")]
    z.extractall(out, names)
print(f"{len(names)} files of vLLM {wheel.rsplit('/', 1)[-1].split('-')[1]} in {out}")
PY
echo "$version" > "$root/.vllm/VERSION"
