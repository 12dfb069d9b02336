"""Overlap scheduling on CPU: the host reads step N-1 back while step N runs, and nothing changes for clients.

Same code path as on CUDA (tokens fed to the next step on the device, read back a step late, the extra
token of a stopped request dropped): its output equals transformers' and the engine without overlap.
"""

import pytest

from service.engine import SamplingParams
from tests.conftest import make_engine, reference_greedy
from tests.engine.test_engine_behaviour import PROMPT
from tests.engine.test_engine_equivalence import mixed_prompts


@pytest.fixture(scope="module")
def tiny_case(tiny_model):
    prompts = mixed_prompts(tiny_model, 32, seed=11)
    return tiny_model, prompts, [reference_greedy(tiny_model, p, 12) for p in prompts]


def greedy(n=12):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("overrides", [{}, {"num_blocks": 25}, {"max_num_batched_tokens": 13}],
                         ids=["plain", "preemption", "chunked"])
def test_overlap_greedy_matches_transformers(tiny_case, overrides):
    loaded, prompts, references = tiny_case
    engine = make_engine(loaded, overlap=True, max_num_seqs=32, **overrides)
    outs = engine.generate(prompts, greedy())
    assert [o["token_ids"] for o in outs] == references
    if "num_blocks" in overrides:
        assert engine.scheduler.num_preemptions > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


def test_overlap_step_returns_the_previous_steps_tokens(tiny_model):
    engine = make_engine(tiny_model, overlap=True)
    engine.add_request([5, 6, 7], greedy(3))
    assert engine.step() == []  # the prefill is launched, its token not read back yet
    first = engine.step()  # launches the first decode, reads back the prefill's token
    assert [o.num_output_tokens for o in first] == [1]
    seq = next(iter(engine.seqs.values()))
    assert seq.num_pending_tokens == 1 and seq.num_computed_tokens == 4
    outs = [engine.step(), engine.step()]
    assert [o.num_output_tokens for step in outs for o in step] == [2, 3] and outs[-1][0].finished
    assert not engine.has_unfinished()


def test_overlap_schedules_nothing_past_max_tokens(tiny_model):
    """A request whose last allowed token is still on the device is not scheduled again: no wasted step."""
    counts = {}
    for overlap in (False, True):
        engine = make_engine(tiny_model, overlap=overlap)
        launched = []
        schedule = engine.scheduler.schedule
        engine.scheduler.schedule = lambda: launched.append(schedule()) or launched[-1]
        engine.generate([[5, 6, 7], [8, 9]], greedy(4))
        while engine.has_unfinished():
            engine.step()
        counts[overlap] = [b.num_tokens for b in launched if b.seqs]
    assert counts[True] == counts[False] == [5, 2, 2, 2]


def test_overlap_prefix_hit_keeps_output(tiny_case):
    loaded, prompts, references = tiny_case
    prompt, reference = next((p, r) for p, r in zip(prompts, references) if len(p) >= 48)
    engine = make_engine(loaded, overlap=True)
    assert engine.generate([prompt], greedy())[0]["token_ids"] == reference
    rid = engine.add_request(prompt, greedy())
    seq = engine.seqs[rid]
    while engine.has_unfinished():
        engine.step()
    assert seq.num_cached_tokens == (len(prompt) - 1) // 16 * 16 > 0
    assert seq.output_token_ids == reference


