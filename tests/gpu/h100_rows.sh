#!/bin/bash
# The 8-bit kernel's tiles for few rows (issue 26), in one device call; sections in the order given (default:
# tests one):
#   tests  its CUDA tests (the W8A8 kernel and layer, and the int8 engine against transformers)
#   one    one request's decode step with each int8 mode, this code against the code before (a copy of its service/
#          in .base: rm -rf .base; mkdir .base; git archive <commit> service | tar -x -C .base), then 8B int8
#   mid    every candidate tile at 32 rows, the table at 64 (tests/gpu/kernels/int8_rows.py), and 128/128 x 32 with
#          --quantization none,int8,int8-w8a8 in one process, this code and the code before
source tests/gpu/env.sh
nvidia-smi --query-gpu=uuid,name --format=csv,noheader
one() {  # model, quantization, output length, code
  [ $4 = base ] && P=$PWD/.base:$PYTHONPATH || P=$PYTHONPATH
  echo "== $1 one request, 128 in / $3 out, --quantization $2, $4"
  env PYTHONPATH=$P timeout ${T:-70} python3 tests/gpu/engine/decode_steps.py --model $1 --num-requests 1 --output-len $3 \
    --profile-steps 0 --quantization $2 2>&1 | grep -E "decode at batch"
}
for section in ${@:-tests one}; do
  case $section in
  tests)
    t=tests/cuda/test_cuda.py::test_cuda_w8a8
    timeout 130 python3 -m pytest -q -p no:cacheprovider \
      ${t}_kernel_lies_within_the_derived_bound_of_the_float32_reference \
      ${t}_compiled_and_graph_replayed_layer_equals_eager_with_one_compile_for_all_row_counts \
      "${t}_engine_compiles_once_and_matches_transformers[int8]" 2>&1 | tail -3 ;;
  one)
    for q in int8 int8-w8a8; do for code in new base; do one random:llama-1b $q 512 $code; done; done
    for code in new base; do T=80 one random:llama-8b int8 256 $code; done ;;
  mid)
    timeout 200 python3 tests/gpu/kernels/int8_rows.py --sweep --rows 32 --json $OUT/rows32.json | grep -v -i warn
    timeout 60 python3 tests/gpu/kernels/int8_rows.py --rows 64 | grep -v -i warn
    for code in new base; do
      [ $code = base ] && P=$PWD/.base:$PYTHONPATH || P=$PYTHONPATH
      echo "== 128/128 x 32, $code"
      # -P: plain `python3 -m` puts the working directory (this code) ahead of PYTHONPATH's .base
      env PYTHONPATH=$P timeout 150 python3 -P -m service bench offline --quantization none,int8,int8-w8a8 \
        --num-requests 32 --repeats 3 --num-blocks 2000 --peers none 2>&1 | grep -E "^\|"
    done ;;
  esac
done
