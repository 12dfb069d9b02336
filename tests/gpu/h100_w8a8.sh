#!/usr/bin/env bash
# W8A8 on the H100 (issue 27), through the device tool: the CUDA tests of the new kernels, then bf16 against
# int8-w8a8 and fp8-w8a8 in one process (modes alternating, 7 rounds: the speed ratio is the median of the
# per-round ratios), 128/128 x 256, on the 1B and the 8B shape; weight memory and KV tokens gained in the same
# table; weight-only int8 against bf16 the same way, and the int8 kernels alone. Steps by name (default: all;
# more than one device call holds):
#   bash tests/gpu/h100_w8a8.sh tests 1b      bash tests/gpu/h100_w8a8.sh 8b      bash tests/gpu/h100_w8a8.sh int8 gemm fp8
# Every mode gets the same fixed KV cache (--num-blocks: 256 x 256 tokens fit without preemption), since
# engines sized from free GPU memory would each find less of it than the one loaded before.
source tests/gpu/env.sh
steps=${*:-tests 1b 8b int8 gemm fp8}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee $OUT/gpu.txt
compare() {  # $1: model, $2: time limit in seconds
  local name=${1#random:}
  echo "== $1: none,int8-w8a8,fp8-w8a8, 128/128 x 256, 7 alternating rounds"
  timeout $2 python3 -m service bench offline --model $1 --quantization none,int8-w8a8,fp8-w8a8 --repeats 7 \
    --num-blocks 4400 --json $OUT/w8a8-$name.json > $OUT/w8a8-$name.log 2>&1
  echo "rc $?"; grep -E "^model|^\|" $OUT/w8a8-$name.log
}
for step in $steps; do
  case $step in
    tests)
      echo "== tests/cuda/test_cuda.py -k w8a8"
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/cuda/test_cuda.py -k "w8a8 or quant or silu" > $OUT/w8a8_tests.log 2>&1
      echo "rc $?"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/w8a8_tests.log | tail -12 ;;
    1b) compare random:llama-1b 280 ;;
    8b) compare random:llama-8b 560 ;;
    int8)  # weight-only int8 under torch.compile (our Triton kernel on CUDA; torchao's stalled), against bf16
      for model in random:llama-1b random:llama-8b; do
        echo "== $model: none,int8, 128/128 x 256, 7 alternating rounds"
        timeout 240 python3 -m service bench offline --model $model --quantization none,int8 --repeats 7 \
          --num-blocks 4400 --json $OUT/int8-${model#random:}.json > $OUT/int8-${model#random:}.log 2>&1
        echo "rc $?"; grep -E "^model|^\|" $OUT/int8-${model#random:}.log
      done ;;
    gemm)  # the kernels alone (tests/gpu/kernels/int8_gemm.py), at the row counts of decode and prefill
      timeout 150 python3 tests/gpu/kernels/int8_gemm.py --rows 1,64,256,4096 2>&1 | grep -v -i warn > $OUT/int8_gemm.log
      echo "rc $?"; grep "^|" $OUT/int8_gemm.log ;;
    fp8)  # fp8's matmul alone, sums carried in float32 or kept in the tensor cores' accumulator, and their error
      timeout 150 python3 tests/gpu/kernels/int8_gemm.py --fp8 --rows 1,256,4096 2>&1 | grep -v -i warn > $OUT/fp8_gemm.log
      echo "rc $?"; grep "^|" $OUT/fp8_gemm.log ;;
    *) echo "unknown step $step: tests, 1b, 8b, int8, gemm, fp8"; exit 2 ;;
  esac
done
