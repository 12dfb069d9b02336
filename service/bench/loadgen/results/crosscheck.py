"""Cross-check the client's numbers against the server's own Prometheus metrics, scraped before and after a run.

From the deltas: server TTFT mean (sum / count) and bucket-interpolated p50 / p95 next to the client's, the mean
gap between output tokens (the server's inter-token histogram, sum / count, next to the client's first-to-last
token time over its gaps: chunks that carry several tokens count as they should), and the server's token and
request counters next to the client's `usage` sums. The share of the prompt tokens the server looked up in its
prefix cache and found there is reported beside them: a run whose prompts the server has seen (an earlier run with
the same --seed) skips their prefill and is faster for it, which a note then says. Client TTFT is a little larger than the
server's: it also holds the HTTP request's way in (until the server parses its first bytes, where this service's
clock starts) and the first chunk's way out. A server without these metrics gets a note, never an error.
"""

import functools
import math
import time
from dataclasses import dataclass

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from service.telemetry.metrics import histogram_quantile

# metric names per server kind; the first whose TTFT histogram the server exports is used
NAME_SETS = {
    "llm-service": {"ttft": "llm_time_to_first_token_seconds", "itl": "llm_time_per_output_token_seconds",
                    "prompt": "llm_prompt_tokens_total",
                    # (found, not found) in the prefix cache, both counted as each request is admitted
                    "cache": [("llm_prompt_tokens_cached_total", "llm_prompt_tokens_computed_total", False)],
                    "generation": "llm_generation_tokens_total", "requests": "llm_requests_total",
                    "model_label": "model"},
    "vllm": {"ttft": "vllm:time_to_first_token_seconds", "itl": "vllm:inter_token_latency_seconds",
             "prompt": "vllm:prompt_tokens_total",
             # (hits, queries) in tokens; older releases named them gpu_prefix_cache_...
             "cache": [("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", True),
                       ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total", True)],
             "generation": "vllm:generation_tokens_total", "requests": "vllm:request_success_total",
             "model_label": "model_name"},
}

# Agreement rules, stated: token and request counts are exact when the run is the server's only traffic and no
# request failed after reaching the engine; client TTFT may exceed the server's by the HTTP overhead, at most
# TTFT_OVERHEAD_S or TTFT_OVERHEAD_RATIO of the server's mean, whichever is larger, and never be below it.
# Measured with an independent client (guidellm; docs/load-generator.md): a loopback round trip of a few ms, and on a
# CPU-starved host up to ~1.2% of the server's mean, so 10 ms or 5% leaves room for both.
TTFT_OVERHEAD_S = 0.010
TTFT_OVERHEAD_RATIO = 0.05
# a run whose prompt tokens came from the prefix cache at this share or more gets a note: its figures are not those
# of prompts the server has not seen
CACHED_NOTE_SHARE = 0.05
# The mean inter-token gap may differ either way (the network may bunch or spread chunks), by the same bound.

Samples = list[tuple[str, dict, float]]


@functools.cache
def _client() -> httpx.Client:
    """One client for every scrape of this process (each new one builds a TLS context, about 50 ms of CPU), with
    no connection kept between scrapes: the server may have closed it during the run."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def scrape(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> tuple[Samples | None, str]:
    """All samples of GET /metrics, or None and why not."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = _client().get(base_url.rstrip("/") + "/metrics", timeout=timeout, headers=headers)
    except httpx.HTTPError as exc:
        return None, f"GET /metrics failed: {exc!r}"
    if r.status_code != 200:
        return None, f"GET /metrics answered {r.status_code}"
    try:
        return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(r.text) for s in f.samples], ""
    except ValueError as exc:
        return None, f"/metrics is not Prometheus text: {exc}"


def _select(samples: Samples, name: str, model_label: str, model: str | None) -> list[tuple[dict, float]]:
    """Samples of one name; only the model's series when the server labels one with it, else all of them."""
    rows = [(labels, value) for n, labels, value in samples if n == name]
    mine = [row for row in rows if row[0].get(model_label) == model]
    return mine or rows


def _total(samples: Samples, name: str, model_label: str, model: str | None) -> float:
    return sum(v for _, v in _select(samples, name, model_label, model))


def _buckets(samples: Samples, name: str, model_label: str, model: str | None) -> dict[float, float]:
    out: dict[float, float] = {}
    for labels, value in _select(samples, name + "_bucket", model_label, model):
        le = float(labels["le"])
        out[le] = out.get(le, 0.0) + value
    return out


def bucket_of(value: float, buckets: dict[float, float]) -> tuple[float, float]:
    """The (lower, upper] bucket bounds that hold a value."""
    lower = 0.0
    for le in sorted(buckets):
        if value <= le:
            return lower, le
        lower = le
    return lower, math.inf


@dataclass
class ServerDelta:
    kind: str
    ttft_sum: float
    ttft_count: float
    ttft_buckets: dict[float, float]
    prompt_tokens: float
    generation_tokens: float
    requests: float
    itl_sum: float = 0.0  # the inter-token histogram's delta (0 when the server has none)
    itl_count: float = 0.0
    cached_share: float | None = None  # of the prompt tokens looked up in the prefix cache, those found (None: unsaid)


