#!/usr/bin/env bash
# The GPU suites, on any machine with a CUDA GPU and the project installed (make install TORCH=torch), or whose
# python3 has torch and the project's dependencies (tests/gpu/wheels.sh makes the rest into .whl/):
#   bash tests/gpu/run.sh [list]             the suites, one line each (from each script's "# suite:" line)
#   bash tests/gpu/run.sh SUITE [ARGS...]    run one: tests/gpu/SUITE.sh, whose top says its arguments and limits
# Settings every suite takes (tests/gpu/env.sh): PYTHON, RESULTS, LLM_BENCH_DB, WHEELS.
set -u
here=$(cd "$(dirname "$0")" && pwd)

list() {
  echo "usage: bash tests/gpu/run.sh SUITE [ARGS...]; settings: PYTHON, RESULTS, LLM_BENCH_DB, WHEELS (tests/gpu/env.sh)"
  local script line
  for script in "$here"/*.sh; do
    line=$(grep -m1 '^# suite: ' "$script") || continue
    printf '  %-16s %s\n' "$(basename "$script" .sh)" "${line#\# suite: }"
  done
}

case ${1:-list} in
  list | help | -h | --help) list ;;
  *)
    suite=$1
    shift
    if ! grep -qs '^# suite: ' "$here/$suite.sh"; then
      echo "no suite named $suite" >&2
      list >&2
      exit 2
    fi
    SUITE=$suite exec bash "$here/$suite.sh" "$@" ;;
esac
