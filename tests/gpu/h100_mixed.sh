#!/usr/bin/env bash
# Third H100 call (device tool): the NaN-logits test after its change; each quantization mode in its own
# process on 128/128 x 256 (median of 7, with the telemetry overhead; the 'none' run is also the engine's
# 128/128 figure); the mixed-length workload as a median of 7.
source tests/gpu/env.sh
echo "== the NaN-logits CUDA test"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda.py -k nan_logits > $OUT/nan.log 2>&1; echo "rc $?"
tail -1 $OUT/nan.log
for mode in none int8 int4 fp8; do
  echo "== 128/128 x 256, quantization $mode, 7 runs without and with telemetry"
  timeout 100 python3 -m service bench offline --quantization $mode --telemetry --peers none \
    --json $OUT/q-$mode.json 2>&1 | tee $OUT/q-$mode.log | grep -E "weights|^\|" | cut -c1-200
done
echo "== mixed [100, 1024] x 256, engine only, 7 runs without and with telemetry"
timeout 200 python3 -m service bench offline --input-len uniform:100-1024 --output-len uniform:100-1024 --telemetry \
  --peers none --json $OUT/mixed_telemetry.json 2>&1 | tee $OUT/mixed_telemetry.log | grep -E "^\|"
