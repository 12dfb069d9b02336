"""The load generator's statistics, schedules and prompt sources, on synthetic inputs with known answers."""

import json
import math

import numpy as np
import pytest

from service.bench import slo
from service.bench.loadgen.workload import arrivals, datasets
from service.bench.loadgen.results import latency
from service.bench.loadgen.send.request import RequestResult
from service.bench.loadgen.results.summary import max_in_flight, summarize


def test_percentiles_are_numpy_linear_with_known_values():
    d = latency.distribution([4.0, 1.0, 3.0, 2.0], (50, 90, 99))
    # rank p/100 * (n - 1) on the sorted values 1, 2, 3, 4: p90 -> rank 2.7 -> 3 + 0.7 * (4 - 3)
    assert d == pytest.approx({"mean": 2.5, "median": 2.5, "p90": 3.7, "p99": 3.97})
    hundred = latency.distribution(np.arange(1, 101), (50, 95, 99.9))
    assert hundred == pytest.approx({"mean": 50.5, "median": 50.5, "p95": 95.05, "p99.9": 99.901})


def test_undefined_values_are_left_out_and_nothing_gives_none():
    assert latency.distribution([1.0, math.nan, 3.0], (90,)) == pytest.approx({"mean": 2.0, "median": 2.0, "p90": 2.8})
    assert latency.distribution([], (50, 99)) == {"mean": None, "median": None, "p99": None}


def test_parse_percentiles():
    assert latency.parse_percentiles("50,90,99.9") == (50.0, 90.0, 99.9)
    for bad in ("", "101", "-1", "50,x"):
        with pytest.raises(ValueError):
            latency.parse_percentiles(bad)


def test_tpot_excludes_the_first_token_and_is_undefined_below_two_tokens():
    t = latency.tpot(e2e=[1.0, 0.5, 0.3, 2.0], ttft=[0.1, 0.5, 0.3, 0.5], output_tokens=[10, 1, 0, 4])
    assert t[0] == pytest.approx(0.1) and t[3] == pytest.approx(0.5)
    assert math.isnan(t[1]) and math.isnan(t[2])


@pytest.mark.parametrize("text, metric, seconds", [
    ("ttft:500ms", "ttft", 0.5), ("tpot:0.05s", "tpot", 0.05), ("e2e:2s", "e2e", 2.0), ("itl=30", "itl", 0.03),
    ("TTFT: 1.5 s", "ttft", 1.5)])
def test_parse_slo(text, metric, seconds):
    parsed = slo.parse(text)
    assert parsed.metric == metric and parsed.seconds == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["latency:1s", "ttft:-5ms", "ttft:0ms", "ttft:fast", "ttft", "ttft:5min"])
def test_parse_slo_rejects_nonsense(text):
    with pytest.raises(ValueError):
        slo.parse(text)


def test_one_slo_grammar_says_a_per_request_bound_and_a_percentile_target():
    bound, target = slo.parse("ttft:500ms"), slo.parse("ttft:p95<=500ms")
    assert (bound, target) == (slo.SLO("ttft", 0.5), slo.SLO("ttft", 0.5, percentile=95.0))
    assert slo.parse("ttft<=500ms") == slo.parse("ttft=0.5s") == bound
    assert (str(bound), str(target)) == ("ttft<=500ms", "ttft:p95<=500ms")
    assert slo.parse(str(target)) == target and slo.parse(str(bound)) == bound
    for bad in ("ttft:p95:500ms", "ttft:p95=500ms", "ttft:p95<500ms"):  # a percentile is always a target: <=
        with pytest.raises(ValueError, match="SLO"):
            slo.parse(bad)


def test_goodput_counts_requests_within_every_slo_per_second():
    ttft = np.array([0.1, 0.6, 0.2, 0.3, 0.1])
    tpot = np.array([0.01, 0.01, 0.08, math.nan, 0.02])  # the fourth request has a single token: no TPOT
    max_itl = np.array([0.02, 0.02, 0.2, math.nan, 0.5])
    e2e = np.array([1.0, 1.0, 1.0, 0.3, 1.0])
    ok = np.array([True, True, True, True, False])  # the last one failed
    slos = [slo.parse("ttft:500ms"), slo.parse("tpot:50ms")]
    met = slo.meets(slos, ttft, tpot, max_itl, e2e, ok)
    assert met.tolist() == [True, False, False, True, False]
    assert slo.goodput(met, duration=4.0) == 0.5
    itl = slo.meets([slo.parse("itl:100ms")], ttft, tpot, max_itl, e2e, ok)
    assert itl.tolist() == [True, True, False, True, False]
    assert slo.goodput(met, duration=0.0) == 0.0


