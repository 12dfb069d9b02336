#!/bin/bash
# FlashInfer's wheels for a CUDA machine without a network (the device tool's), in the ignored .whl-fi/:
# flashinfer-python and what `import flashinfer` and `bench kernel` need that the GPU machine lacks (apache-tvm-ffi,
# ninja, einops, psutil, tabulate, sqlalchemy). The device tool carries at most 64 MiB a call and flashinfer's wheel is
# 62 MB, most of it the CUDA sources of other operations (MoE, MLA, FP4, GEMMs, Blackwell kernels, other models' fused
# layers). The copy here leaves out data/csrc's subfolders, those top-level sources, and CUTLASS's examples and tools
# but for its util headers, which the Hopper kernels include. It keeps batch prefill and decode, their headers and
# CUTLASS's and CCCL's headers, which the JIT build compiles with the GPU machine's nvcc. Then, on the GPU machine:
# bash tests/gpu/run.sh kernels flashinfer (tests/gpu/env.sh installs .whl-fi where it exists; device tool: carry
# [".whl-fi"], with ".whl" beside it if the machine lacks tests/gpu/wheels.sh's set too).
set -eu
cd "$(dirname "$0")/../../.."
VERSION=${FLASHINFER_VERSION:-0.7.2.post1}
out=.whl-fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$tmp" \
  "flashinfer-python==$VERSION" apache-tvm-ffi ninja einops tabulate sqlalchemy psutil
rm -rf "$out" && mkdir -p "$out"
python3 - "$tmp" "$out" <<'PY'
import glob, os, re, shutil, sys, zipfile
src, out = sys.argv[1:]
DROP = re.compile(r"flashinfer/data/csrc/[^/]+/|flashinfer/data/cutlass/(examples|python|test|tools/(?!util/include/))"
                  r"|flashinfer/data/csrc/(cake_|alphamoe|trtllm|blackwell)[^/]*$"
                  r"|flashinfer/data/csrc/[^/]*(moe|mla|fp4|gemm)[^/]*$")
for wheel in glob.glob(os.path.join(src, "*.whl")):
    name = os.path.basename(wheel)
    if not name.startswith("flashinfer_python"):
        shutil.copy(wheel, out)
        continue
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(os.path.join(out, name), "w", zipfile.ZIP_DEFLATED) as zout:
        kept = [i for i in zin.infolist() if not DROP.match(i.filename)]
        names = {i.filename for i in kept}
        for info in kept:
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):  # list only the files the slim wheel holds
                data = "".join(line + "\n" for line in data.decode().splitlines()
                               if line.split(",")[0] in names).encode()
            zout.writestr(info, data)
PY
du -sh "$out"; ls -l "$out"
