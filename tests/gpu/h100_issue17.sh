#!/usr/bin/env bash
# The H100 figures issue 17 still lacked, in one call (device tool): the mixed-length workload against
# transformers' continuous batching, quantized weights against bf16, and bench model over more contexts,
# fp32 and the training step. Every run lands in $OUT/bench.db. Wheels the machine lacks travel in .whl.
source tests/gpu/env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee $OUT/gpu.txt
echo "== 1. mixed lengths: 256 requests, input and output uniform in [100, 1024], engine and generate_batch"
timeout 200 python3 -m service bench offline --input-len uniform:100-1024 --output-len uniform:100-1024 \
  --peers generate_batch --json $OUT/mixed.json 2>&1 | tee $OUT/mixed.log | quiet | tail -8
echo "== 2. quantized weights, 128/128 x 256, every mode in one process"
timeout 200 python3 -m service bench offline --quantization none,int8,int4,fp8 --iterations 3 --json $OUT/quant.json \
  2>&1 | tee $OUT/quant.log | quiet | tail -12
echo "== 3. bench model: five sizes, contexts 256 and 1024, fp32 and bf16, fwd / fwd+bwd / train"
timeout 150 python3 -m service bench model --sizes small,medium,large,xl,2.7b --context 256,1024 \
  --modes fwd,fwd+bwd,train --precision fp32,bf16 --warmup 2 --iterations 5 --json $OUT/model.json > $OUT/model.log 2>&1
echo "rc $?"; grep -E "^\|" $OUT/model.log | cut -c1-200 | tail -62
echo "== 4. bench model: quantized forward, bf16, context 512"
timeout 60 python3 -m service bench model --sizes small,2.7b --context 512 --modes fwd --precision bf16 \
  --quantization none,int8,int4,fp8 --warmup 2 --iterations 5 --json $OUT/model_quant.json > $OUT/model_quant.log 2>&1
echo "rc $?"; grep -E "^\|" $OUT/model_quant.log | cut -c1-220
