"""The engine's steps as a server's /metrics counts them, since the last call with the same state file: per phase,
the steps, their mean duration and the mean host time of each (`llm_engine_step_host_seconds`: the step less the
engine's wait for the device), and the GPUs' utilization as last sampled. One line of JSON.

    python3 tests/gpu/serving/step_times.py URL --state RESULTS/step-times.json [--label NAME]
"""

import argparse
import json
import os
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

SERIES = {"llm_engine_step_seconds": "step", "llm_engine_step_host_seconds": "host"}


def read(url: str) -> tuple[dict, dict]:
    """({"step:decode:sum": ..., ...}, {gpu: utilization})"""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    totals, gpus = {}, {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            for name, short in SERIES.items():
                for part in ("sum", "count"):
                    if s.name == f"{name}_{part}":
                        key = f"{short}:{s.labels.get('phase', 'all')}:{part}"
                        totals[key] = totals.get(key, 0.0) + s.value
            if s.name == "llm_gpu_utilization_ratio":
                gpus[s.labels.get("gpu", "?")] = s.value
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
