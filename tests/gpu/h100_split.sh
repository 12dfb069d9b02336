#!/bin/bash
# Split decode attention on the H100 (device tool; carry .whl, and .base for the phases that compare: a copy of the
# code before, `git archive <commit> service | tar -x -C .base`). Phases (default: tests sweep mixed):
#   tests   tests/cuda/test_cuda.py (TESTS_K: a -k expression; TESTS_TIMEOUT, default 420 s);
#   sweep   tests/gpu/kernels/decode_split_sweep.py (SWEEP_ARGS: its options), logged to $OUT/sweep.log;
#   one     one request's decode step p50 (tests/gpu/engine/decode_steps.py), this code then .base's;
#   mixed, 128   bench offline --telemetry (a median of 7 runs with telemetry off, 7 with it on) on mixed lengths
#                or 128/128 x 256, this code and .base's alternating (CODES, default "new base new base").
# (The step profile: tests/gpu/h100_steps.sh steps.)
# Usage: [VAR=...] bash tests/gpu/h100_split.sh [tests] [sweep] [one] [mixed] [128]
set -u
cd "$(dirname "$0")/../.."
source tests/gpu/env.sh
phases=${*:-tests sweep mixed}
nvidia-smi -L
MIXED="--input-len uniform:100-1024 --output-len uniform:100-1024"
for phase in $phases; do
  case $phase in
  tests)
    echo "== CUDA tests: ${TESTS_K:-all}"
    timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda.py ${TESTS_K:+-k "$TESTS_K"} \
      > $OUT/tests.log 2>&1
    grep -E "^(FAILED|ERROR)" $OUT/tests.log; tail -1 $OUT/tests.log ;;
  one)
    for code in new base; do
      [ $code = base ] && P=$PWD/.base:$PYTHONPATH || P=$PYTHONPATH
      echo "== one request, 128 in / 512 out, $code"
      env PYTHONPATH=$P timeout 150 python3 tests/gpu/engine/decode_steps.py --model random:llama-1b --num-requests 1 \
        --output-len 512 --profile-steps 0 2>&1 | grep -E "steps |decode at batch|profiled" | head -6
    done ;;
  sweep)
    echo "== decode split sweep"
    timeout 300 python3 tests/gpu/kernels/decode_split_sweep.py ${SWEEP_ARGS:-} 2>&1 | grep -v -i warn | tee $OUT/sweep.log ;;
  mixed|128)
    [ $phase = mixed ] && W=$MIXED || W="--input-len 128 --output-len 128"
    i=0
    for code in ${CODES:-new base new base}; do
      i=$((i + 1)); run=$phase-$code-$i
      [ $code = base ] && P=$PWD/.base:$PYTHONPATH || P=$PYTHONPATH
      echo "== $run"
      # -P: plain `python3 -m` puts the working directory (this code) ahead of PYTHONPATH's .base
      env PYTHONPATH=$P timeout 200 python3 -P -m service bench offline $W --telemetry --peers none --label $run \
        --json $OUT/$run.json > $OUT/$run.log 2>&1
      grep -E "^\| this|tok/s$" $OUT/$run.log | head -3 || true; grep -v -i warn $OUT/$run.log | tail -2
    done ;;
  esac
done
