#!/usr/bin/env bash
# suite: bench kernel and bench model figures (FlashInfer's kernels beside them where its wheels are present)
# Usage: bash tests/gpu/run.sh kernels [PHASE...]   (default: kernel flashinfer cudnn model)
#   kernel      the attention kernels on the serving shapes (bench kernel --preset serving: decode at batch 256,
#               prefill), each checked against the float64 oracle before it is timed; CSV and plot in RESULTS
#   flashinfer  the same with FlashInfer's FA3 and FA2 kernels over the paged cache beside ours and PyTorch's, where
#               `import flashinfer` works (its wheels: tests/gpu/kernels/flashinfer_wheels.sh makes .whl-fi); its
#               kernels compile on first use with the machine's nvcc, for this GPU's architecture only
#   cudnn       prefill over the paged cache: cuDNN's fused attention (cudnn-paged, where nvidia-cudnn-frontend is
#               installed) beside ours and the dense kernels; then page sizes and a mixed step
#               (tests/gpu/kernels/cudnn_pages.py)
#   model       bench model: five sizes, contexts 256 and 1,024, fp32 and bf16, forward, forward+backward and the
#               training step, against the memory calculator; then the quantized forward at context 512
#   KERNELS_TIMEOUT  seconds for each run (default 400)
source "$(dirname "$0")/env.sh"
T=${KERNELS_TIMEOUT:-400}
phases "kernel flashinfer cudnn model" "kernel flashinfer cudnn model" "$@"
for phase in "${PHASES[@]}"; do
  case $phase in
    kernel) STEP_LINES=60 step kernel "$T" "$PYTHON" -m service bench kernel --preset serving \
        --csv "$RESULTS/kernel.csv" --plot "$RESULTS/kernel.png" ;;
    flashinfer)
      if ! "$PYTHON" -c "import flashinfer" 2> /dev/null; then
        echo "== flashinfer: skipped, flashinfer is not installed (bash tests/gpu/kernels/flashinfer_wheels.sh)"
        continue
      fi
      export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-${TMPDIR:-/tmp}/flashinfer-jit}
      # build for this GPU alone (9.0a on the H100 and H200): the JIT builds take most of the run as it is
      FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-$("$PYTHON" -c "import torch
major, minor = torch.cuda.get_device_capability(); print(f'{major}.{minor}' + ('a' if major >= 9 else ''))")}
      export FLASHINFER_CUDA_ARCH_LIST
      STEP_LINES=60 step flashinfer "$T" "$PYTHON" -m service bench kernel --preset serving \
        --ops paged,sdpa-cudnn,sdpa-flash,flashinfer,flashinfer-fa2 --csv "$RESULTS/flashinfer.csv" ;;
    cudnn)
      STEP_LINES=40 step cudnn "$T" "$PYTHON" -m service bench kernel --phases prefill --batch 4 --heads 32 --kv-heads 8 \
        --head-dim 64,128 --context 1024,4096 --dtype bf16 --ops paged,sdpa-cudnn,cudnn-paged,sdpa-flash \
        --csv "$RESULTS/cudnn.csv"
      step cudnn-pages "$T" "$PYTHON" tests/gpu/kernels/cudnn_pages.py ;;
    model)
      STEP_LINES=70 step model "$T" "$PYTHON" -m service bench model --sizes small,medium,large,xl,2.7b \
        --context 256,1024 --modes fwd,fwd+bwd,train --precision fp32,bf16 --warmup 2 --iterations 5 \
        --json "$RESULTS/model.json"
      step model-quantized "$T" "$PYTHON" -m service bench model --sizes small,2.7b --context 512 --modes fwd \
        --precision bf16 --quantization none,int8,int4,fp8 --warmup 2 --iterations 5 --json "$RESULTS/model-quantized.json" ;;
  esac
done
finish
