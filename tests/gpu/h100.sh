#!/usr/bin/env bash
# The single-GPU figures in one call (device tool, H100): engine against transformers' peers with the
# telemetry overhead, the CUDA test file, the kernel and model benchmarks. Wheels the machine lacks travel in
# .whl (see docs/benchmarks.md). Each step has its own time limit so that one slow step cannot eat the rest.
source tests/gpu/env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee $OUT/gpu.txt
echo "== 1. bench offline 256 x 128/128: engine (7 runs without and with telemetry) and peers"
timeout 190 python3 -m service bench offline --telemetry --json $OUT/offline.json 2>&1 | tee $OUT/offline.log | quiet | tail -9
echo "== 2. tests/cuda/test_cuda.py"
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda.py > $OUT/cuda_tests.log 2>&1
echo "rc $?"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/cuda_tests.log | tail -12
echo "== 3. bench kernel"
timeout 45 python3 -m service bench kernel --csv $OUT/kernel.csv --plot $OUT/kernel.png > $OUT/kernel.log 2>&1; echo "rc $?"
echo "== 4. bench model"
timeout 45 python3 -m service bench model --sizes small,medium,large,xl,2.7b --context 128,512 --modes fwd,fwd+bwd \
  --precision bf16 --warmup 2 --iterations 5 --json $OUT/model.json > $OUT/model.log 2>&1; echo "rc $?"
