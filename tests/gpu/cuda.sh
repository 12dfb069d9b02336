#!/usr/bin/env bash
# suite: the CUDA tests (tests/cuda), all or part K of N: `cuda 2/3` (all: about 13.5 min on one H200)
# Usage: bash tests/gpu/run.sh cuda [K/N] [pytest's arguments...]   e.g. cuda 1/3, cuda -k w8a8, cuda 2/3 -x
# Part K of N is pytest's --shard K/N (tests/conftest.py): every N-th test in node-id order, so each part has its
# share of every parametrized family and of the engine tests. Three parts (cuda 1/3, cuda 2/3, cuda 3/3) are about
# a third of the whole run each, plus each part's own start (imports, the first compiles): well inside 8 minutes.
#   CUDA_TIMEOUT  seconds for the pytest run (default: 1200 for all, 540 for a part)
# The log: RESULTS/cuda.log (a part: cuda-K-of-N.log), with a line for each failure and skip and the slowest tests.
source "$(dirname "$0")/env.sh"
name=cuda
shard=()
if [[ ${1:-} =~ ^[0-9]+/[0-9]+$ ]]; then
  shard=(--shard "$1")
  name=cuda-${1/\//-of-}
  shift
fi
limit=${CUDA_TIMEOUT:-$([ ${#shard[@]} = 0 ] && echo 1200 || echo 540)}
STEP_LINES=40 step "$name" "$limit" "$PYTHON" -m pytest -q -p no:cacheprovider -rfEs --durations=15 tests/cuda \
  ${shard[@]+"${shard[@]}"} "$@"
finish
