#!/usr/bin/env bash
# suite: HTTP figures: the engine process alone and over HTTP, 1 to 4 front ends, streaming, TTFT and ITL
# Usage: bash tests/gpu/run.sh serving [PHASE...]   (default: reference)
# random:llama-1b (MODEL) in bf16, 128 in / 128 out, ignore_eos, /v1/completions; the client is
# tests/gpu/serving/http_load.py (aiohttp in 8 processes, no code shared with the service), and each figure comes
# with the CPU share of each of the server's processes (cpu_share: pid -> CPU seconds per second of the window).
#   reference  bench offline on the same HEAVY_REQUESTS (default 1,024) requests, 256 at a time; the engine process
#              alone over its IPC (tests/gpu/serving/ipc_alone.py), all at once and 256 in flight; then one front
#              end: HEAVY_REQUESTS x 256 concurrent non-streaming and streaming, 1 stream, 8 streams
#   latency    one front end: 1 stream and 8 streams (TTFT, ITL) first, then 1,024 x 256
#   scale      2 and 4 front ends, 1,024 x 256 non-streaming and streaming; 4 with --stream-interval 4 and 16
#   penalties  one front end, 1,024 x 256 concurrent streams with and without frequency and presence penalties and ten
#              logit_bias entries in every request, three runs of each alternating
#   dashboard  one front end, 4,096 x 256 concurrent streams with no /dashboard page open and with five open
#              (tests/gpu/serving/pages.py polls as the page does), DASHBOARD_ROUNDS (default 3) runs of each in
#              the order ABBA ABBA ... (no drift favours either), DASHBOARD_REQUESTS (default 4,096) requests a run
#   decode     `bench offline` at --decode-steps 1 and 8, then one front end at --decode-steps 1, 8 and 4 (DECODE_STEPS):
#              HEAVY_REQUESTS x 256 non-streaming and streaming, each with its steps' times and the GPUs' use
#   decode-n4  `bench offline` at --decode-steps 1 and 8, then four front ends at --decode-steps 8: HEAVY_REQUESTS x 256
#              streaming twice, then non-streaming
#   profile    one front end, PROFILE_REQUESTS (default 16,384) x 256 concurrent streams while py-spy samples the server's processes (all of
#              them, idle threads too) for PROFILE_SECONDS (default 15), from 5 s in: collapsed stacks in profile.txt
# Each 1,024 x 256 run (HEAVY_REQUESTS requests) prints the engine's steps per phase (tests/gpu/serving/step_times.py)
# and the GPUs' mean utilization over the run, read by nvidia-smi every 100 ms.
#   SERVING_TIMEOUT  seconds for each client run (default 300); SERVE_TIMEOUT for a server's start (default 900)
source "$(dirname "$0")/env.sh"
T=${SERVING_TIMEOUT:-300}
steps_since() {  # NAME: the engine's steps since the last call, per phase: mean duration and host time; GPU utilization
  "$PYTHON" tests/gpu/serving/step_times.py "$URL" --state "${TMPDIR:-/tmp}/step-times-$SERVER.json" --label "$1"
}
busy() {  # NAME COMMAND...: run a client (COMMAND) while nvidia-smi reads the GPUs' utilization every 100 ms, from 1 s
  # in (http_load.py sends its first request 1 s after it starts) to the client's end; print their mean
  local name=$1 file=$RESULTS/utilization-$1.txt smi
  shift
  (sleep 1; exec nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 100) > "$file" 2>/dev/null &
  smi=$!
  "$@"
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  awk -v name="$name" '$1 ~ /^[0-9]+$/ {s += $1; n++}
    END {if (n) printf "%s: GPU utilization %.2f (mean of %d nvidia-smi readings during the run)\n", name, s / n / 100, n}' "$file"
}
heavy_run() {  # NAME [http_load.py's arguments...]: HEAVY_REQUESTS (default 1,024) x 256 concurrent, with the GPUs' use
  # and the engine's steps' times
  local name=$1
  shift
  busy "$name" load "$name" --requests "${HEAVY_REQUESTS:-1024}" --concurrency 256 "$@"
  steps_since "$name"
}
heavy() {  # N: the HEAVY_REQUESTS x 256 figures, non-streaming and streaming
  steps_since "n$1-before" > /dev/null
  heavy_run "n$1-non-streaming"
  heavy_run "n$1-streaming" --stream
}
streams() {
  load one-stream --requests 32 --concurrency 1 --procs 1 --stream
  load eight-streams --requests 128 --concurrency 8 --procs 8 --stream
  curl -s "$URL/metrics" | grep -E '^llm_(time_to_first_token_seconds|engine_step_seconds)_(sum|count)' | head -8
}
warm() { STEP_LINES=0 load "warm-$1" --requests 256; }  # compiles and fills what the first load would
phases reference "reference latency scale penalties dashboard profile decode decode-n4" "$@"
for phase in "${PHASES[@]}"; do
  case $phase in
    reference)
      step offline "$T" "$PYTHON" -m service bench offline --model "$MODEL" --num-requests "${HEAVY_REQUESTS:-1024}" \
        --max-num-seqs 256 --peers none --label serving-offline --json "$RESULTS/offline.json"
      step ipc-alone "$T" "$PYTHON" tests/gpu/serving/ipc_alone.py --model "$MODEL" --requests "${HEAVY_REQUESTS:-1024}" \
        --max-num-seqs 256 --rounds 3
      step ipc-alone-closed-loop "$T" "$PYTHON" tests/gpu/serving/ipc_alone.py --model "$MODEL" \
        --requests "${HEAVY_REQUESTS:-1024}" --max-num-seqs 256 --rounds 3 --concurrency 256
      serve 1 || continue
      warm 1; heavy 1; streams
      unserve ;;
    latency)
      serve 1 || continue
      warm 1; streams; heavy 1
      unserve ;;
    penalties)
      serve 1 || continue
      warm 1
      bias='{"frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {'
      bias+=$(for t in 101 2002 303 4004 505 6006 707 8008 909 10010; do printf '"%s": 1.5,' "$t"; done | sed 's/,$//')
      bias+='}}'
      for i in 1 2 3; do
        load "plain-$i" --requests 1024 --concurrency 256 --stream
        load "penalized-$i" --requests 1024 --concurrency 256 --stream --extra "$bias"
      done
      unserve ;;
    dashboard)
      serve 1 || continue
      warm 1
      steps_since warm > /dev/null
      with_pages() {
        "$PYTHON" tests/gpu/serving/pages.py "$URL" --pages 5 --seconds 600 > "$RESULTS/pages-$1.json" 2>&1 &
        local pages=$!
        sleep 3  # the pages have opened and fetched their history
        load "five-pages-$1" --requests "${DASHBOARD_REQUESTS:-4096}" --concurrency 256 --stream
        kill -INT "$pages"; wait "$pages"; cat "$RESULTS/pages-$1.json"
      }
      for i in $(seq "${DASHBOARD_ROUNDS:-3}"); do
        if [ $((i % 2)) -eq 1 ]; then
          load "no-pages-$i" --requests "${DASHBOARD_REQUESTS:-4096}" --concurrency 256 --stream; with_pages "$i"
        else
          with_pages "$i"; load "no-pages-$i" --requests "${DASHBOARD_REQUESTS:-4096}" --concurrency 256 --stream
        fi
      done
      # the engine's host time per step beside the step's duration, over all the runs; what the page got last
      steps_since dashboard
      curl -s "$URL/dashboard/data" | "$PYTHON" -c 'import json, sys; d = json.load(sys.stdin); p = d["points"]
