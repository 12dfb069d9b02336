#!/usr/bin/env bash
# The Python packages that a CUDA machine without a network (the device tool's) lacks, as wheels in .whl/ (ignored
# by git; tests/gpu/env.sh installs them where the folder exists). Run it where pip reaches PyPI, then carry the
# folder: carry [".whl"]. That machine's python3 has torch, transformers, triton, accelerate, numpy, safetensors,
# tokenizers, prometheus-client, nvidia-ml-py, psutil, rich, pyyaml, httpx, aiohttp, uvloop, grpcio, requests,
# pytest and hypothesis (the device tool's KINDS.md lists the rest). Sets:
#   all     (the default, 16 MB) what every suite imports: the set below, and FastAPI, uvicorn, pyzmq, msgspec, the
#           OpenTelemetry SDK, exporters and FastAPI instrumentation (servers, the engine process, telemetry), and
#           xgrammar (structured output), py-spy (the sampling profiler of serving.sh's profile phase)
#   cuda    (10 MB) what tests/cuda imports beyond that machine's packages: sqlalchemy (the results store of the
#           bench tests), opentelemetry-api (service.telemetry.metrics, under bench run's GPU sampler), torchao (int4
#           and fp8 weight-only quantization) and nvidia-cudnn-frontend (cudnn-paged; its 6 tests skip without it)
# Versions are pinned to those the CPU suite ran with (2026-11-28), so that the set installs whole with --no-deps.
# Usage: [WHEELS=.whl] [PY_VERSION=3.12] bash tests/gpu/wheels.sh [all|cuda]  (after make install)
set -eu
cd "$(dirname "$0")/../.."
CUDA="sqlalchemy==2.1.9 opentelemetry-api==1.45.2 torchao==0.18.0 nvidia-cudnn-frontend==1.18.0"
ALL="$CUDA fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 typing-extensions==4.16.0 uvicorn==0.54.0 httptools==0.9.0 pyzmq==27.3.0 msgspec==0.22.0
  opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 opentelemetry-proto==1.45.2
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
  opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-proto-grpc==1.45.2
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-instrumentation==0.66b2
  opentelemetry-instrumentation-asgi==0.66b2 opentelemetry-instrumentation-fastapi==0.66b2
  opentelemetry-util-http==0.66b2 asgiref==3.13.0 googleapis-common-protos==1.76.0 protobuf==7.36.2
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 py-spy==0.4.3"
case ${1:-all} in
  cuda) packages=$CUDA ;;
  all) packages=$ALL ;;
  *) echo "usage: bash tests/gpu/wheels.sh [all|cuda]" >&2; exit 2 ;;
esac
out=${WHEELS:-.whl}
rm -rf "$out" && mkdir -p "$out"
# shellcheck disable=SC2086  # the package lists split on whitespace
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$out" $packages
# and the default model's tokenizer (3.5 MB, its weights stay here): random weights take it with --tokenizer, for text
# and grammars on that machine (env.sh sets LLM_TEST_TOKENIZER to it)
${VENV_PY:-.venv/bin/python} -c "import sys; from transformers import AutoTokenizer; from service.engine.models import \
_convert_gguf, default_gguf_path; AutoTokenizer.from_pretrained(_convert_gguf(default_gguf_path(), None)).save_pretrained(sys.argv[1])" \
  "$out/tokenizer"
ls -l "$out"; du -sh "$out"
