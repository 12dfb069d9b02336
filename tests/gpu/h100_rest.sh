#!/usr/bin/env bash
# The second single-GPU call: the CUDA tests the first call's time limit cut off, and a smaller kernel run.
source tests/gpu/env.sh
echo "== tests/cuda/test_cuda.py, the part not reached before"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda.py -k "bench_kernel or bench_model or nan or quantized or int4_needs" -rA > $OUT/cuda_rest.log 2>&1
echo "rc $?"; grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" $OUT/cuda_rest.log | cut -c1-220 | tail -16
echo "== bench kernel: decode and prefill, Llama-3.2-1B heads, contexts 1024 and 4096"
timeout 100 python3 -m service bench kernel --heads 32 --kv-heads 8 --head-dim 64 --context 1024,4096 --iterations 32 \
  --csv $OUT/kernel.csv --plot $OUT/kernel.png > $OUT/kernel.log 2>&1; echo "rc $?"
grep -E "^\|" $OUT/kernel.log | cut -c1-200 | head -40
