#!/bin/bash
# Issue 26 on the H100 in one call (device tool, carry .whl). Phases (default: steps kernel metrics traces):
#   steps      where the steps go (python -m service.bench.offline.steps): mixed lengths, then 128/128 x 256 with
#              the host's costliest functions under cProfile; each kind of step's 12 costliest kernels;
#   kernel     the attention kernels on the serving shapes (bench kernel --preset serving);
#   metrics    mixed lengths [100, 1024] x 256, median of 7, with telemetry metrics as paired ratios (bench offline
#              --telemetry);
#   traces     the same with metrics + engine-step traces over OTLP/HTTP to a real receiver (tests/otlp.py).
#   8b         the step profile of random:llama-8b, 128/128 x 256 (the decode step against its roofline);
#   one        one request's decode step (tests/gpu/engine/decode_steps.py), the 1.0 ms target.
# Usage: bash tests/gpu/h100_steps.sh [steps] [kernel] [metrics] [traces] [8b] [one]
set -u
cd "$(dirname "$0")/../.."
source tests/gpu/env.sh
phases=${*:-steps kernel metrics traces}
nvidia-smi -L
MIXED="--input-len uniform:100-1024 --output-len uniform:100-1024"
TELEMETRY="python3 -m service bench offline $MIXED --telemetry --peers none"  # median of 7, paired ratios
for phase in $phases; do
  case $phase in
  steps)
    echo "== steps, mixed lengths"
    timeout 150 python3 -m service.bench.offline.steps $MIXED --top-kernels 12 --json $OUT/steps-mixed.json 2>&1 | quiet
    echo "== steps, 128/128"
    timeout 110 python3 -m service.bench.offline.steps --input-len 128 --output-len 128 --host-profile 40 \
      --json $OUT/steps-128.json 2>&1 | grep -v -i warn ;;
  8b)
    echo "== steps, 8B, 128/128"
    timeout 200 python3 -m service.bench.offline.steps --model random:llama-8b --input-len 128 --output-len 128 \
      --top-kernels 12 --json $OUT/steps-8b.json 2>&1 | quiet ;;
  one)
    echo "== one request, 128 in / 512 out: decode step p50 against 1.0 ms"
    timeout 150 python3 tests/gpu/engine/decode_steps.py --model random:llama-1b --num-requests 1 --output-len 512 2>&1 | quiet ;;
  kernel)
    echo "== bench kernel --preset serving"
    timeout 150 python3 -m service bench kernel --preset serving --csv $OUT/kernel.csv 2>&1 | quiet ;;
  metrics)
    echo "== mixed lengths, telemetry metrics"
    timeout 200 $TELEMETRY --json $OUT/mixed.json 2>&1 | quiet ;;
  traces)
    rm -f /tmp/otlp_endpoint  # a warm machine keeps the last call's
    python3 -c "
import signal, sys, threading
from tests.otlp import Receiver
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
with Receiver('http/protobuf') as r:
    open('/tmp/otlp_endpoint', 'w').write(r.endpoint)
    try:
        threading.Event().wait()
    finally:
        print('spans received', len(r.spans), flush=True)
" > $OUT/otlp.log 2>&1 &
    RECEIVER=$!
    for _ in $(seq 100); do [ -s /tmp/otlp_endpoint ] && break; sleep 0.2; done
    echo "== mixed lengths, telemetry metrics + step traces over OTLP to $(cat /tmp/otlp_endpoint)"
    OTEL_EXPORTER_OTLP_ENDPOINT=$(cat /tmp/otlp_endpoint) timeout 160 $TELEMETRY --json $OUT/traces.json 2>&1 | quiet
    kill $RECEIVER; wait $RECEIVER; grep "spans received" $OUT/otlp.log ;;  # the engine flushed its spans at exit
  *)
    echo "unknown phase $phase (steps, kernel, metrics, traces, 8b, one)"; exit 2 ;;
  esac
done
