#!/bin/bash
# FlashInfer's kernels over the paged cache (bench kernel's flashinfer and flashinfer-fa2) beside this project's and
# PyTorch's (issue 26's prefill target), on the H100 through the device tool, carry [".whl-fi"] (built by
# tests/gpu/kernels/flashinfer_wheels.sh; not .whl, which would take the call past the tool's 64 MiB). `bench kernel
# --preset serving` runs every operation through its float64 gate before timing it; flashinfer's kernels compile on
# first use (JIT, the machine's nvcc), which the log times.
# Usage: bash tests/gpu/kernels/flashinfer.sh [bench kernel's options, default: --preset serving]
set -u
cd "$(dirname "$0")/../../.."
WHEELS=.whl-fi source tests/gpu/env.sh
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer-jit
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}  # the H100's: build for it alone
nvidia-smi --query-gpu=uuid,name --format=csv,noheader
which nvcc && nvcc --version | tail -1
python3 -c "import flashinfer, torch; print('flashinfer', flashinfer.__version__, 'torch', torch.__version__)" || exit 1
start=$(date +%s)
python3 -m service bench kernel ${@:---preset serving} --ops paged,sdpa-cudnn,sdpa-flash,flashinfer,flashinfer-fa2 \
  --csv $OUT/flashinfer.csv 2>&1 | quiet
echo "bench kernel with flashinfer's first builds: $(( $(date +%s) - start )) s"
