"""Verdicts from measured runs: the ratio candidate/baseline with a 95% interval holding the drift between invocations.

The unit of noise is the invocation: one process that recorded runs (a `bench run` and all its repeats). Repeats
of one invocation share its process and a moment of the machine, so their spread understates how far a separate
invocation of the same code lands. A side is one or more invocations of a configuration, each one or more runs;
a run's value is its median, an invocation's the mean of its runs' log medians, a side's the mean of its
invocations'. The drift is the spread of invocation means within groups where the code did not change (one
label at one commit on one machine, found in the store), pooled with its degrees of freedom; the ratio's
interval is Student's t on those degrees of freedom, on a noise that is at least what the repeats of one
invocation and the iterations inside a run imply (so a few invocations that agree by chance cannot make it
narrower than that).

regressed: the interval lies wholly on the worse side of 1 and the ratio moved by more than the threshold;
improved: the same on the better side; unchanged: the whole interval lies within +-threshold; inconclusive:
too few iterations, or an interval too wide to tell (it reaches past the threshold but not clearly).
With no drift known (no group holds two invocations) the interval knows only the repeats of one invocation, or
with one run on each side the bootstrap of the iterations; every verdict says so, and a change beyond it is
"maybe regressed" / "maybe improved", never "regressed" (which alone makes `bench regress` exit 1).
"""

import math
from dataclasses import dataclass

import numpy as np

from service.bench.bootstrap import log_median_sd, median_ratio_ci

MIN_ITERATIONS = 5
# Student's t, two-sided 95%, by degrees of freedom (numpy has no t quantile; 30 and beyond: within 2% of 2.042)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
       20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
       29: 2.045, 30: 2.042}
NO_DRIFT = "no drift between invocations known (run the baseline twice: bench run --label L --force)"


@dataclass(frozen=True)
class Verdict:
    verdict: str  # improved, regressed, unchanged, inconclusive; maybe improved, maybe regressed (no drift known)
    ratio: float | None  # candidate / baseline: of the medians (one run each), else of the sides' geometric means
    low: float | None  # the 95% interval of the ratio
    high: float | None
    n_baseline: int  # iterations, over all runs of the side
    n_candidate: int
    why: str
    runs_baseline: int = 1
    runs_candidate: int = 1
    noise: float | None = None  # the standard deviation of an invocation's mean log median used; None: bootstrap


def _classify(ratio: float, low: float, high: float, better: int, threshold: float) -> tuple[str, str]:
    change = (ratio - 1) * better  # > 0: better
    if (high < 1 or low > 1) and abs(ratio - 1) > threshold:  # the interval excludes "no change", by enough
        clearly_better = (low > 1) == (better > 0)
        return ("improved" if clearly_better else "regressed"), \
            f"{abs(ratio - 1):.1%} {'better' if change > 0 else 'worse'}, beyond the {threshold:.0%} threshold"
    if 1 - threshold <= low and high <= 1 + threshold:
        return "unchanged", f"within {threshold:.0%}"
    return "inconclusive", f"too noisy: the interval [{low:.3f}, {high:.3f}] reaches past {threshold:.0%}"


def _unusable(baseline, candidate, min_iterations: int) -> str | None:
    nb, nc = min(map(len, baseline)), min(map(len, candidate))
    if min(nb, nc) < min_iterations:
        return f"too few iterations ({nb} and {nc}; {min_iterations} needed)"
    if min(map(np.min, baseline)) <= 0 or min(map(np.min, candidate)) < 0:  # a zero baseline: an infinite ratio
        return "a ratio needs positive baseline and non-negative candidate values"
    return None


def judge(baseline, candidate, better: int, threshold: float = 0.05, min_iterations: int = MIN_ITERATIONS,
          confidence: float = 0.95) -> Verdict:
    """One run against one: the bootstrap interval of the median ratio, which knows only the noise inside a run.
    `better`: +1 when higher is better, -1 when lower is better."""
    nb, nc = len(baseline), len(candidate)
    if (why := _unusable([baseline], [candidate], min_iterations)):
        return Verdict("inconclusive", None, None, None, nb, nc, why)
    ratio, low, high = median_ratio_ci(baseline, candidate, confidence)
    verdict, why = _classify(ratio, low, high, better, threshold)
    return Verdict(verdict, ratio, low, high, nb, nc, why)


def drift(groups) -> tuple[float, int, int, list[str]] | None:
    """The spread of invocation means within groups where the code did not change, pooled: (standard deviation in
    logs, degrees of freedom, invocations, the names of the groups that hold two or more); None when none does.
    `groups`: (name, invocations), each invocation a list of runs (iteration values)."""
    squares, df, count, names = 0.0, 0, 0, []
    for name, invocations in groups:
        if len(invocations) > 1:
            means = np.array([np.mean(np.log([np.median(r) for r in inv])) for inv in invocations])
            squares += float(((means - means.mean()) ** 2).sum())
            df, count, names = df + len(means) - 1, count + len(means), names + [name]
    return (math.sqrt(squares / df), df, count, names) if df else None


