#!/usr/bin/env bash
# Fourth H100 call (device tool): quantized weights where the earlier calls ran out of time - bench model's
# quantized forward, each mode at 16 requests (a small decode batch), and int8 at 256 given a longer limit.
source tests/gpu/env.sh
echo "== bench model: quantized forward, bf16, context 512"
timeout 90 python3 -m service bench model --sizes small,2.7b --context 512 --modes fwd --precision bf16 \
  --quantization none,int8,int4,fp8 --warmup 2 --iterations 5 --json $OUT/model_quant.json > $OUT/model_quant.log 2>&1
echo "rc $?"; grep -E "^\|" $OUT/model_quant.log | cut -c1-220
for mode in none int8 int4 fp8; do
  echo "== 128/128 x 16, quantization $mode"
  timeout 60 python3 -m service bench offline --quantization $mode --num-requests 16 --peers none \
    --json $OUT/q16-$mode.json > $OUT/q16-$mode.log 2>&1; echo "rc $?"; grep -E "^\| this" $OUT/q16-$mode.log
done
echo "== 128/128 x 256, int8, one run"
timeout 150 python3 -m service bench offline --quantization int8 --peers none --json $OUT/q-int8.json \
  > $OUT/q-int8.log 2>&1; echo "rc $?"; grep -E "^\| this" $OUT/q-int8.log
