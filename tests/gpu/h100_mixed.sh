#!/usr/bin/env bash
# Third H100 call (device tool): the mixed-length workload as a median of 7 runs, with the telemetry overhead,
# and the same for 128/128 x 256.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD LLM_BENCH_DB=sqlite:///$OUT/bench.db
quiet() { grep -v -i -E "warn|^\s*$|^  |it/s\]" ; }
echo "== mixed [100, 1024] x 256, engine only, 7 runs without and with telemetry"
timeout 250 python3 -m service bench offline --input-len uniform:100-1024 --output-len uniform:100-1024 --telemetry \
  --peers none --json $OUT/mixed_telemetry.json 2>&1 | tee $OUT/mixed_telemetry.log | quiet | tail -8
echo "== 128/128 x 256, engine only, 7 runs without and with telemetry"
timeout 150 python3 -m service bench offline --telemetry --peers none --json $OUT/telemetry.json 2>&1 \
  | tee $OUT/telemetry.log | quiet | tail -8
