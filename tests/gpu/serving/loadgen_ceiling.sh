#!/bin/bash
# Load-generator figures on the 16-core GPU machine (issue 25), in one call (device tool, carry .whl):
#   1. the ceiling against bench mock-server (no model, tokens as fast as it can write them) at 1,024 concurrent
#      streams, 16,384 requests of 128 tokens, for three splits of the cores between mock server and generator;
#   2. on the H100, random:llama-1b bf16 behind API_SERVERS front ends (4), 256 concurrent, 128 in / 128 out,
#      streaming: bench serve (8,192 requests, its cross-check against the server's histograms on) and the
#      independent client tests/gpu/serving/http_load.py (aiohttp, 8 processes, 8,192 requests), ROUNDS rounds (2) in ABBA
#      order (ours, theirs, theirs, ours: use an even number).
# Usage: [GEN_WORKERS=8] [API_SERVERS=4] [ROUNDS=2] bash tests/gpu/serving/loadgen_ceiling.sh [mock|real|all]
set -u
cd "$(dirname "$0")/../../.."
source tests/gpu/env.sh
phase=${1:-all}
nproc; nvidia-smi -L

if [ "$phase" != real ]; then
  for split in "4 12" "6 10" "8 8"; do
    set -- $split
    python3 -m service bench mock-server --port 8100 --workers $1 --itl-ms 0 > $OUT/mock-$1.log 2>&1 &
    MOCK=$!
    for _ in $(seq 100); do curl -sf http://127.0.0.1:8100/health > /dev/null && break; sleep 0.2; done
    echo "== mock workers $1, generator workers $2"
    python3 -m service bench serve --url http://127.0.0.1:8100 --max-concurrency 1024 --num-requests 16384 \
      --input-len 128 --output-len 128 --workers $2 --server-metrics off --progress off \
      --json $OUT/mock-$1-$2.json 2>&1 | quiet | grep -v "^$" | tail -25
    curl -s http://127.0.0.1:8100/metrics | grep '^llm_mock_streamed'
    kill $MOCK; wait $MOCK 2>/dev/null
  done
fi

if [ "$phase" != mock ]; then
  M=random:llama-1b
  python3 -m service serve --model $M --device cuda --port 8000 --max-num-seqs 256 --max-waiting 4096 \
    --api-servers ${API_SERVERS:-4} > $OUT/serve.log 2>&1 &
  SERVER=$!
  for _ in $(seq 900); do
    [ "$(grep -c 'linked to the engine process' $OUT/serve.log)" -ge ${API_SERVERS:-4} ] && break
    kill -0 $SERVER 2>/dev/null || { tail -30 $OUT/serve.log; exit 1; }
    sleep 1
  done
  PIDS=$(pgrep -P $SERVER | paste -sd,)
  python3 tests/gpu/serving/http_load.py http://127.0.0.1:8000 --model $M --requests 512 --concurrency 256 --stream \
    --label warm > /dev/null
  spread() {  # mid-run: established connections on the port by front-end process (the lean between clients)
    sleep 8
    command -v ss > /dev/null && echo "connections by front end: $(ss -tnpH state established '( sport = :8000 )' \
      | grep -o 'pid=[0-9]*' | sort | uniq -c | awk '{print $1}' | sort -n | paste -sd' ')"
  }
  ours() {
    spread &
    echo "== bench serve, run $1"
    python3 -m service bench serve --url http://127.0.0.1:8000 --model $M --max-concurrency 256 \
      --num-requests 8192 --input-len 128 --output-len 128 --random-token-range 100:30000 --workers ${GEN_WORKERS:-8} \
      --progress off --json $OUT/serve-$1.json 2>&1 | quiet | tail -45
  }
  theirs() {
    spread &
    echo "== independent client (aiohttp, 8 processes), run $1"
    python3 tests/gpu/serving/http_load.py http://127.0.0.1:8000 --model $M --requests 8192 --concurrency 256 \
      --procs 8 --stream --pids "$PIDS" --label "independent-$1"
  }
  # ABBA: ours, theirs, theirs, ours, ..., so that a server drifting over the call hits both clients alike
  for run in $(seq ${ROUNDS:-2}); do
    if [ $((run % 2)) = 1 ]; then ours $run; theirs $run; else theirs $run; ours $run; fi
  done
  kill -TERM $SERVER; wait $SERVER; echo "server exit status $?"
fi