def stream_all(engine, requests: list[tuple[str, SamplingParams]]) -> dict[str, list]:
    """Every output of every request, as a client would see them: tokens, text deltas, logprobs, end."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    seen = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append((out.new_token_ids, out.text_delta, out.finished, out.finish_reason,
                                         out.num_output_tokens, [(round(c, 4), [t for t, _ in top])
                                                                 for c, top in out.new_logprobs]))
    return [seen[rid] for rid in ids]


def every_kind_of_end(default_model, logprobs_tokens: int = 12) -> list[tuple[str, SamplingParams]]:
    """Requests that end by a stop string, a stop token, min_tokens and logprobs to max_tokens, EOS, seeded sampling
    and max_tokens, in that order, on the default model."""
    base = make_engine(default_model, overlap=False).generate([PROMPT], SamplingParams(max_tokens=30, temperature=0))
    text = base[0]["text"]
    return [
        (PROMPT, SamplingParams(max_tokens=30, temperature=0, stop=[text[12:16]])),
        (PROMPT, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[base[0]["token_ids"][5]])),
        (PROMPT, SamplingParams(max_tokens=logprobs_tokens, min_tokens=logprobs_tokens, temperature=0, logprobs=3)),
        ("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n", SamplingParams(max_tokens=100, temperature=0)),
        (PROMPT, SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, top_k=40, seed=7)),
        (PROMPT, SamplingParams(max_tokens=25, temperature=0, ignore_eos=True)),
    ]


def test_overlap_streams_exactly_what_the_engine_without_overlap_streams(default_model):
    """Stop strings, stop tokens, min_tokens, EOS, max_tokens, logprobs and seeded sampling, in one batch."""
    requests = every_kind_of_end(default_model)
    off = stream_all(make_engine(default_model, overlap=False), requests)
    on = stream_all(make_engine(default_model, overlap=True), requests)
    assert on == off
    assert [o[-1][3] for o in on] == ["stop", "stop", "length", "stop", "length", "length"]


def test_overlap_abort_mid_stream_drops_the_in_flight_token_and_frees_blocks(tiny_case):
    loaded, prompts, references = tiny_case
    engine = make_engine(loaded, overlap=True)
    keep = engine.add_request(prompts[0], greedy())
    gone = engine.add_request(prompts[1], greedy(100))
    before = [o for _ in range(4) for o in engine.step()]
    aborted = engine.abort(gone)
    assert aborted.finished and aborted.finish_reason == "abort"
    assert [o.num_output_tokens for o in before if o.request_id == gone] == [1, 2, 3] and aborted.num_output_tokens == 3
    after = []
    while engine.has_unfinished():
        after += engine.step()
    assert gone not in {o.request_id for o in after}  # its token in flight at the abort is never sent
    assert [t for o in before + after if o.request_id == keep for t in o.new_token_ids] == references[0]
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks and not engine.seqs


def test_overlap_failed_step_ends_its_requests_with_error_and_keeps_serving(tiny_case):
    loaded, prompts, references = tiny_case
    engine = make_engine(loaded, overlap=True)
    forward, calls = engine.runner.forward, []

    def third_fails(batch):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return forward(batch)

    engine.runner.forward = third_fails
    rids = [engine.add_request(p, greedy()) for p in prompts[:2]]
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    last = {o.request_id: o for o in outs}
    assert [last[r].finish_reason for r in rids] == ["error", "error"]
    assert [last[r].num_output_tokens for r in rids] == [2, 2]  # the two steps before the failure were read back
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks and not engine.seqs
    assert engine.generate([prompts[3]], greedy())[0]["token_ids"] == references[3]


def test_overlap_step_stats_report_each_token_once(tiny_case):
    loaded, prompts, _ = tiny_case
    stats = {}
    for overlap in (False, True):
        engine = make_engine(loaded, overlap=overlap, num_blocks=25, max_num_seqs=32)
        steps = []
        engine.observer = steps.append
        engine.generate(prompts, greedy())
        while engine.has_unfinished():
            engine.step()
        ran = [s for s in steps if s.phase]
        stats[overlap] = (sorted((o.request_id, o.num_output_tokens) for s in ran for o in s.outputs),
                          sorted(o.request_id for s in ran for o in s.first_tokens),
                          sorted(o.request_id for s in ran for o in s.finished),
                          sum(len(s.preempted) for s in steps) > 0)
        assert all(s.duration >= 0 for s in ran)
    assert stats[True] == stats[False]
    assert len(stats[True][0]) == 32 * 12 and len(stats[True][2]) == 32 and stats[True][3]


def test_overlap_bench_times_both_modes_and_stores_the_run(tmp_path, capsys):
    from service.bench.offline import overlap
    result = overlap.main(["--model", "random:tiny", "--num-requests", "3", "--input-len", "uniform:4-9",
                           "--output-len", "3", "--runs", "1", "--profile-steps", "2", "--db", str(tmp_path / "b.db")])
    assert sorted(result["modes"]) == ["off", "on"]
    assert all(m["tokens"] == 9 and len(m["runs"]) == 1 and m["profile"]["steps"] == 2 for m in result["modes"].values())
    assert "stored as run 1" in capsys.readouterr().out


def test_overlap_decode_steps_are_decode_steps(tiny_case):
    """With overlap a decoding sequence's last token is still on the device when its next step is scheduled: the
    step is a decode step all the same (telemetry's phase label, the step profile's kinds)."""
    loaded, prompts, _ = tiny_case
    engine = make_engine(loaded, overlap=True)
    phases, launch = [], engine._launch
    engine._launch = lambda batch, *rest: phases.append(batch.phase) or launch(batch, *rest)
    for p in prompts[:3]:
        engine.add_request(p, greedy(6))
    while engine.has_unfinished():
        engine.step()
    assert phases == ["prefill"] + ["decode"] * 5


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_stop_token_right_after_min_tokens_stops_there(tiny_case, overlap):
    """min_tokens=k bans the stop token for the first k tokens only (tokens still on the device count): a stop
    token that greedy decoding reaches as token k+1 ends the request there, with reason stop."""
    loaded, prompts, references = tiny_case
    out = references[0]
    k = next(i for i in range(1, len(out)) if out[i] not in out[:i])  # its first appearance
    engine = make_engine(loaded, overlap=overlap)
    params = SamplingParams(max_tokens=12, min_tokens=k, stop_token_ids=[out[k]], temperature=0, ignore_eos=True)
    rid = engine.add_request(prompts[0], params)
    tokens, reason = [], None
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id == rid
            tokens += o.new_token_ids
            reason = o.finish_reason or reason
    assert (tokens, reason) == (out[:k + 1], "stop")


def test_steps_bench_accounts_for_every_step_of_each_run(tmp_path, capsys):
    """bench's step profile: each of its runs (overlap on as served, off, off under the profiler) schedules the
    same steps, each step counted once under its kind; every kind's time adds up to its run's (here over an 8-bit
    KV cache, which the stored configuration names)."""
    from service.bench.offline import steps
    from service.bench.store import open_store
    from service.bench.store.provenance import stable_hash
    result = steps.main(["--model", "random:tiny", "--overlap", "on", "--num-requests", "6", "--input-len", "uniform:4-40",
                         "--output-len", "uniform:2-9", "--max-num-batched-tokens", "64", "--top-kernels", "3",
                         "--kv-cache-dtype", "fp8", "--db", str(tmp_path / "b.db")])
    kinds = {r["kind"]: r for r in result["kinds"]}
    assert {"prefill, eager", "decode, eager"} <= set(kinds)
    counts = [sum(r[f"{run} steps"] for r in kinds.values()) for run in ("served", "wall", "busy")]
    assert counts[0] == counts[1] == counts[2] > 0
    assert all(r["served steps"] == r["wall steps"] == r["busy steps"] for r in kinds.values())
    assert sum(r["served"] for r in kinds.values()) <= result["served_seconds"]
    assert "stored as run 1" in capsys.readouterr().out
    config = {"model": "random:tiny", "num_requests": 6, "input_len": "uniform:4-40", "output_len": "uniform:2-9",
              "seed": 1, "kv_cache_dtype": "fp8"}
    assert open_store(str(tmp_path / "b.db")).find_done("steps", stable_hash(config)) == [1]


def test_steps_bench_gives_each_step_the_work_that_started_in_it_on_the_compute_streams_ranges():
    """Two steps; the GPU has a range per step on the compute stream (7) and on the copy stream (9); inductor's
    annotation range and a kernel between the steps are not a step's work."""
    from service.bench.offline.steps import STEP, Event, attribute
    gpu = [Event(STEP, True, True, 7, 100, 200), Event(STEP, True, True, 7, 300, 400),
           Event(STEP, True, True, 9, 190, 210), Event(STEP, True, True, 9, 390, 410),
           Event("## Call CompiledFxGraph ##", True, True, 7, 110, 180),
           Event("nvjet_tst", True, False, 7, 110, 150), Event("_paged_attention_kernel", True, False, 7, 150, 190),
           Event("Memcpy DtoH (Device -> Pinned)", True, False, 9, 195, 205), Event("stray", True, False, 7, 250, 260),
           Event("sm90_xmma_gemm", True, False, 7, 310, 390)]
    host = [Event(STEP, False, True, 0, 0, 250), Event(STEP, False, True, 0, 250, 450)]
    steps = [{"call": 0}, {"call": 1}]
    attribute(steps, host + gpu)
    assert [round(s["busy"] * 1e9) for s in steps] == [90, 80]
    assert {k: round(v * 1e9) for k, v in steps[0]["by_kind"].items()} == {"matmul": 40, "attention": 40, "copy": 10}
    assert dict(steps[1]["by_kernel"]) == {"sm90_xmma_gemm": 80e-9}
    # without one GPU range a step (here: none, as on the CPU), the host's ranges bound the steps
    cpu = [{"call": 0}, {"call": 1}]
    attribute(cpu, host + [e for e in gpu if e.name != STEP])
    assert [round(s["busy"] * 1e9) for s in cpu] == [90, 90]  # by the host's ranges the stray kernel is step 1's


