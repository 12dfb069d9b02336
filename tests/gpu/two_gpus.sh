#!/usr/bin/env bash
# Tensor-parallel runs on a two-GPU machine: the CUDA tests (full log kept), then bench offline 128/128 x 256
# at N=1 and N=2 on Llama-3.2-1B's and Llama-3.1-8B's shapes (random bf16 weights, eager on both sides).
source tests/gpu/env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpus.txt
nvidia-smi topo -m >> $OUT/gpus.txt
echo "== tests/cuda/test_cuda_tensor_parallel.py"
timeout 170 python3 -m pytest -p no:cacheprovider -rA tests/cuda/test_cuda_tensor_parallel.py > $OUT/tp_tests.log 2>&1
echo "rc $?"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed|^E " $OUT/tp_tests.log | cut -c1-240 | head -20
for model in llama-1b llama-8b; do
  for tp in 1 2; do
    echo "== $model tp$tp"
    timeout $([ $model = llama-1b ] && echo 75 || echo 120) python3 -m service bench offline --model random:$model \
      --tensor-parallel-size $tp --peers none --compile off --cuda-graphs off --db sqlite:////tmp/b.db \
      --json $OUT/tp-$model-tp$tp.json > $OUT/tp-$model-tp$tp.log 2>&1
    echo "rc $?"; grep -E "^\| this|Error|error" $OUT/tp-$model-tp$tp.log | tail -3
    python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; print(f\"steps {r['steps']}, {r['seconds']/r['steps']*1e3:.2f} ms a step, setup {r.get('setup_seconds', 0):.1f} s\")" $OUT/tp-$model-tp$tp.json 2>/dev/null
  done
done
