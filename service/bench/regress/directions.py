"""The better direction of every metric the benchmarks store or print: one table, used by regress and compare.

Names say their unit (`_seconds`, `_bytes`, `_per_second`), so most rules are suffixes; an exact name or a more
specific pattern comes first. Metrics that match nothing are information only and never judged.
"""

import fnmatch

HIGHER, LOWER, INFO = 1, -1, 0

RULES = [
    # counts and settings that describe a run rather than judge it
    ("steps", INFO), ("setup_seconds", INFO), ("roofline_seconds", INFO), ("machine_reference_seconds", INFO), ("duration_s", INFO), ("dispatch_lag_ms.*", INFO),
    ("generator.*", INFO), ("predicted_*", INFO),  # bench model's memory estimate: a prediction, not a result
    # bench capacity: the highest load within the SLOs, and the first load beyond them
    ("capacity_*", HIGHER), ("first_fail_*", HIGHER),
    # stored metrics: units in the name
    ("*_per_second", HIGHER), ("*_seconds", LOWER), ("*_bytes", LOWER), ("failed_requests", LOWER),
    ("*_error", LOWER), ("goodput_ratio", HIGHER), ("slo_attainment_ratio*", HIGHER),
    ("greedy_agreement_ratio", HIGHER), ("forced_agreement_ratio", HIGHER), ("perplexity", LOWER),  # bench offline --quantization
    # bench serve's summary keys (bench compare reads them from its JSON files)
    ("ttft_ms.*", LOWER), ("tpot_ms.*", LOWER), ("itl_ms.*", LOWER), ("e2e_ms.*", LOWER), ("errors.*", LOWER),
    ("requests.failed", LOWER), ("request_throughput", HIGHER), ("output_throughput", HIGHER),
    ("total_throughput", HIGHER), ("goodput", HIGHER), ("slo_attainment.*", HIGHER), ("requests.completed", HIGHER),
]


def direction(metric: str) -> int:
    """+1 when higher is better, -1 when lower is better, 0 when the metric is information only."""
    for pattern, d in RULES:
        if fnmatch.fnmatchcase(metric, pattern):
            return d
    return INFO