def test_steps_bench_names_kernels_and_merges_busy_time():
    from service.bench.offline.steps import busy_union, kernel_kind, top_kernels
    steps = [{"kind": "decode, graph", "busy": 0.004, "by_kernel": {"nvjet_a": 0.002, "_paged_attention_kernel": 0.001}},
             {"kind": "decode, graph", "busy": 0.004, "by_kernel": {"nvjet_a": 0.002, "triton_poi_fused_0": 0.001}}]
    assert top_kernels(steps, 2) == {"decode, graph": [("nvjet_a", "matmul", 2.0, 0.5),
                                                       ("_paged_attention_kernel", "attention", 0.5, 0.125)]}
    assert [kernel_kind(n) for n in ("_paged_attention_kernel", "nvjet_tst_128x64", "sm90_xmma_gemm_bf16",
                                     "Memcpy HtoD (Pinned -> Device)", "triton_poi_fused_add_rms_norm_0",
                                     "void at::native::index_copy_kernel", "_write_kv_kernel",
                                     "at::native::index_elementwise_kernel", "_scatter_gather_elementwise_kernel")] == \
        ["attention", "matmul", "matmul", "copy", "other", "kv write", "kv write", "other", "other"]
    assert busy_union([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_held_admissions_change_no_output_and_free_every_block(tiny_case, overlap):
    """Requests arriving one a step while the batch decodes wait (admission_wait_steps, the CUDA default's
    policy) and join together: every output still equals transformers', and the cache ends empty."""
    loaded, prompts, references = tiny_case
    engine = make_engine(loaded, overlap=overlap, max_num_seqs=8, admission_wait_steps=3)
    held, outputs, ids = [], {}, []
    for p in prompts[:6]:  # 6 of at most 8 running: under load
        ids.append(engine.add_request(p, greedy()))
    pending = list(prompts[6:16])
    while engine.has_unfinished() or pending:
        if pending:
            ids.append(engine.add_request(pending.pop(0), greedy()))
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        held.append(engine.scheduler.held_steps)
    assert [outputs[i] for i in ids] == references[:16]
    assert max(held) == 3  # arrivals were held, never longer than the limit
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