@pytest.mark.parametrize("rate, burstiness", [(4.0, 1.0), (4.0, 0.25), (10.0, 4.0)])
def test_gamma_gaps_have_mean_one_over_rate_and_variance_one_over_shape_rate_squared(rate, burstiness):
    n = 200_000
    gaps = np.diff(arrivals.first_arrivals(n + 1, rate, burstiness, seed=7))
    # 5 standard errors: the mean's is sigma / sqrt(n); the variance's is sigma^2 sqrt((2 + 6 / k) / n)
    sigma2 = 1 / (burstiness * rate**2)
    assert gaps.mean() == pytest.approx(1 / rate, abs=5 * math.sqrt(sigma2 / n))
    assert gaps.var() == pytest.approx(sigma2, abs=5 * sigma2 * math.sqrt((2 + 6 / burstiness) / n))


def test_constant_and_infinite_rates():
    assert arrivals.first_arrivals(4, 2.0, constant=True).tolist() == [0.0, 0.5, 1.0, 1.5]
    assert arrivals.first_arrivals(3, math.inf).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrivals.first_arrivals(3, 0.0)


def test_same_seed_gives_the_same_arrivals_prompts_and_lengths():
    a, b = arrivals.first_arrivals(50, 5.0, 0.5, seed=3), arrivals.first_arrivals(50, 5.0, 0.5, seed=3)
    assert a.tolist() == b.tolist() and a[0] == 0 and np.all(np.diff(a) >= 0)
    assert arrivals.first_arrivals(50, 5.0, 0.5, seed=4).tolist() != a.tolist()
    # a longer run starts with the same schedule as a shorter one
    assert arrivals.first_arrivals(80, 5.0, 0.5, seed=3)[:50].tolist() == a.tolist()
    w1, w2 = (datasets.RandomWorkload(100, 20, 0.5, seed=3, id_range=(10, 500)) for _ in range(2))
    assert [w1.sample(i) for i in range(20)] == [w2.sample(i) for i in range(20)]
    other = datasets.RandomWorkload(100, 20, 0.5, seed=4, id_range=(10, 500))
    assert [other.sample(i) for i in range(20)] != [w1.sample(i) for i in range(20)]
    b1, b2 = datasets.builtin(seed=3), datasets.builtin(seed=3)
    assert [b1.sample(i) for i in range(60)] == [b2.sample(i) for i in range(60)]


def test_random_lengths_stay_in_the_range_ratio_and_ids_in_their_range():
    w = datasets.RandomWorkload(100, 20, 0.5, seed=1, id_range=(10, 500), prefix_len=7)
    samples = [w.sample(i) for i in range(300)]
    lengths = [s.prompt_len - 7 for s in samples]
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 30
    assert all(10 <= s.output_len <= 30 for s in samples)
    assert all(isinstance(t, int) and 10 <= t < 500 for s in samples for t in s.prompt)
    assert all(s.prompt[:7] == samples[0].prompt[:7] for s in samples)  # the shared prefix
    fixed = datasets.RandomWorkload(64, 8, 0.0, seed=1).sample(5)
    assert fixed.prompt_len == len(fixed.prompt) == 64 and fixed.output_len == 8
    words = datasets.RandomWorkload(10, 8, prompt_kind="words").sample(0)
    assert isinstance(words.prompt, str) and len(words.prompt.split()) == 10
    with pytest.raises(ValueError):
        datasets.RandomWorkload(10, 8, range_ratio=1.0)


