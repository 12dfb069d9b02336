#!/usr/bin/env bash
# suite: decode steps: one request's step and the batch-256 step against their roofline, the host's work per step
# Usage: bash tests/gpu/run.sh decode [PHASE...]   (default: one batch 8b host)
# Each decode_steps.py run (tests/gpu/engine/decode_steps.py) prints the engine's step durations by phase and the
# decode step against its roofline (weights and KV read at the memory bandwidth, or the FLOPs at the bf16 peak).
#   one     one request, 128 in / 512 out, on the 1B shape: each mode of DECODE_MODES (default: none int8-w8a8)
#   batch   256 requests x 128/128 on the 1B shape, each mode of DECODE_MODES
#   8b      the 8B shape: 256 x 128/128 in bf16, then one request (128 in / 256 out) with weight-only int8 and bf16
#   host    where the host's time goes in each step: scheduling, launch, the wait, the read-back
#           (tests/gpu/engine/host_steps.py), then the same as the engine process runs (--as-served)
#   profile one request's decode steps under the profiler: host time per op, the GPU's busy time per step, each
#           kernel; its trace in RESULTS/decode-trace.json (open it in Perfetto)
#   rows    the 8-bit kernel at few rows against cuBLAS bf16 (tests/gpu/kernels/int8_rows.py)
#   rowmax  the greedy sampler's row maximum and the 1B output projection alone (tests/gpu/kernels/row_max.py)
#   fusion  q, k and v (and gate and up) as one product against three (and two): one request and the 8B batch,
#           each with --no-fuse-qkv and without
#   DECODE_TIMEOUT  seconds for each run (default 300)
source "$(dirname "$0")/env.sh"
T=${DECODE_TIMEOUT:-300}
steps() {  # NAME [decode_steps.py's arguments...]
  local name=$1
  shift
  step "$name" "$T" "$PYTHON" tests/gpu/engine/decode_steps.py "$@"
}
phases "one batch 8b host" "one batch 8b host profile rows rowmax fusion" "$@"
for phase in "${PHASES[@]}"; do
  case $phase in
    one) for q in ${DECODE_MODES:-none int8-w8a8}; do
        steps "one-$q" --model random:llama-1b --num-requests 1 --output-len 512 --profile-steps 0 --quantization "$q"
      done ;;
    batch) for q in ${DECODE_MODES:-none int8-w8a8}; do
        steps "batch-$q" --model random:llama-1b --num-requests 256 --output-len 128 --profile-steps 0 --quantization "$q"
      done ;;
    8b)
      steps 8b-batch --model random:llama-8b --num-requests 256 --output-len 128 --profile-steps 0 \
        --gpu-memory-utilization 0.7
      for q in int8 none; do
        steps "8b-one-$q" --model random:llama-8b --num-requests 1 --output-len 256 --profile-steps 0 --quantization "$q"
      done ;;
    host)
      step host "$T" "$PYTHON" tests/gpu/engine/host_steps.py
      step host-as-served "$T" "$PYTHON" tests/gpu/engine/host_steps.py --as-served ;;
    profile) STEP_LINES=60 steps profile --model random:llama-1b --num-requests 1 --output-len 256 --profile-steps 20 \
        --trace "$RESULTS/decode-trace.json" ;;
    rows) step rows "$T" "$PYTHON" tests/gpu/kernels/int8_rows.py --rows 1,4,16,64 --json "$RESULTS/rows.json" ;;
    rowmax) step rowmax "$T" "$PYTHON" tests/gpu/kernels/row_max.py ;;
    fusion) for fuse in --no-fuse-qkv ""; do
        steps "fusion-one${fuse:+-off}" --num-requests 1 --output-len 512 --profile-steps 0 $fuse
        steps "fusion-8b${fuse:+-off}" --model random:llama-8b --num-requests 256 --output-len 128 --profile-steps 0 \
          --gpu-memory-utilization 0.7 $fuse
      done ;;
  esac
done
finish
