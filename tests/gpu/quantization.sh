#!/usr/bin/env bash
# suite: every quantization mode against bf16 in one process (1B and 8B shapes), and the 8-bit matrix products alone
# Usage: bash tests/gpu/run.sh quantization [PHASE...]   (default: 1b 8b kernels)
#   1b       bench offline, 256 x 128/128 on the 1B shape: the modes of QUANT_MODES_1B (default: none, weight-only
#            int8, int4 and fp8, int8-w8a8, fp8-w8a8) in one process, alternating over 7 rounds (each speed ratio the
#            median of the per-round ratios), with weight memory, KV tokens gained, greedy agreement and perplexity
#   8b       the same on the 8B shape, QUANT_MODES_8B (default: none, int8, int8-w8a8, fp8-w8a8: their engines and
#            KV caches, all in memory at once, take about 80 GB)
#   kernels  the int8 products alone (tests/gpu/kernels/int8_gemm.py) at decode's and prefill's row counts, then
#            fp8's, its sums in float32 and in the tensor cores' accumulator, with their error
#   tests    the quantization CUDA tests alone (the cuda suite runs them among the rest)
# Every mode gets the same fixed KV cache (--num-blocks 4400: 256 x 256 tokens without preemption): engines sized
# from free memory would each find less of it than the one loaded before.
#   QUANT_TIMEOUT  seconds for each run (default 600)
source "$(dirname "$0")/env.sh"
T=${QUANT_TIMEOUT:-600}
compare() {  # NAME MODEL MODES
  step "$1" "$T" "$PYTHON" -m service bench offline --model "$2" --quantization "$3" --iterations 7 --num-blocks 4400 \
    --label "$1" --json "$RESULTS/$1.json"
}
phases "1b 8b kernels" "1b 8b kernels tests" "$@"
for phase in "${PHASES[@]}"; do
  case $phase in
    1b) compare quant-1b random:llama-1b "${QUANT_MODES_1B:-none,int8,int4,fp8,int8-w8a8,fp8-w8a8}" ;;
    8b) compare quant-8b random:llama-8b "${QUANT_MODES_8B:-none,int8,int8-w8a8,fp8-w8a8}" ;;
    kernels)
      step int8-gemm "$T" "$PYTHON" tests/gpu/kernels/int8_gemm.py --rows 1,64,256,4096
      step fp8-gemm "$T" "$PYTHON" tests/gpu/kernels/int8_gemm.py --fp8 --rows 1,256,4096 ;;
    tests) step quant-tests "$T" "$PYTHON" -m pytest -q -p no:cacheprovider -rfEs tests/cuda -k "w8a8 or quant or silu" ;;
  esac
done
finish