def test_the_builtin_set_is_visited_whole_in_each_shuffled_pass():
    w = datasets.builtin(seed=0)
    n = len(w.samples)
    first, second = [w.sample(i) for i in range(n)], [w.sample(i) for i in range(n, 2 * n)]
    assert sorted(s.prompt for s in first) == sorted(s.prompt for s in second) == sorted(s.prompt for s in w.samples)
    assert first != second
    assert all(s.output_len == 12 for s in (datasets.builtin(output_len=12).sample(i) for i in range(n)))


def test_sharegpt_takes_the_first_exchange_and_filters_as_vllm_does(tmp_path):
    path = tmp_path / "sg.json"
    long_reply = "word " * 400  # 2000 characters: about 500 tokens
    path.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "Explain the water cycle briefly."},
                                      {"from": "gpt", "value": long_reply}, {"from": "human", "value": "more"}]},
        {"id": "too-short", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello!"}]},
        {"id": "one-turn", "conversations": [{"from": "human", "value": "anyone there?"}]},
        {"id": "too-long", "conversations": [{"from": "human", "value": "x" * 8000}, {"from": "gpt", "value": "ok ok ok ok ok ok"}]},
        {"id": "openai-style", "messages": [{"role": "user", "content": "Write a poem about rain."},
                                            {"role": "assistant", "content": "Rain taps the window glass."}]},
    ]))
    w = datasets.sharegpt(str(path), seed=0)
    prompts = {s.prompt: s for s in w.samples}
    assert set(prompts) == {"Explain the water cycle briefly.", "Write a poem about rain."}
    assert prompts["Explain the water cycle briefly."].output_len == 500
    assert all(s.output_len == 16 for s in datasets.sharegpt(str(path), output_len=16).samples)


def _result(i, sent, ended, chunks, tokens=None, error=None, ready=None):
    r = RequestResult(i, scheduled=sent, ready=sent if ready is None else ready, sent=sent, chunk_times=chunks,
                      e2e=None if error else ended - sent, ended=ended, prompt_tokens=10,
                      output_tokens=tokens if tokens is not None else len(chunks), usage_reported=True,
                      status=503 if error else 200, error=error)
    return r


def test_summary_of_synthetic_requests():
    results = [_result(0, 0.0, 1.0, [0.2, 0.3, 0.4, 0.5, 0.6]),  # ttft 0.2, tpot (1.0 - 0.2) / 4 = 0.2
               _result(1, 0.5, 1.5, [0.1, 0.2]),  # ttft 0.1, tpot 0.9
               _result(2, 1.0, 1.01, [], error="http_503"),
               _result(3, 1.5, 2.0, [0.3], ready=1.4)]  # one token: no TPOT; sent 100 ms after it could be
    s = summarize(results, duration=2.0, percentiles=(50, 99), slos=[slo.parse("tpot:500ms")])
    assert s["requests.sent"] == 4 and s["requests.completed"] == 3 and s["requests.failed"] == 1
    assert s["errors.http_503"] == 1 and s["output_tokens"] == 8 and s["input_tokens"] == 30
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 4.0 and s["total_throughput"] == 19.0
    assert s["ttft_ms.mean"] == pytest.approx(200.0) and s["ttft_ms.median"] == pytest.approx(200.0)
    assert s["tpot_ms.mean"] == pytest.approx(550.0)
    assert s["itl_ms.mean"] == pytest.approx(100.0)  # five gaps of 100 ms
    assert s["e2e_ms.median"] == pytest.approx(1000.0)
    assert s["goodput"] == 1.0 and s["goodput_ratio"] == 0.5  # requests 0 and 3 meet TPOT <= 500 ms
    assert s["dispatch_lag_ms.max"] == pytest.approx(100.0) and s["dispatch_lag_ms.mean"] == pytest.approx(25.0)
    assert s["achieved_rate"] == pytest.approx(2.0) and s["offered_rate"] is None
    assert s["concurrency.max"] == 2 and s["concurrency.mean"] == pytest.approx((1.0 + 1.0 + 0.01 + 0.5) / 2.0)


def test_max_in_flight_does_not_count_a_request_that_starts_as_another_ends():
    rs = [_result(0, 0.0, 1.0, [0.1]), _result(1, 1.0, 2.0, [0.1]), _result(2, 1.5, 3.0, [0.1])]
    assert max_in_flight(rs) == 2
