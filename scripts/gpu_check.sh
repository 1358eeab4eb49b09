#!/usr/bin/env bash
# contrail's GPU check: no downloads, under 8 minutes on one H100/H200 (see bench/gpu_check.py).
#
#   scripts/gpu_check.sh                  # every part, FSDP over all visible GPUs
#   scripts/gpu_check.sh --cpu-smoke      # the same code paths with a tiny model on CPU (2 gloo processes)
#   scripts/gpu_check.sh --json-dir DIR   # also write one JSON per part (default: $OUT when set)
#
# Each part runs in its own process (accelerate's state and vLLM's engine are process-wide), under
# what is left of GPU_CHECK_SECONDS (default 470 s). A failing or skipped part does not stop the
# others; the exit status is 1 when any part failed or ran out of time.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

smoke=()
args=()
for arg in "$@"; do
  case "$arg" in
    --cpu-smoke) smoke=(--cpu-smoke) ;;
    *) args+=("$arg") ;;
  esac
done
if [[ -n "${OUT:-}" && ! " ${args[*]:-} " =~ " --json-dir " ]]; then
  args+=(--json-dir "$OUT")
fi

limit=${GPU_CHECK_SECONDS:-470}
status=0
part() {  # part NAME COMMAND...: run with the remaining time budget
  local name=$1; shift
  local left=$((limit - SECONDS))
  if ((left < 15)); then
    echo "[$name] NOT RUN: the ${limit} s budget is spent"; status=1; return
  fi
  timeout "$left" "$@"
  local code=$?
  if ((code != 0)); then
    echo "[$name] FAILED (exit $code$( ((code == 124)) && echo ', out of time'))"; status=1
  fi
}

check=(bench/gpu_check.py "${smoke[@]}" ${args[@]+"${args[@]}"})
part matmul+grpo python "${check[0]}" matmul grpo "${check[@]:1}"
part vllm python "${check[0]}" vllm "${check[@]:1}"
part vllm-grpo python "${check[0]}" vllm-grpo "${check[@]:1}"

if ((${#smoke[@]})); then
  processes=2
  export ACCELERATE_USE_CPU=true OMP_NUM_THREADS=1   # gloo; bench/gpu_check.py turns the CPU state into FSDP2
else
  processes=$(python -c 'import torch; print(torch.cuda.device_count())')
fi
port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
part fsdp accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes "$processes" \
  --main_process_port "$port" "${check[0]}" fsdp "${check[@]:1}"

echo "[gpu_check] done in ${SECONDS} s; $( ((status == 0)) && echo 'all parts ran' || echo 'SOME PARTS FAILED')"
exit $status
