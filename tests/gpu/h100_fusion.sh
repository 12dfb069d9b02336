#!/usr/bin/env bash
# The fused q/k/v projection on the H100 (issue 26), one device call: the CUDA tests and the CPU tests of the
# fusion (tiny models; the default model's wheel cannot travel), then decode steps and throughput with it off
# and on. Usage (device tool, carry .whl): bash tests/gpu/h100_fusion.sh
source tests/gpu/env.sh
keep() { grep -v -i -E "warn|^\s*$|it/s\]|configuration class" ; }
echo "== tests"
timeout 300 python3 -m pytest -q -p no:cacheprovider -x tests/cuda/test_cuda.py tests/engine/test_fusion.py \
  "tests/engine/test_engine_equivalence.py" -k "not default" 2>&1 | tail -4
for fuse in "--no-fuse-qkv" ""; do
  echo "== 1B, one request ${fuse:-fused}"
  timeout 120 python3 tests/gpu/engine/decode_steps.py --num-requests 1 --output-len 512 --profile-steps 0 $fuse 2>&1 | keep
  echo "== 8B, 256 x 128/128 ${fuse:-fused}"
  timeout 200 python3 tests/gpu/engine/decode_steps.py --model random:llama-8b --num-requests 256 --output-len 128 \
    --profile-steps 0 --gpu-memory-utilization 0.7 $fuse 2>&1 | keep
done
for fuse in off on; do
  echo "== bench offline 128/128 x 256, fuse-qkv $fuse"
  timeout 150 python3 -m service bench offline --peers none --fuse-qkv $fuse 2>&1 | grep -E "^\|" | cut -c1-160
done
