#!/usr/bin/env bash
# suite: bench offline: the 1B shape (1,024 x 128/128), mixed lengths, the 8B shape, transformers' peers, telemetry's cost
# Usage: bash tests/gpu/run.sh offline [PHASE...]   (default: 1b mixed 8b peers telemetry; more than one device
# tool call may be needed for all of them: name the phases)
#   1b         the 1B shape, 1,024 requests of 128 in / 128 out, 256 at a time: the median of 5 runs in one process
#   mixed      the 1B shape, 256 requests, input and output lengths uniform in [100, 1024]: the median of 5 runs
#   8b         the 8B shape, 256 x 128/128: bf16, fp8-w8a8 and int8-w8a8, each in a process of its own
#   peers      the engine against transformers' generate_batch and static generate on the same weights: 256 x 128/128,
#              then the mixed lengths against generate_batch (the slow one: transformers at about 1,000 tok/s)
#   telemetry  without and with the server's telemetry, paired runs (median of 7 each): 128/128 x 256, mixed lengths,
#              mixed lengths with the 8-bit KV cache
#   overlap    overlap scheduling on and off in one engine, alternating (python -m service.bench.offline.overlap)
#   scale      4,096 requests: the 1B shape at 512 and 1,024 sequences, the 8B shape at 256 and 1,024 in bf16 and
#              fp8-w8a8
#   samples    n samples sharing their prompt against distinct prompts, the engine alone: 64 prompts of 2,048
#              tokens x n 4 against 256, 128 out, two rounds (tests/gpu/engine/shared_prompts.py)
#   penalties  256 x 128/128 with and without frequency and presence penalties and ten logit_bias entries each, one
#              engine, five runs of each alternating (tests/gpu/engine/penalties.py)
#   grammars   256 x 128/128 with none, 32, or all requests constrained by a JSON schema (one schema; 16), the 1B
#              shape with the default model's tokenizer, step times like for like, and a 20-field schema's compile time
#              (tests/gpu/engine/grammars.py)
#   OFFLINE_TIMEOUT  seconds for each run (default 400)
source "$(dirname "$0")/env.sh"
T=${OFFLINE_TIMEOUT:-400}
MIXED=(--input-len uniform:100-1024 --output-len uniform:100-1024)
offline() {  # NAME [bench offline's arguments...]
  local name=$1
  shift
  step "$name" "$T" "$PYTHON" -m service bench offline "$@" --label "$name" --json "$RESULTS/$name.json"
}
phases "1b mixed 8b peers telemetry" "1b mixed 8b peers telemetry overlap scale samples penalties grammars" "$@"
for phase in "${PHASES[@]}"; do
  case $phase in
    1b) offline 1b --model random:llama-1b --num-requests 1024 --max-num-seqs 256 --peers none --iterations 5 ;;
    mixed) offline mixed --model random:llama-1b "${MIXED[@]}" --peers none --iterations 5 ;;
    8b) for q in none fp8-w8a8 int8-w8a8; do offline "8b-$q" --model random:llama-8b --quantization "$q" --peers none; done ;;
    peers)
      offline peers --model random:llama-1b
      offline peers-mixed --model random:llama-1b "${MIXED[@]}" --peers generate_batch ;;
    telemetry)
      offline telemetry --model random:llama-1b --telemetry --peers none
      offline telemetry-mixed --model random:llama-1b "${MIXED[@]}" --telemetry --peers none
      offline telemetry-mixed-fp8 --model random:llama-1b "${MIXED[@]}" --kv-cache-dtype fp8 --telemetry --peers none ;;
    samples) step samples "$T" "$PYTHON" tests/gpu/engine/shared_prompts.py --model random:llama-1b --prompts 64 --n 4 \
        --input-len 2048 --output-len 128 --rounds 2 ;;
    penalties) step penalties "$T" "$PYTHON" tests/gpu/engine/penalties.py --model random:llama-1b --requests 256 \
        --rounds 5 ;;
    grammars) step grammars "$T" "$PYTHON" tests/gpu/engine/grammars.py --model random:llama-1b \
        --tokenizer "${LLM_TEST_TOKENIZER:?needs a tokenizer: bash tests/gpu/wheels.sh, then carry .whl}" --rounds 3 ;;
    overlap) step overlap "$T" "$PYTHON" -m service.bench.offline.overlap --runs 7 --json "$RESULTS/overlap.json" ;;
    scale)
      for seqs in 512 1024; do
        offline "scale-1b-$seqs" --model random:llama-1b --num-requests 4096 --max-num-seqs "$seqs" --peers none
      done
      for q in none fp8-w8a8; do for seqs in 256 1024; do
        offline "scale-8b-$q-$seqs" --model random:llama-8b --quantization "$q" --num-requests 4096 --max-num-seqs "$seqs" \
          --peers none
      done; done ;;
  esac
done
finish
