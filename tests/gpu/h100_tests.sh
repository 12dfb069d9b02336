#!/usr/bin/env bash
# Second H100 call (device tool): quantized weights against bf16 on 128/128 x 256 (torchao travels in .whl),
# then the whole CUDA test file with its full log kept.
source tests/gpu/env.sh
echo "== quantized weights, 128/128 x 256, every mode in one process (4 engines: a fixed KV cache each)"
timeout 170 python3 -m service bench offline --quantization none,int8,int4,fp8 --iterations 3 --num-blocks 6000 \
  --json $OUT/quant.json > $OUT/quant.log 2>&1
echo "rc $?"; grep -E "throughput round|^\||^model|Error" $OUT/quant.log | cut -c1-250
echo "== tests/cuda/test_cuda.py"
timeout 330 python3 -m pytest -p no:cacheprovider tests/cuda/test_cuda.py -rA --durations=10 > $OUT/cuda_tests.log 2>&1
echo "rc $?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" $OUT/cuda_tests.log | cut -c1-240 | tail -20
