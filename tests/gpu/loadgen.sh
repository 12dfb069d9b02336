#!/usr/bin/env bash
# suite: the load generator's ceiling against the mock server, and its agreement with an independent client
# Usage: bash tests/gpu/run.sh loadgen [PHASE...]   (default: mock real)
#   mock  bench serve against bench mock-server (no model: tokens as fast as it writes them), 1,024 concurrent
#         streams, 16,384 requests of 128 tokens, for three splits of the machine's cores between the mock
#         server's workers and the generator's (MOCK_SPLITS, default "4:12 6:10 8:8", for 16 cores)
#   real  random:llama-1b (MODEL) behind API_SERVERS front ends (default 4), 256 concurrent streams, 128 in / 128
#         out: bench serve (8,192 requests, GEN_WORKERS workers, default 8; its check against the server's
#         histograms on) and tests/gpu/serving/http_load.py (aiohttp, 8 processes, 8,192 requests), ROUNDS rounds
#         (default 2) in ABBA order (ours, theirs, theirs, ours: an even number), with the connections each front
#         end holds mid-run; every run sends prompts of its own (bench serve --seed RUN, http_load.py a new seed
#         each run): a run that repeats the prompts of the run before finds them in the prefix cache
#   SERVE_ARGS       more options for the real phase's server (e.g. "--decode-steps 8")
#   LOADGEN_TIMEOUT  seconds for each client run (default 300)
source "$(dirname "$0")/env.sh"
T=${LOADGEN_TIMEOUT:-300}
phases "mock real" "mock real" "$@"
nproc
spread() {  # mid-run: the established connections on the port by front-end process (how the clients lean)
  sleep 8
  command -v ss > /dev/null && echo "connections by front end: $(ss -tnpH state established "( sport = :$PORT )" \
    | grep -o 'pid=[0-9]*' | sort | uniq -c | awk '{print $1}' | sort -n | paste -sd' ')"
}
ours() {
  local spreading
  spread & spreading=$!
  step "bench-serve-$1" "$T" "$PYTHON" -m service bench serve --url "$URL" --model "$MODEL" --max-concurrency 256 \
    --num-requests 8192 --input-len 128 --output-len 128 --random-token-range 100:30000 \
    --seed "$1" --workers "${GEN_WORKERS:-8}" --progress off --label "bench-serve-$1" --json "$RESULTS/bench-serve-$1.json"
  wait "$spreading"
}
theirs() {
  local spreading
  spread & spreading=$!
  step "independent-$1" "$T" "$PYTHON" tests/gpu/serving/http_load.py "$URL" --model "$MODEL" --requests 8192 \
    --concurrency 256 --procs 8 --stream --pids "$PIDS" --label "independent-$1"
  wait "$spreading"
}
for phase in "${PHASES[@]}"; do
  case $phase in
    mock)
      for split in ${MOCK_SPLITS:-4:12 6:10 8:8}; do
        mock=${split%:*} gen=${split#*:}
        "$PYTHON" -m service bench mock-server --port 8100 --workers "$mock" --itl-ms 0 > "$RESULTS/mock-$mock.log" 2>&1 &
        server=$!
        for _ in $(seq 100); do curl -sf http://127.0.0.1:8100/health > /dev/null && break; sleep 0.2; done
        step "mock-$mock-$gen" "$T" "$PYTHON" -m service bench serve --url http://127.0.0.1:8100 --max-concurrency 1024 \
          --num-requests 16384 --input-len 128 --output-len 128 --workers "$gen" --server-metrics off --progress off \
          --label "mock-$mock-$gen" --json "$RESULTS/mock-$mock-$gen.json"
        curl -s http://127.0.0.1:8100/metrics | grep '^llm_mock_streamed'
        kill "$server"; wait "$server" 2>/dev/null
      done ;;
    real)
      # shellcheck disable=SC2086  # (SERVE_ARGS: the server's options, split into words)
      serve "${API_SERVERS:-4}" ${SERVE_ARGS-} || continue
      STEP_LINES=0 step warm "$T" "$PYTHON" tests/gpu/serving/http_load.py "$URL" --model "$MODEL" --requests 512 \
        --concurrency 256 --stream --label warm
      # ABBA: ours, theirs, theirs, ours, ..., so that a server drifting over the call meets both clients alike
      for run in $(seq "${ROUNDS:-2}"); do
        if [ $((run % 2)) = 1 ]; then ours "$run"; theirs "$run"; else theirs "$run"; ours "$run"; fi
      done
      unserve ;;
  esac
done
finish