def server_delta(before: Samples, after: Samples, model: str | None) -> ServerDelta | None:
    """What the server recorded between two scrapes, under the first metric name set it exports."""
    for kind, names in NAME_SETS.items():
        if any(n == names["ttft"] + "_count" for n, _, _ in after):
            label = names["model_label"]
            d = lambda name: _total(after, name, label, model) - _total(before, name, label, model)
            b0, b1 = _buckets(before, names["ttft"], label, model), _buckets(after, names["ttft"], label, model)
            return ServerDelta(kind, d(names["ttft"] + "_sum"), d(names["ttft"] + "_count"),
                               {le: c - b0.get(le, 0.0) for le, c in b1.items()}, d(names["prompt"]),
                               d(names["generation"]), d(names["requests"]), d(names["itl"] + "_sum"),
                               d(names["itl"] + "_count"), _cached_share(after, d, names["cache"]))
    return None


def _cached_share(after: Samples, d, alternatives) -> float | None:
    """Found over looked up in the prefix cache, from the first (found, other, other-is-the-total) names the server
    exports; None when it exports none of them or looked nothing up."""
    names = {n for n, _, _ in after}
    for found, other, total in alternatives:
        if found in names and other in names:
            hits, looked = d(found), d(other) + (0 if total else d(found))
            return hits / looked if looked > 0 else None
    return None


def compare(delta: ServerDelta, ttft_s: list[float], prompt_tokens: int, output_tokens: int, completed: int,
            decode: tuple[float, int] | None = None) -> dict:
    """Client next to server, with the tolerance each pair is held to and whether it holds. `decode`: the client's
    first-to-last token seconds summed over its requests, and their gaps (output tokens - 1, summed)."""
    rows = {}

    def exact(name, client, server):
        rows[name] = {"client": client, "server": server, "tolerance": "exact", "agrees": client == server}

    exact("output_tokens", output_tokens, int(delta.generation_tokens))
    exact("input_tokens", prompt_tokens, int(delta.prompt_tokens))
    exact("first_tokens", len(ttft_s), int(delta.ttft_count))
    exact("finished_requests", completed, int(delta.requests))
    if delta.ttft_count > 0 and ttft_s:
        server_mean = delta.ttft_sum / delta.ttft_count
        slack = max(TTFT_OVERHEAD_S, TTFT_OVERHEAD_RATIO * server_mean)
        client_mean = float(np.mean(ttft_s))
        rows["ttft_ms.mean"] = {"client": client_mean * 1e3, "server": server_mean * 1e3,
                                "tolerance": f"0 <= client - server <= {slack * 1e3:.1f} ms",
                                "agrees": 0 <= client_mean - server_mean <= slack}
        for q in (0.5, 0.95):
            server_q = histogram_quantile(q, delta.ttft_buckets)
            client_q = float(np.percentile(ttft_s, q * 100))
            lower, upper = bucket_of(server_q, delta.ttft_buckets)
            rows[f"ttft_ms.p{q * 100:g}"] = {
                "client": client_q * 1e3, "server": server_q * 1e3,
                "tolerance": f"client in the server's bucket ({lower * 1e3:g}, {upper * 1e3:g}] ms + {slack * 1e3:.1f} ms",
                "agrees": lower <= client_q <= upper + slack}
    if delta.itl_count > 0 and decode and decode[1] > 0:
        server_mean, client_mean = delta.itl_sum / delta.itl_count, decode[0] / decode[1]
        slack = max(TTFT_OVERHEAD_S, TTFT_OVERHEAD_RATIO * server_mean)
        rows["itl_ms.mean"] = {"client": client_mean * 1e3, "server": server_mean * 1e3,
                               "tolerance": f"|client - server| <= {slack * 1e3:.1f} ms",
                               "agrees": abs(client_mean - server_mean) <= slack}
    return rows


def check_run(base_url: str, api_key: str | None, model: str, before: Samples | None, why: str, results) -> dict:
    """Scrape again after a run and hold the client's results against the server's deltas (or say why not)."""
    if before is None:
        return {"note": f"no server metrics ({why}); client numbers only"}
    ok = [r for r in results if r.ok]
    delta = None
    for _ in range(10):  # the server may count a request's tokens just after its last chunk went out
        after, why = scrape(base_url, api_key)
        if after is None:
            return {"note": f"no server metrics after the run ({why})"}
        delta = server_delta(before, after, model)
        if delta is None or delta.requests >= len(ok):
            break
        time.sleep(0.2)
    if delta is None:
        return {"note": "the server's /metrics holds none of the known TTFT histograms "
                        f"({', '.join(n['ttft'] for n in NAME_SETS.values())}); client numbers only"}
    streamed = [r for r in ok if len(r.chunk_times) > 1 and (r.output_tokens or 0) > 1]
    decode = (sum(r.chunk_times[-1] - r.chunk_times[0] for r in streamed), sum(r.output_tokens - 1 for r in streamed))
    rows = compare(delta, [r.ttft for r in ok], sum(r.prompt_tokens or 0 for r in ok),
                   sum(r.output_tokens or 0 for r in ok), len(ok), decode)
    note = ("counts are exact only when this run was the server's only traffic; client TTFT includes the HTTP "
            "round trip the server does not see")
    share = delta.cached_share
    if share is not None and share >= CACHED_NOTE_SHARE:
        note += (f". The server found {share:.0%} of the prompt tokens it looked up in its prefix cache and skipped "
                 "their prefill: prompts (or prefixes) it had seen before, as an earlier run with the same --seed "
                 "sends, run faster than new ones would")
    return {"kind": delta.kind, "rows": rows, "prompt_cached_share": None if share is None else round(share, 4),
            "note": note}
