"""PNG plots of a sweep: latency percentiles and throughput / goodput against the offered load."""

import os

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from service.bench.loadgen.results.report import LATENCIES  # noqa: E402

AXIS_LABELS = {"rate": "offered request rate (req/s)", "concurrency": "max concurrency (requests)"}


def _series(runs: list[dict], key: str) -> list[float]:
    return [float("nan") if r["summary"].get(key) is None else r["summary"][key] for r in runs]


def plot_sweep(axis: str, values: list[float], runs: list[dict], out_dir: str, title: str = "") -> list[str]:
    """Write latency.png and goodput.png into out_dir; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    xlabel = AXIS_LABELS[axis]
    stat_keys = [k.split(".", 1)[1] for k in runs[0]["summary"] if k.startswith("ttft_ms.")]

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    for ax, (name, short, long) in zip(axes.flat, LATENCIES):
        for stat in stat_keys:
            ax.plot(values, _series(runs, f"{name}.{stat}"), marker="o", label=stat)
        ax.set_title(f"{short}: {long}", fontsize=10)
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel(xlabel)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"latency against offered load{': ' + title if title else ''}", fontsize=11)
    fig.tight_layout()
    latency_path = os.path.join(out_dir, "latency.png")
    fig.savefig(latency_path, dpi=110)
    plt.close(fig)

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(values, _series(runs, "request_throughput"), marker="o", label="request throughput")
    if "goodput" in runs[0]["summary"]:
        slos = ", ".join(runs[0]["settings"].get("slo", []))
        left.plot(values, _series(runs, "goodput"), marker="s", label=f"goodput ({slos})")
    if axis == "rate":
        left.plot(values, values, linestyle="--", color="grey", label="offered")
        # a short Poisson schedule's own rate strays from the offered one; show what was actually scheduled
        left.plot(values, _series(runs, "scheduled_rate"), linestyle="none", marker="x", color="grey",
                  label="scheduled (this run's arrivals)")
    left.set_xlabel(xlabel)
    left.set_ylabel("req/s")
    left.set_title("requests per second", fontsize=10)
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    right.plot(values, _series(runs, "output_throughput"), marker="o", color="tab:green")
    right.set_xlabel(xlabel)
    right.set_ylabel("tokens/s")
    right.set_title("output token throughput", fontsize=10)
    right.grid(alpha=0.3)
    fig.suptitle(f"throughput and goodput against offered load{': ' + title if title else ''}", fontsize=11)
    fig.tight_layout()
    goodput_path = os.path.join(out_dir, "goodput.png")
    fig.savefig(goodput_path, dpi=110)
    plt.close(fig)
    return [latency_path, goodput_path]


def plot_capacity(document: dict, path: str, title: str = "") -> str:
    """Each objective's measured value (with its interval) against load, the SLO line, passes and failures in
    colour, and the capacity found with the bracket (last pass to first fail) shaded; returns the path."""
    points = sorted(document["points"], key=lambda p: p["load"])
    result = document["result"]
    names = [c["name"] for c in points[0]["checks"]]
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4.2), squeeze=False)
    loads = [p["load"] for p in points]
    for k, (ax, name) in enumerate(zip(axes[0], names)):
        checks = [p["checks"][k] for p in points]
        ratio = checks[0]["higher_is_better"]
        scale = 100.0 if ratio else 1000.0  # shares in %, seconds in ms
        for p, c in zip(points, checks):
            colour = {"pass": "tab:green", "fail": "tab:red"}.get(p["verdict"], "tab:orange")
            ax.errorbar([p["load"]], [c["value"] * scale],
                        yerr=[[max(0.0, (c["value"] - c["low"]) * scale)], [max(0.0, (c["high"] - c["value"]) * scale)]],
                        fmt="o", color=colour, capsize=3)
        ax.plot(loads, [c["value"] * scale for c in checks], color="grey", alpha=0.4, zorder=0)
        ax.axhline(checks[0]["limit"] * scale, color="black", linestyle="--", label=f"SLO {name}")
        if result and result.get("last_pass") is not None:
            ax.axvline(result["last_pass"], color="tab:blue", label=f"capacity {result['last_pass']:g} {result['unit']}")
        if result and result.get("last_pass") is not None and result.get("first_fail") is not None:
            ax.axvspan(result["last_pass"], result["first_fail"], color="tab:blue", alpha=0.12, label="uncertainty")
        if max(loads) / min(loads) >= 8:  # a ramp doubles the load: log spacing, labelled with the loads tried
            ax.set_xscale("log")
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xticks(loads, [f"{v:g}" for v in loads], fontsize=8)
        ax.set_xlabel(AXIS_LABELS[result["by"]] if result else "load")
        ax.set_ylabel("% of requests within every SLO" if ratio else f"{name.split('<=')[0]} (ms)")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"capacity under SLO{': ' + title if title else ''} (green pass, red fail, orange close; "
                 "bars: 95% interval)", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
