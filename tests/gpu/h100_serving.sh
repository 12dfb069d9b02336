#!/bin/bash
# Serving figures on one H100 (issue 24), random:llama-1b bf16, 128 in / 128 out, ignore_eos, all in one call:
#   reference: bench offline (1,024 requests, 256 at a time), the engine process alone over IPC, then HTTP with
#              one front end: non-streaming and streaming at 256 concurrent, 1 stream, 8 streams
#   scale:     HTTP with 2 and 4 front ends, streaming at intervals 1, 4 and 16
#   latency:   HTTP with one front end: 1 stream and 8 streams (TTFT, ITL), then 1,024 x 256 streaming
# The client is tests/gpu/serving/http_load.py (aiohttp, 8 processes); each figure has the CPU share of every process
# of the server (cpu_share: pid -> CPU seconds per second of the window). Usage (device tool, carry .whl):
#   bash tests/gpu/h100_serving.sh reference|scale|latency
set -u
cd "$(dirname "$0")/../.."
source tests/gpu/env.sh
phase=${1:-reference}
M=random:llama-1b
PORT=8000
URL=http://127.0.0.1:$PORT

start_server() {  # N [serve flags...]
  local n=$1; shift
  python3 -m service serve --model $M --device cuda --port $PORT --max-num-seqs 256 --max-waiting 4096 \
    --api-servers $n "$@" > $OUT/serve-$n.log 2>&1 &
  SERVER=$!
  for _ in $(seq 900); do
    [ "$(grep -c 'linked to the engine process' $OUT/serve-$n.log)" -ge "$n" ] && break
    kill -0 $SERVER 2>/dev/null || { tail -30 $OUT/serve-$n.log; return 1; }
    sleep 1
  done
  PIDS=$(pgrep -P $SERVER | paste -sd,)  # the engine process and the front ends (the supervisor's children)
  echo "server N=$n $*: supervisor $SERVER, children $PIDS; $(grep 'serving on' $OUT/serve-$n.log | sed 's/.*: engine/engine/')"
  load --requests 256 --label warm > /dev/null
}
stop() { kill -TERM $SERVER; wait $SERVER; echo "server exit status $?"; }
load() { python3 tests/gpu/serving/http_load.py $URL --model $M --pids "$PIDS" "$@"; }
heavy() {  # the 1,024 x 256 figures, non-streaming and streaming
  load --requests 1024 --concurrency 256 --label "N=$1 non-streaming"
  load --requests 1024 --concurrency 256 --stream --label "N=$1 streaming $2"
}

nvidia-smi -L
if [ "$phase" = reference ]; then
  python3 -m service bench offline --model $M --num-requests 1024 --max-num-seqs 256 --peers none 2>&1 | quiet | tail -15
  python3 tests/gpu/serving/ipc_alone.py --model $M --requests 1024 --max-num-seqs 256 --rounds 3 2>&1 | grep '^{'
  start_server 1 || exit 1
  heavy 1 "interval 1"
  load --requests 32 --concurrency 1 --procs 1 --stream --label "1 stream"
  load --requests 128 --concurrency 8 --procs 8 --stream --label "8 streams"
  curl -s $URL/metrics | grep -E '^llm_(time_to_first_token_seconds|engine_step_seconds)_(sum|count)' | head -8
  stop
elif [ "$phase" = latency ]; then
  start_server 1 || exit 1
  load --requests 32 --concurrency 1 --procs 1 --stream --label "1 stream"
  load --requests 128 --concurrency 8 --procs 8 --stream --label "8 streams"
  curl -s $URL/metrics | grep -E '^llm_(time_to_first_token_seconds|engine_step_seconds)_(sum|count)' | head -8
  heavy 1 "interval 1"
  stop
else
  for n in 2 4; do
    start_server $n || exit 1
    heavy $n "interval 1"
    stop
  done
  for si in 4 16; do
    start_server 4 --stream-interval $si || exit 1
    load --requests 1024 --concurrency 256 --stream --label "N=4 streaming interval $si"
    stop
  done
fi
