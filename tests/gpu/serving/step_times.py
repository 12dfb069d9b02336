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


def read(url: str) -> tuple[dict, dict]:
    """({"step:decode:sum": ..., ...}, {gpu: utilization}) from the server's /metrics (bench serve's scrape)."""
    samples, why = scrape(url, timeout=30)
    if samples is None:
        raise SystemExit(why)
    totals, gpus = {}, {}
    for name, labels, value in samples:
        base, _, part = name.rpartition("_")
        if base in SERIES and part in ("sum", "count"):
            key = f"{SERIES[base]}:{labels.get('phase', 'all')}:{part}"
            totals[key] = totals.get(key, 0.0) + value
        elif name == "llm_gpu_utilization_ratio":
            gpus[labels.get("gpu", "?")] = value
    return totals, gpus


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--state", required=True, help="where the totals of the last call are kept")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    totals, gpus = read(args.url)
    before = {}
    if os.path.exists(args.state):
        with open(args.state) as f:
            before = json.load(f)
    with open(args.state, "w") as f:
        json.dump(totals, f)
    delta = {k: v - before.get(k, 0.0) for k, v in totals.items()}
    phases = {}
    for phase in sorted({k.split(":")[1] for k in delta}):
        steps = delta.get(f"step:{phase}:count", 0.0)
        if steps <= 0:
            continue
        phases[phase] = {"steps": int(steps), "step_ms": round(1e3 * delta.get(f"step:{phase}:sum", 0.0) / steps, 3),
                         "host_ms": round(1e3 * delta.get(f"host:{phase}:sum", 0.0) / steps, 3)}
    print(json.dumps({"label": args.label, "phases": phases, "gpu_utilization": gpus}), flush=True)


if __name__ == "__main__":
    main()
