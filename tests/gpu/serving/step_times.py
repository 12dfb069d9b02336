"""The engine's steps as a server's /metrics counts them, since the last call with the same state file: per phase,
the steps, their mean duration and the mean host time of each (`llm_engine_step_host_seconds`: the step less the
engine's wait for the device), and the GPUs' utilization as last sampled. One line of JSON.

    python3 tests/gpu/serving/step_times.py URL --state RESULTS/step-times.json [--label NAME]
"""

import argparse
import json
import os

from service.bench.loadgen.results.crosscheck import scrape

SERIES = {"llm_engine_step_seconds": "step", "llm_engine_step_host_seconds": "host"}


def totals(samples) -> dict:
    """{"step:decode:sum": ..., "host:decode:count": ...} from (name, labels, value) samples of a process's metrics."""
    out = {}
    for name, labels, value in samples:
        base, _, part = name.rpartition("_")
        if base in SERIES and part in ("sum", "count"):
            key = f"{SERIES[base]}:{labels.get('phase', 'all')}:{part}"
            out[key] = out.get(key, 0.0) + value
    return out


def phases(before: dict, after: dict) -> dict:
    """Per phase, between two `totals`: the steps, their mean duration and their mean host time (ms)."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    out = {}
    for phase in sorted({k.split(":")[1] for k in delta}):
        steps = delta.get(f"step:{phase}:count", 0.0)
        if steps > 0:
            out[phase] = {"steps": int(steps), **{f"{what}_ms": round(1e3 * delta.get(f"{what}:{phase}:sum", 0.0)
                                                                      / steps, 3) for what in SERIES.values()}}
    return out


def read(url: str) -> tuple[dict, dict]:
    """(`totals`, {gpu: utilization}) from the server's /metrics (bench serve's scrape)."""
    samples, why = scrape(url, timeout=30)
    if samples is None:
        raise SystemExit(why)
    gpus = {labels.get("gpu", "?"): value for name, labels, value in samples if name == "llm_gpu_utilization_ratio"}
    return totals(samples), gpus


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--state", required=True, help="where the totals of the last call are kept")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    now, gpus = read(args.url)
    before = {}
    if os.path.exists(args.state):
        with open(args.state) as f:
            before = json.load(f)
    with open(args.state, "w") as f:
        json.dump(now, f)
    print(json.dumps({"label": args.label, "phases": phases(before, now), "gpu_utilization": gpus}), flush=True)


if __name__ == "__main__":
    main()
