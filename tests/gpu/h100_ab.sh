#!/bin/bash
# This code against the code before, decode steps on the H100 in one device call (issue 26). The code before is a
# copy of its service/ in .base: rm -rf .base; mkdir .base; git archive <commit> service | tar -x -C .base
# Sections, in the order given:
#   tests     the CUDA tests of the compiled, graph-replayed engine (token for token against transformers)
#   kernels   the CUDA tests of the Triton kernels (split decode attention, row maximum, int8 products, SiLU x up)
#   one:Q     one request, 128 in / 512 out, --quantization Q: this code, the code before, again both
#   full:Q    256 x 128/128, the same
#   8b:Q      random:llama-8b, 256 x 128/128, this code then the code before
#   trace:Q   one request's profiled decode steps and their kernels, this code (decode_steps.py --trace)
#   rowmax    tests/gpu/kernels/row_max.py: the greedy sampler's row maximum and the 1B head's product, alone, this code
source tests/gpu/env.sh
nvidia-smi --query-gpu=uuid --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
steps() {  # code (new or base), model, requests, output length, then decode_steps.py's own arguments
  [ $1 = base ] && P=$PWD/.base:$PYTHONPATH || P=$PYTHONPATH
  echo "== $2 $3 x 128/$4 ${*:5}, $1"
  env PYTHONPATH=$P timeout 240 python3 tests/gpu/engine/decode_steps.py --model $2 --num-requests $3 --output-len $4 \
    "${@:5}" 2>&1 | grep -E "decode at batch|output tok/s|Error|error:"
}
cuda_tests() {  # log file, then test names of tests/cuda/test_cuda.py
  log=$1; shift
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rf "${@/#/tests/cuda/test_cuda.py::}" > $OUT/$log 2>&1
  echo "pytest exit $?"; grep -E "passed|failed|FAILED|Fatal|Error|^tests/" $OUT/$log | head -20
}
for section in "$@"; do
  q=${section#*:}
  case $section in
  tests) cuda_tests tests.log test_cuda_engine_greedy_matches_transformers \
      test_cuda_mixed_graphs_replay_every_step_with_no_compile_after_start \
      test_cuda_nan_logits_fail_the_step_and_the_engine_serves_on \
      test_cuda_w8a8_compiled_and_graph_replayed_layer_equals_eager_with_one_compile_for_all_row_counts \
      test_cuda_w8a8_engine_compiles_once_and_matches_transformers ;;
  kernels) cuda_tests kernels.log test_triton_split_decode_matches_torch_reference \
      test_cuda_row_max_kernel_equals_torch_max test_cuda_silu_mul_quantize_kernel_rounds_as_the_eager_ops \
      test_cuda_w8a8_kernel_lies_within_the_derived_bound_of_the_float32_reference ;;
  one:*) for c in new base new base; do steps $c random:llama-1b 1 512 --profile-steps 0 --quantization $q; done ;;
  full:*) for c in new base new base; do steps $c random:llama-1b 256 128 --profile-steps 0 --quantization $q; done ;;
  8b:*) for c in new base; do
      steps $c random:llama-8b 256 128 --profile-steps 0 --quantization $q --gpu-memory-utilization 0.7; done ;;
  rowmax) timeout 90 python3 tests/gpu/kernels/row_max.py 2>&1 | quiet ;;
  trace:*) timeout 240 python3 tests/gpu/engine/decode_steps.py --num-requests 1 --output-len 256 --profile-steps 20 \
      --quantization $q --trace $OUT/trace-$q.json 2>&1 | quiet | tail -45 ;;
  esac
done
