#!/usr/bin/env bash
# suite: where the engine's steps go, the attention kernels on the serving shapes, telemetry's metrics and traces cost
# Usage: bash tests/gpu/run.sh steps [PHASE...]   (default: steps kernel metrics traces)
#   steps    python -m service.bench.offline.steps: by kind of step (decode, mixed, prefill; graph or eager) the
#            wall time, the device's busy time, the host's time and the device's time by kind of kernel, on mixed
#            lengths [100, 1024] x 256 (each kind's 12 costliest kernels), then on 128/128 x 256 with the host's
#            costliest functions under cProfile
#   fp8      the mixed lengths' steps with the 8-bit KV cache and with the model's dtype (6 kernels each)
#   8b       the 8B shape's steps, 128/128 x 1,024 at 1,024 sequences, in bf16 and in fp8-w8a8 (each kind's 12 costliest
#            kernels)
#   kernel   the attention kernels on the serving shapes (bench kernel --preset serving)
#   metrics  mixed lengths x 256 without and with the server's telemetry metrics: paired runs, median of 7
#   traces   the same with metrics and engine-step traces exported over OTLP/HTTP to a real receiver (tests/otlp.py)
#   STEPS_TIMEOUT  seconds for each run (default 300)
source "$(dirname "$0")/env.sh"
T=${STEPS_TIMEOUT:-300}
MIXED=(--input-len uniform:100-1024 --output-len uniform:100-1024)
TELEMETRY=("$PYTHON" -m service bench offline "${MIXED[@]}" --telemetry --peers none)
phases "steps kernel metrics traces" "steps fp8 8b kernel metrics traces" "$@"
for phase in "${PHASES[@]}"; do
  case $phase in
    steps)
      step steps-mixed "$T" "$PYTHON" -m service.bench.offline.steps "${MIXED[@]}" --top-kernels 12 \
        --json "$RESULTS/steps-mixed.json"
      step steps-128 "$T" "$PYTHON" -m service.bench.offline.steps --input-len 128 --output-len 128 --host-profile 40 \
        --json "$RESULTS/steps-128.json" ;;
    fp8) for kv in fp8 auto; do
        step "steps-mixed-kv-$kv" "$T" "$PYTHON" -m service.bench.offline.steps "${MIXED[@]}" --kv-cache-dtype "$kv" \
          --top-kernels 6 --json "$RESULTS/steps-mixed-kv-$kv.json"
      done ;;
    8b) for q in none fp8-w8a8; do
        step "steps-8b-$q" "$T" "$PYTHON" -m service.bench.offline.steps --model random:llama-8b --quantization "$q" \
          --num-requests 1024 --max-num-seqs 1024 --gpu-memory-utilization 0.8 --input-len 128 --output-len 128 \
          --top-kernels 12 --json "$RESULTS/steps-8b-$q.json"
      done ;;
    kernel) STEP_LINES=60 step kernel-serving "$T" "$PYTHON" -m service bench kernel --preset serving \
        --csv "$RESULTS/kernel-serving.csv" ;;
    metrics) step metrics "$T" "${TELEMETRY[@]}" --label metrics --json "$RESULTS/metrics.json" ;;
    traces)
      endpoint=$RESULTS/otlp-endpoint
      rm -f "$endpoint"
      # a real OTLP receiver in a process of its own: it writes its endpoint, then counts the spans until stopped
      "$PYTHON" -c "
import signal, sys, threading
from tests.otlp import Receiver
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
with Receiver('http/protobuf') as r:
    open(sys.argv[1], 'w').write(r.endpoint)
    try:
        threading.Event().wait()
    finally:
        print('spans received', len(r.spans), flush=True)
" "$endpoint" > "$RESULTS/otlp.log" 2>&1 &
      receiver=$!
      for _ in $(seq 100); do [ -s "$endpoint" ] && break; sleep 0.2; done
      OTEL_EXPORTER_OTLP_ENDPOINT=$(cat "$endpoint") step traces "$T" "${TELEMETRY[@]}" --label traces \
        --json "$RESULTS/traces.json"
      kill "$receiver"; wait "$receiver"
      grep "spans received" "$RESULTS/otlp.log" ;;  # the engine flushed its spans as it ended
  esac
done
finish