print("dashboard:", d["status"], "gpus", d["gpus"], "processes", d["processes"], "points", len(p["t"]), "totals", d["totals"])
print("newest point:", {k: v[-1] for k, v in p.items() if k != "t"})'
      unserve ;;
    decode | decode-n4)
      for k in 1 8; do
        [ -f "$RESULTS/offline-k$k.json" ] && continue  # (decode and decode-n4 in one call: once)
        step "offline-k$k" "$T" "$PYTHON" -m service bench offline --model "$MODEL" --num-requests "${HEAVY_REQUESTS:-1024}" \
          --max-num-seqs 256 --peers none --decode-steps "$k" --label "serving-offline-k$k" --json "$RESULTS/offline-k$k.json"
      done
      if [ "$phase" = decode ]; then
        for k in ${DECODE_STEPS:-1 8 4}; do
          serve 1 --decode-steps "$k" || continue
          warm 1
          steps_since "n1-k$k-before" > /dev/null
          heavy_run "n1-k$k-non-streaming"
          heavy_run "n1-k$k-streaming" --stream
          unserve
        done
      else
        serve 4 --decode-steps 8 || continue
        warm 4
        steps_since n4-k8-before > /dev/null
        heavy_run n4-k8-streaming-1 --stream
        heavy_run n4-k8-streaming-2 --stream
        heavy_run n4-k8-non-streaming
        unserve
      fi ;;
    profile)
      serve 1 || continue
      warm 1
      steps_since warm > /dev/null
      load profile-streaming --requests "${PROFILE_REQUESTS:-16384}" --concurrency 256 --stream &
      loading=$!
      sleep 5
      "$site/bin/py-spy" record --subprocesses --idle --nonblocking --rate 500 --duration "${PROFILE_SECONDS:-15}" \
        --format raw --output "$RESULTS/profile.txt" --pid "$SERVER" > "$RESULTS/py-spy.log" 2>&1 \
        || { echo "!! py-spy failed:"; tail -5 "$RESULTS/py-spy.log"; }
      wait "$loading"  # (not the server, also in the background)
      steps_since profile
      unserve ;;
    scale)
      for n in 2 4; do
        serve "$n" || continue
        warm "$n"; heavy "$n"
        unserve
      done
      for interval in 4 16; do
        serve 4 --stream-interval "$interval" || continue
        warm 4; load "n4-streaming-interval-$interval" --requests 1024 --concurrency 256 --stream
        unserve
      done ;;
  esac
done
finish
