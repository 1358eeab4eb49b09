#!/usr/bin/env bash
# Build a separate virtual environment with avalanche-lib and run contrail's Avalanche tests in it.
#
#   scripts/test_avalanche.sh VENV_DIR [pytest args...]
#
# Why a separate environment: avalanche-lib 0.6.0 requires torchvision, and
# the torchvision release pip picks pins its own torch (2.14.1 here), which
# would replace the torch of the main environment. The venv is created if
# missing and reused if present (each install step is then a quick no-op).
#
# TORCH_INDEX_URL (optional) is passed to the torch/torchvision step as
# --index-url, e.g. https://download.pytorch.org/whl/cpu for the CPU builds
# instead of PyPI's default CUDA build of torch (several GB).
# PYTHON (default: python3) is the interpreter the venv is made from.
#
# Each step's wall time is printed as "step <name>: <seconds>s".
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 VENV_DIR [pytest args...]" >&2
    exit 2
fi
VENV=$1
shift
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.14.1}
TORCHVISION_VERSION=${TORCHVISION_VERSION:-0.29.1}

step() {
    local name=$1
    shift
    local start=$SECONDS
    "$@"
    echo "step $name: $((SECONDS - start))s"
}

torch_index=()
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
    torch_index=(--index-url "$TORCH_INDEX_URL")
fi

[[ -x "$VENV/bin/python" ]] || step venv "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
step torch "${PIP[@]}" "${torch_index[@]}" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
step avalanche "${PIP[@]}" "avalanche-lib==0.6.0"
# contrail itself (editable: the tests import this checkout), its avalanche extra, and the test tools;
# tensorboard reads the event files back.
step contrail "${PIP[@]}" -e "$REPO[avalanche]" pytest tensorboard
cd "$REPO"
step tests "$VENV/bin/python" -m pytest -q -m avalanche tests/integrations/test_avalanche.py "$@"
