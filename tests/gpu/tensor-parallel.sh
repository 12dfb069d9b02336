#!/usr/bin/env bash
# suite: tensor parallelism on 2+ GPUs, CUDA graphs and compiled layers on at every size (N=1 at its best)
# Usage: bash tests/gpu/run.sh tensor-parallel [PHASE...]   (default: tests engine)
#   tests    tests/cuda/test_cuda_tensor_parallel.py (N GPUs compute what one does; faults with graphs on) and the
#            served fault tests on CUDA (tests/engine/test_tensor_parallel_faults.py -k cuda)
#   engine   tests/gpu/engine/tensor_parallel.py on the 8B shape at N=1 and 2 (one request's step, 256 x 128/128,
#            the first token of a 1,024-token prompt); the 70B shape in bf16 at N=2 (and 4 where there are four GPUs)
#   fp8      the 70B shape in fp8-w8a8 on one GPU, the same measures: beside bf16 on two
#   offline  bench offline 256 x 128/128 on random:llama-1b and random:llama-8b at N=1 and N=2
#   serving  the 8B shape at N=2: bench offline on 1,024 requests 256 at a time, then behind serve (one front end),
#            1,024 x 256 concurrent streams (tests/gpu/serving/http_load.py)
# NVLink multicast stays off (NCCL, PyTorch's symmetric memory, NVSHMEM): on a shared host a program that uses it
# can put the GPUs out of service.
#   TP_TIMEOUT  seconds for each run (default 480)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/env.sh"
T=${TP_TIMEOUT:-480}
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then echo "tensor-parallel needs two GPUs or more; this machine has $gpus" >&2; exit 2; fi
nvidia-smi topo -m > "$RESULTS/topology.txt" 2>&1
sizes_70b=2; [ "$gpus" -ge 4 ] && sizes_70b="2 4"
phases "tests engine" "tests engine fp8 offline serving" "$@"
for phase in "${PHASES[@]}"; do
  case $phase in
    tests)
      step tp-tests "$T" "$PYTHON" -m pytest -q -p no:cacheprovider -rfEs tests/cuda/test_cuda_tensor_parallel.py
      step tp-served-faults "$T" "$PYTHON" -m pytest -q -p no:cacheprovider -rfEs tests/engine/test_tensor_parallel_faults.py \
        -k "killed and cuda" ;;
    engine)
      step tp-8b "$T" "$PYTHON" tests/gpu/engine/tensor_parallel.py --model random:llama-8b --sizes 1 2
      # shellcheck disable=SC2086  # (the sizes are words)
      step tp-70b "$T" "$PYTHON" tests/gpu/engine/tensor_parallel.py --model random:llama-70b --sizes $sizes_70b ;;
    fp8)
      step tp-70b-fp8 "$T" "$PYTHON" tests/gpu/engine/tensor_parallel.py --model random:llama-70b --sizes 1 \
        --quantization fp8-w8a8 ;;
    offline)
      for model in llama-1b llama-8b; do for tp in 1 2; do
        name=tp-$model-tp$tp
        step "$name" "$T" "$PYTHON" -m service bench offline --model "random:$model" --tensor-parallel-size "$tp" \
          --peers none --label "$name" --json "$RESULTS/$name.json"
      done; done ;;
    serving)
      MODEL=random:llama-8b
      step tp-serving-offline "$T" "$PYTHON" -m service bench offline --model "$MODEL" --tensor-parallel-size 2 \
        --num-requests 1024 --max-num-seqs 256 --peers none --label tp2-offline --json "$RESULTS/tp2-offline.json"
      if serve 1 --tensor-parallel-size 2; then
        STEP_LINES=0 load tp2-warm --requests 256
        load tp2-streaming --requests 1024 --concurrency 256 --stream
        load tp2-non-streaming --requests 1024 --concurrency 256
        curl -s "$URL/metrics" | grep -E '^llm_(tensor_parallel_forward_seconds_total|gpu_utilization_ratio)'
        unserve
      fi ;;
  esac
done
finish
