"""Verdicts from per-iteration samples: the median ratio candidate/baseline with a bootstrap 95% interval.

regressed: the interval lies wholly on the worse side of 1 and the median moved by more than the threshold;
improved: the same on the better side; unchanged: the whole interval lies within +-threshold; inconclusive:
too few iterations, or an interval too wide to tell (it reaches past the threshold but not clearly).
"""

from dataclasses import dataclass

import numpy as np

from service.bench.bootstrap import median_ratio_ci

MIN_ITERATIONS = 5


@dataclass(frozen=True)
class Verdict:
    verdict: str  # improved, regressed, unchanged, inconclusive
    ratio: float | None  # median(candidate) / median(baseline)
    low: float | None  # the confidence interval of the ratio
    high: float | None
    n_baseline: int
    n_candidate: int
    why: str


def judge(baseline, candidate, better: int, threshold: float = 0.05, min_iterations: int = MIN_ITERATIONS,
          confidence: float = 0.95) -> Verdict:
    """`better`: +1 when higher is better, -1 when lower is better."""
    nb, nc = len(baseline), len(candidate)
    if min(nb, nc) < min_iterations:
        return Verdict("inconclusive", None, None, None, nb, nc,
                       f"too few iterations ({nb} and {nc}; {min_iterations} needed)")
    if np.min(baseline) <= 0 or np.min(candidate) < 0:  # a zero baseline resample would make the interval infinite
        return Verdict("inconclusive", None, None, None, nb, nc,
                       "a ratio needs positive baseline and non-negative candidate values")
    ratio, low, high = median_ratio_ci(baseline, candidate, confidence)
    change = (ratio - 1) * better  # > 0: better
    if high < 1 or low > 1:  # the interval excludes "no change"
        clearly_better = (low > 1) == (better > 0)
        if abs(ratio - 1) > threshold:
            return Verdict("improved" if clearly_better else "regressed", ratio, low, high, nb, nc,
                           f"{abs(ratio - 1):.1%} {'better' if change > 0 else 'worse'}, beyond the {threshold:.0%} threshold")
    if 1 - threshold <= low and high <= 1 + threshold:
        return Verdict("unchanged", ratio, low, high, nb, nc, f"within {threshold:.0%}")
    return Verdict("inconclusive", ratio, low, high, nb, nc,
                   f"too noisy: the interval [{low:.3f}, {high:.3f}] reaches past {threshold:.0%}")


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
