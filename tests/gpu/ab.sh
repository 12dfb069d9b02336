#!/usr/bin/env bash
# suite: this code against an older commit's (a copy of its service/ in .base), alternating in one call
# Usage: bash tests/gpu/run.sh ab PHASE...   (default: one full)
# Make the copy first, where git is (it travels with the working tree; .base/ is yours to delete after):
#   rm -rf .base && mkdir .base && git archive COMMIT service | tar -x -C .base
# The older code runs with .base ahead of this checkout on PYTHONPATH (and python -P, so that the working directory
# does not come first). A phase may name a quantization mode after a colon (default none): one:int8-w8a8.
#   one[:Q]        one request's decode step, 128 in / 512 out (tests/gpu/engine/decode_steps.py): this code, the
#                  older, again both
#   full[:Q]       the 256 x 128/128 decode step, the same
#   8b[:Q]         the 8B shape's 256 x 128/128 decode step: this code, then the older
#   mixed, 128     bench offline --telemetry (median of 7 runs without telemetry and 7 with), mixed lengths [100,
#                  1024] x 256 or 128/128 x 256, the two codes alternating (CODES, default "new base new base")
#   offline        bench offline, the 1B shape, 1,024 x 128/128 at 256, the two codes alternating (CODES)
#   http           one front end each, 1,024 x 128/128 over 256 concurrent streams (tests/gpu/serving/http_load.py),
#                  the two codes alternating (CODES), each server started afresh
#   attention      the prefill attention kernel of each code, each with its own launch configuration
#                  (tests/gpu/kernels/attention_sweep.py --current-only --base)
#   sweep          the split decode attention's configurations, this code (tests/gpu/kernels/decode_split_sweep.py;
#                  SWEEP_ARGS: its options)
#   grammars       both codes' engines in one process, paired: 256 x 128/128 plain, 32 of them and all 256 constrained
#                  by a JSON schema, ten rounds (tests/gpu/engine/paired.py; PAIRED_ARGS: its options; needs
#                  LLM_TEST_TOKENIZER). For steps the host bounds, where separate processes drift apart
#   AB_TIMEOUT  seconds for each run (default 300)
source "$(dirname "$0")/env.sh"
T=${AB_TIMEOUT:-300}
if [ ! -d .base/service ]; then
  echo "no .base/service: make it first (rm -rf .base && mkdir .base && git archive COMMIT service | tar -x -C .base)" >&2
  exit 2
fi
code() {  # CODE NAME COMMAND...: run COMMAND as a step with this code (new) or the older (base)
  local which=$1 name=$2
  shift 2
  if [ "$which" = base ]; then
    PYTHONPATH=$PWD/.base:$PYTHONPATH step "$name-base" "$T" "$@"
  else
    step "$name-new" "$T" "$@"
  fi
}
steps() {  # CODE NAME decode_steps.py's arguments...
  local which=$1 name=$2
  shift 2
  code "$which" "$name" "$PYTHON" -P tests/gpu/engine/decode_steps.py --profile-steps 0 "$@"
}
phases "one full" "one full 8b mixed 128 offline http attention sweep grammars" "$@"
for phase in "${PHASES[@]}"; do
  q=none
  [[ $phase == *:* ]] && q=${phase#*:}
  i=0
  case ${phase%%:*} in
    one) for c in new base new base; do
        steps "$c" "one-$q-$((++i))" --model random:llama-1b --num-requests 1 --output-len 512 --quantization "$q"
      done ;;
    full) for c in new base new base; do
        steps "$c" "full-$q-$((++i))" --model random:llama-1b --num-requests 256 --output-len 128 --quantization "$q"
      done ;;
    8b) for c in new base; do
        steps "$c" "8b-$q" --model random:llama-8b --num-requests 256 --output-len 128 --quantization "$q" \
          --gpu-memory-utilization 0.7
      done ;;
    mixed | 128)
      if [ "$phase" = mixed ]; then lengths=(--input-len uniform:100-1024 --output-len uniform:100-1024)
      else lengths=(--input-len 128 --output-len 128); fi
      for c in ${CODES:-new base new base}; do
        name=$phase-$((++i))
        code "$c" "$name" "$PYTHON" -P -m service bench offline "${lengths[@]}" --telemetry --peers none \
          --label "ab-$name-$c" --json "$RESULTS/$name-$c.json"
      done ;;
    offline) for c in ${CODES:-new base new base}; do
        name=offline-$((++i))
        code "$c" "$name" "$PYTHON" -P -m service bench offline --model random:llama-1b --num-requests 1024 \
          --max-num-seqs 256 --peers none --label "ab-$name-$c" --json "$RESULTS/$name-$c.json"
      done ;;
    http)
      printf '#!/bin/sh\nexec %s -P "$@"\n' "$PYTHON" > "$RESULTS/python-P" && chmod +x "$RESULTS/python-P"
      for c in ${CODES:-new base new base}; do
        name=http-$((++i))-$c
        if [ "$c" = base ]; then path=$PWD/.base:$PYTHONPATH; else path=$PYTHONPATH; fi
        PYTHONPATH=$path PYTHON=$RESULTS/python-P serve 1 || continue
        STEP_LINES=0 load "$name-warm" --requests 256
        load "$name" --requests 1024 --concurrency 256 --stream
        unserve
      done ;;
    attention) STEP_LINES=60 step attention "$T" "$PYTHON" tests/gpu/kernels/attention_sweep.py --current-only \
        --phases prefill --base .base/service/engine/runner/triton_attention.py --json "$RESULTS/attention.json" ;;
    sweep)  # SWEEP_ARGS: its options, split on spaces
      # shellcheck disable=SC2086
      STEP_LINES=60 step sweep "$T" "$PYTHON" tests/gpu/kernels/decode_split_sweep.py ${SWEEP_ARGS:-} ;;
    grammars)  # PAIRED_ARGS: its options, split on spaces
      # shellcheck disable=SC2086
      STEP_LINES=20 step grammars "$T" "$PYTHON" tests/gpu/engine/paired.py --model random:llama-1b \
        --tokenizer "${LLM_TEST_TOKENIZER:?a tokenizer for random weights: tests/gpu/wheels.sh saves one}" \
        ${PAIRED_ARGS:-} ;;
  esac
done
finish
