#!/usr/bin/env bash
# Tensor-parallel runs on a two-GPU machine: the CUDA tests, then bench offline 128/128 x 256 at N=1 and N=2.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpus.txt
nvidia-smi topo -m | tee -a $OUT/gpus.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_tensor_parallel.py 2>&1 | tail -15 | tee $OUT/tp_tests.log
for model in llama-1b llama-8b; do
  for tp in 1 2; do
    echo "== $model tp$tp"
    timeout 150 python3 -m service bench offline --model random:$model --tensor-parallel-size $tp --peers none \
      --no-compile --no-cuda-graphs --db sqlite:////tmp/b.db --json $OUT/tp-$model-tp$tp.json 2>&1 \
      | grep -v Warning | tail -6 | tee -a $OUT/tp_bench.log
  done
done
