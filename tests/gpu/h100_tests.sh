#!/usr/bin/env bash
# The whole CUDA test file in one call (device tool), its full log kept, then the telemetry overhead again.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD LLM_BENCH_DB=sqlite:///$OUT/bench.db
echo "== tests/test_cuda.py"
timeout 400 python3 -m pytest -p no:cacheprovider tests/test_cuda.py -rA --durations=10 > $OUT/cuda_tests.log 2>&1
echo "rc $?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" $OUT/cuda_tests.log | cut -c1-240 | tail -20
echo "== bench offline --telemetry (engine only), 128/128 x 256"
timeout 150 python3 -m service bench offline --telemetry --peers none --json $OUT/telemetry.json 2>&1 \
  | grep -v -i -E "warn|^\s*$|^  " | tail -8
