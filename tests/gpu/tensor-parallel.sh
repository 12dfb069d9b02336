#!/usr/bin/env bash
# suite: tensor parallelism on 2+ GPUs: its CUDA tests, then bench offline at N=1 and N=2 on the 1B and 8B shapes
# Usage: bash tests/gpu/run.sh tensor-parallel [PHASE...]   (default: tests offline)
#   tests    tests/cuda/test_cuda_tensor_parallel.py: two GPUs compute what one does
#   offline  bench offline 256 x 128/128 on random:llama-1b and random:llama-8b at --tensor-parallel-size 1 and 2,
#            eager on both sides (--compile off --cuda-graphs off: the split model runs eager), so that the
#            columns compare like with like; each run's steps, time a step and set-up from its JSON
# NVLink multicast stays off (NCCL, PyTorch's symmetric memory, NVSHMEM): on a shared host a program that uses it
# can put the GPUs out of service.
#   TP_TIMEOUT  seconds for each run (default 300)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$(dirname "$0")/env.sh"
T=${TP_TIMEOUT:-300}
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then echo "tensor-parallel needs two GPUs or more; this machine has $gpus" >&2; exit 2; fi
nvidia-smi topo -m > "$RESULTS/topology.txt" 2>&1
phases "tests offline" "tests offline" "$@"
for phase in "${PHASES[@]}"; do
  case $phase in
    tests) step tp-tests "$T" "$PYTHON" -m pytest -q -p no:cacheprovider -rfEs tests/cuda/test_cuda_tensor_parallel.py ;;
    offline)
      for model in llama-1b llama-8b; do for tp in 1 2; do
        name=tp-$model-tp$tp
        step "$name" "$T" "$PYTHON" -m service bench offline --model "random:$model" --tensor-parallel-size "$tp" \
          --peers none --compile off --cuda-graphs off --label "$name" --json "$RESULTS/$name.json"
        "$PYTHON" -c "import json, sys; r = json.load(open(sys.argv[1]))['rows'][0]
print(f\"steps {r['steps']}, {r['seconds'] / r['steps'] * 1e3:.2f} ms a step, setup {r.get('setup_seconds', 0):.1f} s\")" \
          "$RESULTS/$name.json" 2> /dev/null
      done; done ;;
  esac
done
finish