def _maybe(verdict: str) -> str:
    """A verdict where no drift between invocations is known: a change is at most "maybe" (exit 0)."""
    return {"regressed": "maybe regressed", "improved": "maybe improved"}.get(verdict, verdict)


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def judge_runs(baseline: list, candidate: list, better: int, threshold: float = 0.05,
               min_iterations: int = MIN_ITERATIONS, groups=None, names=("baseline", "candidate")) -> Verdict:
    """Invocations against invocations: each side a list of invocations, each a list of runs (iteration values).
    `groups`: where to measure the drift between invocations, as `drift` takes them (default: the two sides,
    named by `names`)."""
    runs_b, runs_c = [r for inv in baseline for r in inv], [r for inv in candidate for r in inv]
    k, j, ib, ic = len(runs_b), len(runs_c), len(baseline), len(candidate)
    nb, nc = sum(map(len, runs_b)), sum(map(len, runs_c))
    if (why := _unusable(runs_b, runs_c, min_iterations)):
        return Verdict("inconclusive", None, None, None, nb, nc, why, k, j)
    known = drift(list(zip(names, (baseline, candidate))) if groups is None else groups)
    if known is None and k + j < 3:
        v = judge(runs_b[0], runs_c[0], better, threshold, min_iterations)
        return Verdict(_maybe(v.verdict), v.ratio, v.low, v.high, nb, nc,
                       f"{v.why}; noise inside runs only (one run on each side); {NO_DRIFT}", k, j)
    inside = math.sqrt(np.mean([log_median_sd(r) ** 2 for r in (*runs_b, *runs_c)]))
    if known is None:  # the runs' spread around their side's mean, as if invocations did not drift
        logs = [np.log([np.median(r) for r in runs]) for runs in (runs_b, runs_c)]
        df = k + j - 2
        spread = math.sqrt(sum(((x - x.mean()) ** 2).sum() for x in logs) / df)
        noise, scale, shift = max(spread, inside), math.sqrt(1 / k + 1 / j), logs[1].mean() - logs[0].mean()
        what = ("of the repeats of one invocation" if ib == ic == 1 else "between runs") if spread >= inside \
            else "inside runs"
        source = f"{noise:.1%} {what}; {NO_DRIFT}"
    else:
        logs = [np.log([np.median(r) for r in inv]) for inv in (*baseline, *candidate)]
        repeat_df = sum(len(x) - 1 for x in logs)
        repeats = math.sqrt(sum(((x - x.mean()) ** 2).sum() for x in logs) / repeat_df) if repeat_df else 0.0
        # at least what the repeats and the iterations alone imply for an invocation's mean (of its fewest runs)
        floor = max(repeats, inside) / math.sqrt(min(len(x) for x in logs))
        means = [x.mean() for x in logs]
        sd, df, count, groups_named = known
        noise, scale, shift = max(sd, floor), math.sqrt(1 / ib + 1 / ic), np.mean(means[ib:]) - np.mean(means[:ib])
        between = f"between invocations ({_names(groups_named)}: {count} invocations, df {df})"
        what = "of the repeats of one invocation" if repeats >= inside else "inside runs"
        source = f"{noise:.1%} {between}" if sd >= floor else f"{noise:.1%} {what}, more than the {sd:.1%} {between}"
    half = T95.get(df, T95[30]) * noise * scale
    ratio, low, high = math.exp(shift), math.exp(shift - half), math.exp(shift + half)
    verdict, why = _classify(ratio, low, high, better, threshold)
    if known is None:
        verdict = _maybe(verdict)
    why += f"; invocations {ib} and {ic} (runs {k} and {j}), noise {source}"
    return Verdict(verdict, ratio, low, high, nb, nc, why, k, j, noise)


def find_steps(values: list[float], threshold: float = 0.05, window: int = 3) -> list[tuple[int, float]]:
    """Indices where a series stepped, with the relative change of its level.

    A point i is a candidate when the median of the `window` points from i on differs by more than the threshold
    from the median of the `window` points before it; a median of three ignores one noisy run. Neighbouring
    candidates are one step: it is placed at the first point that, with the point after it, sits nearer the
    new level than the old. So a step needs two runs at the new level to be named; one noisy run never is.
    """
    v = np.asarray(values, dtype=float)
    flagged = [i for i in range(2, len(v) - 1) if np.median(v[max(0, i - window):i]) > 0 and
               abs(np.median(v[i:i + window]) / np.median(v[max(0, i - window):i]) - 1) > threshold]
    groups = []
    for i in flagged:
        if groups and i == groups[-1][-1] + 1:
            groups[-1].append(i)
        else:
            groups.append([i])
    steps = []
    for group in groups:
        old, new = np.median(v[max(0, group[0] - window):group[0]]), np.median(v[group[-1]:group[-1] + window])
        nearer_new = lambda j: abs(v[j] - new) < abs(v[j] - old)  # noqa: E731
        at = next((i for i in group if nearer_new(i) and nearer_new(i + 1)), None)
        if at is not None:
            steps.append((at, float(new / old - 1)))
    return steps


def parse_threshold(text: str) -> float:
    """'5%' or '5' -> 0.05 (always a percentage)."""
    value = float(text.strip().rstrip("%"))
    if value < 0:
        raise ValueError(f"the threshold must be >= 0, got {text!r}")
    return value / 100
