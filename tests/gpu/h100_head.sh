#!/bin/bash
# The output projection in int8 and the sampler's row maximum (issue 26), in one device call; sections in the order
# given (default: tests kernels one):
#   tests    their CUDA tests
#   kernels  tests/gpu/row_max.py: the row maximum and the head's product, alone
#   one      one request's decode step in int8-w8a8 and bf16, this code against the code before (a copy of its
#            service/ in .base: rm -rf .base; mkdir .base; git archive <commit> service | tar -x -C .base)
#   full     256 x 128/128 decode steps in int8-w8a8, this code against the code before
source tests/gpu/env.sh
nvidia-smi --query-gpu=uuid --format=csv,noheader
steps() {  # quantization, code, requests, output length
  [ $2 = base ] && P=$PWD/.base:$PYTHONPATH || P=$PYTHONPATH
  echo "== 1B $3 x 128/$4, --quantization $1, $2"
  env PYTHONPATH=$P timeout 90 python3 tests/gpu/decode_steps.py --model random:llama-1b --num-requests $3 \
    --output-len $4 --profile-steps 0 --quantization $1 2>&1 | grep -E "decode at batch|output tok/s"
}
for section in ${@:-tests kernels one}; do
  case $section in
  tests)
    t=tests/test_cuda.py
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rf "$t::test_cuda_row_max_kernel_equals_torch_max" \
      "$t::test_cuda_engine_greedy_matches_transformers" "$t::test_cuda_nan_logits_fail_the_step_and_the_engine_serves_on" \
      "$t::test_cuda_w8a8_engine_compiles_once_and_matches_transformers" > $OUT/tests.log 2>&1
    echo "pytest exit $?"; grep -E "passed|failed|FAILED|Fatal|Error|^tests/" $OUT/tests.log | head -20 ;;
  kernels) timeout 90 python3 tests/gpu/row_max.py 2>&1 | grep -v -i warn ;;
  one) for q in int8-w8a8 none; do for c in new base; do steps $q $c 1 512; done; done ;;
  full) for q in int8-w8a8; do for c in new base; do steps $q $c 256 128; done; done ;;
  esac
done
