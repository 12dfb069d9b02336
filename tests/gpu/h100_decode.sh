#!/usr/bin/env bash
# Decode steps on the H100 (issue 26), one device call: one request's decode step (1B, 128 in / 512 out) with a
# profile of its host work; the batch-256 decode step against its roofline for the 1B and the 8B shapes.
# Usage (device tool, carry .whl): bash tests/gpu/h100_decode.sh
source tests/gpu/env.sh
nvidia-smi -L
echo "== 1B, one request"
timeout 240 python3 tests/gpu/engine/decode_steps.py --model random:llama-1b --num-requests 1 --output-len 512 2>&1 | grep -v -i -E "warn|^\s*$|it/s\]"
echo "== 1B, 256 x 128/128"
timeout 180 python3 tests/gpu/engine/decode_steps.py --model random:llama-1b --num-requests 256 --output-len 128 \
  --profile-steps 0 2>&1 | grep -v -i -E "warn|^\s*$|it/s\]"
echo "== 8B, 256 x 128/128"
timeout 300 python3 tests/gpu/engine/decode_steps.py --model random:llama-8b --num-requests 256 --output-len 128 \
  --profile-steps 0 --gpu-memory-utilization 0.7 2>&1 | grep -v -i -E "warn|^\s*$|it/s\]"
