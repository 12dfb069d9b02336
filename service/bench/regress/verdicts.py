"""Verdicts from measured runs: the ratio candidate/baseline with a 95% interval that holds the noise between runs.

Each side is one or more runs of a configuration (`bench run --repeats`, or runs pooled under one label). A run's
median is its value; the runs' spread around their side's mean (in logs, pooled over both sides) is the noise
between runs, and the ratio's interval is Student's t on it (at least the noise inside a run, from a bootstrap
of each run's median, so a few runs that agree by chance cannot make it narrower than that).

regressed: the interval lies wholly on the worse side of 1 and the ratio moved by more than the threshold;
improved: the same on the better side; unchanged: the whole interval lies within +-threshold; inconclusive:
too few iterations, or an interval too wide to tell (it reaches past the threshold but not clearly).
With one run on each side no between-run noise is known: the interval is the bootstrap of the iterations (the
noise inside a run only), every verdict says so, and a change beyond it is "maybe regressed" / "maybe improved",
never "regressed" (which alone makes `bench regress` exit 1).
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
NO_NOISE = "no between-run noise known (one run on each side; bench run --repeats measures it)"


@dataclass(frozen=True)
class Verdict:
    verdict: str  # improved, regressed, unchanged, inconclusive; maybe improved, maybe regressed (one run each)
    ratio: float | None  # candidate / baseline: of the medians (one run each), else of the runs' geometric means
    low: float | None  # the 95% interval of the ratio
    high: float | None
    n_baseline: int  # iterations, over all runs of the side
    n_candidate: int
    why: str
    runs_baseline: int = 1
    runs_candidate: int = 1
    noise: float | None = None  # the standard deviation of log(run median) used; None: no between-run noise known


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


def judge_runs(baseline: list, candidate: list, better: int, threshold: float = 0.05,
               min_iterations: int = MIN_ITERATIONS) -> Verdict:
    """Runs against runs (each a list of iteration values); the interval holds the noise between runs."""
    k, j = len(baseline), len(candidate)
    nb, nc = sum(map(len, baseline)), sum(map(len, candidate))
    if (why := _unusable(baseline, candidate, min_iterations)):
        return Verdict("inconclusive", None, None, None, nb, nc, why, k, j)
    if k + j < 3:
        v = judge(baseline[0], candidate[0], better, threshold, min_iterations)
        verdict = {"regressed": "maybe regressed", "improved": "maybe improved"}.get(v.verdict, v.verdict)
        return Verdict(verdict, v.ratio, v.low, v.high, nb, nc, f"{v.why}; {NO_NOISE}", k, j)
    logs_b = np.log([np.median(r) for r in baseline])
    logs_c = np.log([np.median(r) for r in candidate])
    df = k + j - 2
    between = math.sqrt((((logs_b - logs_b.mean()) ** 2).sum() + ((logs_c - logs_c.mean()) ** 2).sum()) / df)
    within = math.sqrt(np.mean([log_median_sd(r) ** 2 for r in (*baseline, *candidate)]))
    noise = max(between, within)
    half = T95.get(df, T95[30]) * noise * math.sqrt(1 / k + 1 / j)
    shift = logs_c.mean() - logs_b.mean()
    ratio, low, high = math.exp(shift), math.exp(shift - half), math.exp(shift + half)
    verdict, why = _classify(ratio, low, high, better, threshold)
    source = "between" if between >= within else "inside"
    why += f"; runs {k} and {j}, noise {noise:.1%} ({source} runs)"
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
