#!/usr/bin/env bash
# The proof that no test depends on the machine's speed: the full suite RUNS times in a row (default 5), each
# run with `stress-ng --cpu 2` busy beside it, then a pass/fail line per run. Exit 0 only if every run passed.
#   scripts/stress-suite.sh [RUNS] [-- COMMAND...]    the command defaults to `make test` (what CI runs)
# Each run's whole output goes to $STRESS_LOG_DIR/run-N.log (default stress-runs/); STRESS_CPU sets the number of
# stress-ng CPU workers (default 2). Run it on an otherwise quiet machine: the report prints the load before each run.
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
[ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
command=("$@")
[ ${#command[@]} -eq 0 ] && command=(make test)
command -v stress-ng >/dev/null || { echo "stress-ng missing: run deploy/install-tools.sh" >&2; exit 2; }
logs=${STRESS_LOG_DIR:-stress-runs}
mkdir -p "$logs"

stress=""
stop_stress() {
    [ -n "$stress" ] && kill -TERM -- "-$stress" 2>/dev/null && wait "$stress" 2>/dev/null
    stress=""
}
trap 'stop_stress; exit 130' INT TERM

echo "$runs runs of: ${command[*]}, each beside stress-ng --cpu ${STRESS_CPU:-2} ($(nproc) cores); logs in $logs/"
failed=0
for i in $(seq 1 "$runs"); do
    load=$(cut -d' ' -f1 /proc/loadavg)
    setsid stress-ng --cpu "${STRESS_CPU:-2}" --quiet >/dev/null 2>&1 &  # own process group: stopped with its workers
    stress=$!
    start=$SECONDS
    "${command[@]}" >"$logs/run-$i.log" 2>&1
    rc=$?
    stop_stress
    took=$((SECONDS - start))
    counts=$(grep -E "[0-9]+ (passed|failed)" "$logs/run-$i.log" | tail -1 | tr -d '=' | sed 's/^ *//;s/ *$//')
    if [ "$rc" -eq 0 ]; then
        echo "run $i: PASS in ${took} s (load before: $load): $counts"
    else
        failed=$((failed + 1))
        echo "run $i: FAIL (exit $rc) in ${took} s (load before: $load): ${counts:-no pytest summary, see the log}"
        grep -E "^(FAILED|ERROR) " "$logs/run-$i.log" | sed 's/^/    /'
    fi
done
echo "$((runs - failed)) of $runs runs passed"
[ "$failed" -eq 0 ]
