# shellcheck shell=bash disable=SC2034  # (sourced: the variables it sets are the suites')
# Sourced by every suite in tests/gpu/ (bash tests/gpu/run.sh SUITE, or bash tests/gpu/SUITE.sh): runs from the
# repository root on any machine with a CUDA GPU and the project's dependencies, and sets, each overridable:
#   PYTHON        the interpreter: .venv/bin/python where `make install TORCH=torch` made it, else python3
#   RESULTS       the folder for the suite's logs, JSON files and results store: the device tool's $OUT where it is
#                 set (where, past 8 files, all but the store are packed into results.tar.gz at the end, as the
#                 tool brings back 8 files at most), else gpu-results/SUITE-DATE
#   LLM_BENCH_DB  the results store that every run of the suite records into: RESULTS/bench.db
#   WHEELS        folders of wheels the machine lacks, installed first where they exist (default: .whl .whl-fi,
#                 made by tests/gpu/wheels.sh and tests/gpu/kernels/flashinfer_wheels.sh on a machine with pip's
#                 network, for a GPU machine without one; WHEELS= installs none)
# and gives the suites step (one command under a time limit, its log kept) and finish (the suite's exit status).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
export PYTHONUNBUFFERED=1
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=python3; fi
fi
case $0 in
  *.sh) SUITE=${SUITE:-$(basename "$0" .sh)} ;;
  *) SUITE=${SUITE:-gpu} ;;  # sourced by a shell, not by a suite
esac
RESULTS=${RESULTS:-${OUT:-gpu-results/$SUITE-$(date +%Y-%m-%d-%H%M%S)}}
mkdir -p "$RESULTS" && RESULTS=$(cd "$RESULTS" && pwd) || exit 1
export LLM_BENCH_DB=${LLM_BENCH_DB:-sqlite:///$RESULTS/bench.db}
site=${TMPDIR:-/tmp}/llm-service-wheels
for dir in ${WHEELS-.whl .whl-fi}; do
  compgen -G "$dir/*.whl" > /dev/null || continue
  echo "installing the wheels in $dir into $site"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$dir"/*.whl \
    || exit 1
  case ":${PYTHONPATH:-}:" in *":$site:"*) ;; *) export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} ;; esac
done
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the project itself, installed or not
# a real tokenizer for random weights (tests/conftest.py's tokenizer_folder), where wheels.sh saved one
if [ -z "${LLM_TEST_TOKENIZER:-}" ] && [ -f .whl/tokenizer/tokenizer.json ]; then
  export LLM_TEST_TOKENIZER=$PWD/.whl/tokenizer
fi
# quiet: a log without Python's and torch's warnings, blank lines, indented continuations and progress bars
quiet() { grep -v -E 'Warning|warnings\.warn|^[WI][0-9]{4} |^\s*$|^  |it/s\]' ; }
FAILED=()

# step NAME SECONDS COMMAND...: run COMMAND under a time limit, its whole output in RESULTS/NAME.log; print the
# last STEP_LINES lines (default 30) of it, quieted, and note a failure (the time limit's exit status is 124)
step() {
  local name=$1 limit=$2 rc
  shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  rc=$?
  quiet < "$RESULTS/$name.log" | tail -n "${STEP_LINES:-30}" | cut -c1-250
  if [ "$rc" != 0 ]; then
    echo "!! $name: exit status $rc$([ "$rc" = 124 ] && echo ", stopped at its $limit s limit")"
    FAILED+=("$name")
  fi
  return 0
}

# phases DEFAULT KNOWN [ARGS...]: PHASES, the phases asked for (ARGS, else DEFAULT), each one of KNOWN (a phase may
# carry a value after a colon: one:int8), else the suite ends with exit status 2
phases() {
  local default=$1 known=$2 phase
  shift 2
  read -r -a PHASES <<< "${*:-$default}"
  for phase in "${PHASES[@]}"; do
    if [[ " $known " != *" ${phase%%:*} "* ]]; then echo "unknown phase $phase: the phases are $known" >&2; exit 2; fi
  done
}

# finish: say where the results are and which steps failed; the suite's exit status is 1 if any did. In the device
# tool's $OUT, which brings back 8 files at most, the files but the results store are packed into results.tar.gz
finish() {
  local packed
  if [ -n "${OUT:-}" ] && [ "$RESULTS" = "$(cd "$OUT" 2>/dev/null && pwd)" ] \
    && [ "$(find "$RESULTS" -mindepth 1 -maxdepth 1 | wc -l)" -gt 8 ]; then
    packed=$(mktemp)
    (cd "$RESULTS" && find . -mindepth 1 -maxdepth 1 ! -name bench.db ! -name results.tar.gz -printf '%P\n' > "$packed" \
      && tar -czf results.tar.gz -T "$packed" && xargs rm -rf < "$packed")
    rm -f "$packed"
  fi
  echo "results: $RESULTS (store: $LLM_BENCH_DB)"
  if [ ${#FAILED[@]} -gt 0 ]; then echo "failed: ${FAILED[*]}"; exit 1; fi
  exit 0
}

# what ran where: the GPUs, torch and its CUDA (also in RESULTS/machine.txt); without a GPU the suite ends here
nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv,noheader > "$RESULTS/machine.txt" 2>&1
"$PYTHON" -c "import sys, torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPUs',
      torch.cuda.device_count()); sys.exit(not torch.cuda.is_available())" >> "$RESULTS/machine.txt" 2>&1
cuda=$?
cat "$RESULTS/machine.txt"
if [ "$cuda" != 0 ]; then echo "no CUDA GPU that $PYTHON's torch can use: the GPU suites need one" >&2; exit 1; fi

# serve N [FLAGS...]: start `python -m service serve` on the GPU with N front ends (MODEL, default random:llama-1b;
# PORT, default 8000; 256 sequences, 4,096 waiting), its log in RESULTS/serve-N.log, and wait until each front end
# has linked to the engine process (SERVE_TIMEOUT seconds, default 900). Sets SERVER (the supervisor's pid) and PIDS
# (its children: the engine process and the front ends). unserve stops it.
MODEL=${MODEL:-random:llama-1b}
PORT=${PORT:-8000}
URL=http://127.0.0.1:$PORT
serve() {
  local n=$1 log=$RESULTS/serve-$1.log waited=0
  shift
  : > "$log"
  "$PYTHON" -m service serve --model "$MODEL" --device cuda --port "$PORT" --max-num-seqs 256 --max-waiting 4096 \
    --api-servers "$n" "$@" > "$log" 2>&1 &
  SERVER=$!
  until [ "$(grep -c 'linked to the engine process' "$log")" -ge "$n" ]; do
    if ! kill -0 "$SERVER" 2>/dev/null || [ $((waited++)) -ge "${SERVE_TIMEOUT:-900}" ]; then
      echo "!! the server with $n front end(s) did not come up; its log's end:"; tail -30 "$log"
      kill -TERM "$SERVER" 2>/dev/null; wait "$SERVER"; FAILED+=("serve-$n"); return 1
    fi
    sleep 1
  done
  PIDS=$(pgrep -P "$SERVER" | paste -sd,)
  echo "server with $n front end(s) $*: supervisor $SERVER, children $PIDS"
}
unserve() { kill -TERM "$SERVER"; wait "$SERVER"; echo "server exit status $?"; }
load() {  # NAME [http_load.py's arguments...]: one client run against the server, its JSON line printed (limit: T)
  local name=$1
  shift
  step "$name" "$T" "$PYTHON" tests/gpu/serving/http_load.py "$URL" --model "$MODEL" --pids "$PIDS" --label "$name" "$@"
}
